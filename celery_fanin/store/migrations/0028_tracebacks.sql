-- celery-fanin schema, version 28: the traceback of a failed child and of a failed successor (issue 40), kept in
-- the database only: never in the successor's message (its outcome lists the error's type and text, as before).
-- The worker writes it after the report that counted the failure, in a statement of its own (a failure is the
-- rare path: the report's one statement is unchanged), once, and bounded by the function, whatever the caller sent.

ALTER TABLE fanin_children ADD COLUMN traceback text;
ALTER TABLE fanin_successors ADD COLUMN traceback text;

-- fanin_note_traceback(text,text)
CREATE FUNCTION fanin_note_traceback(p_task_id text, p_traceback text)
RETURNS boolean
LANGUAGE plpgsql AS $$
BEGIN
    -- Only a child counted as not succeeded, and only the first traceback (the counted run's, as its report was).
    UPDATE fanin_children SET traceback = right(p_traceback, 16000)
     WHERE task_id = p_task_id AND state NOT IN ('pending', 'started', 'succeeded') AND traceback IS NULL;
    RETURN FOUND;
END
$$;

-- fanin_note_successor_traceback(uuid,text,text)
CREATE FUNCTION fanin_note_successor_traceback(p_batch uuid, p_step text, p_traceback text)
RETURNS boolean
LANGUAGE plpgsql AS $$
BEGIN
    UPDATE fanin_successors SET traceback = right(p_traceback, 16000)
     WHERE batch_id = p_batch AND step = p_step AND state = 'failed' AND traceback IS NULL;
    RETURN FOUND;
END
$$;

-- Definer rights, the search path pinned, PUBLIC's EXECUTE revoked; granted to the roles that may report a
-- child's outcome (the workers'), so that a worker granted before this migration goes on without grants.sql.
DO $$
DECLARE
    r regrole;
    f text;
BEGIN
    FOREACH f IN ARRAY ARRAY['fanin_note_traceback(text, text)', 'fanin_note_successor_traceback(uuid, text, text)']
    LOOP
        EXECUTE format('ALTER FUNCTION %s SECURITY DEFINER SET search_path = pg_catalog, %I, pg_temp', f,
                       current_schema());
        EXECUTE format('REVOKE EXECUTE ON FUNCTION %s FROM PUBLIC', f);
        FOR r IN SELECT DISTINCT a.grantee::regrole
                   FROM pg_proc p, aclexplode(p.proacl) a
                  WHERE p.oid = 'fanin_report_terminal(text, uuid, integer, text, text, bytea, text, text, text, text, timestamptz, integer, text)'::regprocedure
                    AND a.privilege_type = 'EXECUTE' AND a.grantee <> 0 AND a.grantee <> p.proowner LOOP
            EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO %s', f, r);
        END LOOP;
    END LOOP;
END
$$;
