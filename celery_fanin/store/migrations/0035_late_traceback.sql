-- celery-fanin schema, version 35: a failed child's traceback is also kept when the report that counted the
-- failure was this copy's own but its answer never reached the worker (a soft time limit during the wait, a group
-- commit's answer that came too late): the worker's resend is then a late report, and it used to write nothing.
-- fanin_note_traceback_v2 takes the error's type and text as reported, and writes only onto a child whose counted
-- failure has that type and text, so a late copy that failed otherwise cannot attach its traceback to another
-- run's failure. fanin_note_traceback stays, for workers not yet restarted.

-- fanin_note_traceback_v2(text,text,text,text)
CREATE FUNCTION fanin_note_traceback_v2(p_task_id text, p_traceback text, p_exc_type text, p_exc_message text)
RETURNS boolean
LANGUAGE plpgsql AS $$
BEGIN
    -- Only a child counted as not succeeded, only the first traceback, and only onto the failure it belongs to.
    UPDATE fanin_children SET traceback = right(p_traceback, 16000)
     WHERE task_id = p_task_id AND state NOT IN ('pending', 'started', 'succeeded') AND traceback IS NULL
       AND exc_type IS NOT DISTINCT FROM p_exc_type AND exc_message IS NOT DISTINCT FROM p_exc_message;
    RETURN FOUND;
END
$$;

-- Definer rights, the search path pinned, PUBLIC's EXECUTE revoked; granted to the roles that may write a child's
-- traceback today, so that a worker granted before this migration goes on without grants.sql.
DO $$
DECLARE
    r regrole;
BEGIN
    EXECUTE format('ALTER FUNCTION fanin_note_traceback_v2(text, text, text, text) SECURITY DEFINER '
                   'SET search_path = pg_catalog, %I, pg_temp', current_schema());
    REVOKE EXECUTE ON FUNCTION fanin_note_traceback_v2(text, text, text, text) FROM PUBLIC;
    FOR r IN SELECT DISTINCT a.grantee::regrole
               FROM pg_proc p, aclexplode(p.proacl) a
              WHERE p.oid = 'fanin_note_traceback(text, text)'::regprocedure
                AND a.privilege_type = 'EXECUTE' AND a.grantee <> 0 AND a.grantee <> p.proowner LOOP
        EXECUTE format('GRANT EXECUTE ON FUNCTION fanin_note_traceback_v2(text, text, text, text) TO %s', r);
    END LOOP;
END
$$;
