-- celery-fanin schema, version 29: an operator runs a failed or revoked successor again (`celery -A proj fanin
-- rerun`, `celery_fanin.ops.reruns.rerun`), once its bug is fixed (issue 40). The rerun is a new delivery under a
-- new task id: the successor row goes back to `pending` with that id, so its run guard (fanin_claim_run_v2, which
-- admits only the row's task id) admits the rerun's message and refuses any copy of an earlier one; its run number
-- goes on from the last (`runs`). Each rerun is recorded here (who, when, what it replaced), and its outbox row is
-- due again, in the same transaction.

CREATE TABLE fanin_successor_reruns (
    batch_id             uuid NOT NULL,
    step                 text NOT NULL,
    rerun                integer NOT NULL,
    task_id              text NOT NULL,
    previous_task_id     text NOT NULL,
    previous_state       text NOT NULL,
    previous_exc_type    text,
    previous_exc_message text,
    previous_runs        integer NOT NULL,
    requested_by         text NOT NULL,
    requested_at         timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT fanin_successor_reruns_pkey PRIMARY KEY (batch_id, step, rerun),
    CONSTRAINT fanin_successor_reruns_previous_state_check CHECK (previous_state IN ('failed', 'revoked')),
    CONSTRAINT fanin_successor_reruns_batch_id_step_fkey FOREIGN KEY (batch_id, step)
        REFERENCES fanin_successors(batch_id, step) ON DELETE CASCADE
);

-- fanin_rerun_successor(uuid,text,text,text)
CREATE FUNCTION fanin_rerun_successor(p_batch uuid, p_step text, p_task_id text, p_by text)
RETURNS TABLE (rerun integer, state text, previous_task_id text, previous_state text)
LANGUAGE plpgsql AS $$
DECLARE
    v_old fanin_successors%ROWTYPE;
    v_rerun integer;
    v_outbox bigint;
BEGIN
    SELECT * INTO v_old FROM fanin_successors s WHERE s.batch_id = p_batch AND s.step = p_step FOR UPDATE;
    IF NOT FOUND THEN
        RETURN;  -- no such successor: the caller says so
    END IF;
    IF v_old.state NOT IN ('failed', 'revoked') THEN
        RETURN QUERY SELECT NULL::integer, v_old.state, v_old.task_id, v_old.state;  -- refused: not failed or revoked
        RETURN;
    END IF;
    -- A round retried since (`retry-failed`): its successor ran again there; rerunning this one would run it twice.
    IF EXISTS (SELECT 1 FROM fanin_batches b, fanin_batches later
                WHERE b.id = p_batch AND later.parent_id IS NULL AND later.round > b.round
                  AND coalesce(later.retry_of, later.id) = coalesce(b.retry_of, b.id)) THEN
        RETURN QUERY SELECT NULL::integer, 'superseded'::text, v_old.task_id, v_old.state;
        RETURN;
    END IF;
    IF p_task_id IS NULL OR p_task_id = '' OR p_task_id = v_old.task_id
       OR EXISTS (SELECT 1 FROM fanin_successor_reruns r
                   WHERE r.batch_id = p_batch AND r.step = p_step AND r.previous_task_id = p_task_id) THEN
        RAISE EXCEPTION 'fanin_rerun_successor: a rerun needs a task id of its own' USING ERRCODE = '22023';
    END IF;
    SELECT coalesce(max(r.rerun), 0) + 1 INTO v_rerun
      FROM fanin_successor_reruns r WHERE r.batch_id = p_batch AND r.step = p_step;
    INSERT INTO fanin_successor_reruns (batch_id, step, rerun, task_id, previous_task_id, previous_state,
                                        previous_exc_type, previous_exc_message, previous_runs, requested_by)
    VALUES (p_batch, p_step, v_rerun, p_task_id, v_old.task_id, v_old.state, v_old.exc_type, v_old.exc_message,
            v_old.runs, left(coalesce(p_by, ''), 200));
    -- `runs` goes on (the next admitted run is runs + 1); everything of the last run's end is cleared.
    UPDATE fanin_successors s
       SET task_id = p_task_id, state = 'pending', state_at = now(), exc_type = NULL, exc_message = NULL,
           result = NULL, result_content_type = NULL, result_content_encoding = NULL, traceback = NULL,
           finished_at = NULL, lease_until = NULL, attempt = 0, run_owner = NULL, run_owner_key = NULL,
           carrier = NULL
     WHERE s.batch_id = p_batch AND s.step = p_step;
    UPDATE fanin_outbox o SET sent_at = NULL, available_at = now(), attempts = 0, last_error = 'rerun'
     WHERE o.batch_id = p_batch AND o.step = p_step
 RETURNING o.id INTO v_outbox;
    IF v_outbox IS NULL THEN  -- pruned rows are gone with their batch; a hand-deleted outbox row is made again
        INSERT INTO fanin_outbox (batch_id, step, last_error) VALUES (p_batch, p_step, 'rerun')
        RETURNING id INTO v_outbox;
    END IF;
    PERFORM pg_notify('fanin_outbox', v_outbox::text);
    RETURN QUERY SELECT v_rerun, 'pending'::text, v_old.task_id, v_old.state;
END
$$;

-- Definer rights, the search path pinned, PUBLIC's EXECUTE revoked; granted to the roles that may cancel a batch
-- (the operator's commands run as the relay's role), as docs/how-to/grants.sql does. Every role that reads the
-- successors may read their reruns, and the outbox (the dashboard's relay panel: its backlog and oldest row).
DO $$
DECLARE
    r regrole;
    f text := 'fanin_rerun_successor(uuid, text, text, text)';
BEGIN
    EXECUTE format('ALTER FUNCTION %s SECURITY DEFINER SET search_path = pg_catalog, %I, pg_temp', f,
                   current_schema());
    EXECUTE format('REVOKE EXECUTE ON FUNCTION %s FROM PUBLIC', f);
    FOR r IN SELECT DISTINCT a.grantee::regrole
               FROM pg_proc p, aclexplode(p.proacl) a
              WHERE p.oid = 'fanin_expire_batch(uuid, text, boolean)'::regprocedure
                AND a.privilege_type = 'EXECUTE' AND a.grantee <> 0 AND a.grantee <> p.proowner LOOP
        EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO %s', f, r);
    END LOOP;
    FOR r IN SELECT DISTINCT a.grantee::regrole
               FROM pg_class c, aclexplode(c.relacl) a
              WHERE c.oid = 'fanin_successors'::regclass
                AND a.privilege_type = 'SELECT' AND a.grantee <> 0 AND a.grantee <> c.relowner LOOP
        EXECUTE format('GRANT SELECT ON fanin_successor_reruns, fanin_outbox TO %s', r);
    END LOOP;
END
$$;
