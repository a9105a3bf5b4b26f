-- celery-fanin schema, version 31: a replaced successor ends when a task of its replacement other than its
-- carrier fails or is revoked (Celery then never publishes the carrier), instead of waiting for it (issue 40).

-- A part of a replaced successor's replacement (a task before its carrier: a chain's earlier task, a chord's header
-- task) failed or was revoked, so Celery will not publish the carrier: the successor ends with it (version 31).
-- Only while it waits for that carrier (state `replaced`, this carrier token): never a run the carrier holds, nor a
-- successor that a later replacement took over, nor one final already. A nested batch's outer child ends with it.
-- fanin_end_replacement(uuid,text,text,text,text,text,text)
CREATE FUNCTION fanin_end_replacement(p_batch uuid, p_step text, p_task_id text, p_carrier text, p_state text,
                                      p_exc_type text, p_exc_message text)
RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    v_parent_task_id text;
BEGIN
    IF p_state NOT IN ('failed', 'revoked') THEN
        RAISE EXCEPTION 'fanin_end_replacement: not a state a part ends it with: %', p_state USING ERRCODE = '22023';
    END IF;
    UPDATE fanin_successors s
       SET state = p_state, exc_type = p_exc_type, exc_message = p_exc_message, state_at = now(),
           finished_at = now(), lease_until = NULL
      FROM fanin_batches b
     WHERE s.batch_id = p_batch AND s.step = p_step AND b.id = s.batch_id
       AND s.state = 'replaced' AND s.task_id = p_task_id AND s.carrier = p_carrier
 RETURNING b.parent_task_id INTO v_parent_task_id;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    IF v_parent_task_id IS NOT NULL THEN
        PERFORM fanin_record_terminal_v2(v_parent_task_id, p_state, NULL, NULL, NULL, p_exc_type, p_exc_message,
                                         NULL, NULL, NULL);
    END IF;
    RETURN true;
END
$$;

-- Definer rights, the search path pinned, PUBLIC's EXECUTE revoked; granted to the roles that may finish a
-- successor (the workers'), so that a worker granted before this migration goes on without grants.sql.
DO $$
DECLARE
    r regrole;
    f text := 'fanin_end_replacement(uuid, text, text, text, text, text, text)';
BEGIN
    EXECUTE format('ALTER FUNCTION %s SECURITY DEFINER SET search_path = pg_catalog, %I, pg_temp', f,
                   current_schema());
    EXECUTE format('REVOKE EXECUTE ON FUNCTION %s FROM PUBLIC', f);
    FOR r IN SELECT DISTINCT a.grantee::regrole
               FROM pg_proc p, aclexplode(p.proacl) a
              WHERE p.oid = 'fanin_finish_successor_v2(uuid, text, text, integer, text, bytea, text, text, text, text, text, integer, text, text)'::regprocedure
                AND a.privilege_type = 'EXECUTE' AND a.grantee <> 0 AND a.grantee <> p.proowner LOOP
        EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO %s', f, r);
    END LOOP;
END
$$;
