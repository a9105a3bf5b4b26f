-- celery-fanin schema, version 33: the relay is woken from one place, fanin_notify_relay, instead of a pg_notify
-- restated in four functions and in the producer's statement (issue 42). No behaviour changes: the same channel,
-- the same payloads, sent by the same transactions.

CREATE FUNCTION fanin_notify_relay(p_payload text)
RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('fanin_outbox', p_payload);
END
$$;

CREATE OR REPLACE FUNCTION fanin_create_successor_v2(p_batch uuid, p_step text, p_task_id text, p_kind text,
                                          p_handoff double precision)
RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    v_outbox bigint;
BEGIN
    INSERT INTO fanin_successors (batch_id, step, task_id, kind)
    VALUES (p_batch, p_step, p_task_id, p_kind)
    ON CONFLICT (batch_id, step) DO NOTHING;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    IF p_handoff > 0 AND p_kind = 'then'
       AND EXISTS (SELECT 1 FROM fanin_batches b WHERE b.id = p_batch AND b.state = 'complete') THEN
        -- Handed to the worker that reported: not due for the relay before the handoff has passed.
        INSERT INTO fanin_outbox (batch_id, step, available_at)
        VALUES (p_batch, p_step, now() + make_interval(secs => p_handoff)) RETURNING id INTO v_outbox;
    ELSE
        INSERT INTO fanin_outbox (batch_id, step) VALUES (p_batch, p_step) RETURNING id INTO v_outbox;
    END IF;
    -- The worker that reported publishes it after this commits: no need to wake the relay (its scan is the fallback).
    IF p_handoff IS NULL THEN
        PERFORM fanin_notify_relay(v_outbox::text);
    END IF;
    RETURN true;
END
$$;

CREATE OR REPLACE FUNCTION fanin_wake_relay(p_batch uuid)
RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    n integer;
BEGIN
    -- Only brings a publish forward: the rows stay unsent, and the relay's claim decides who publishes them.
    UPDATE fanin_outbox SET available_at = now()
     WHERE batch_id = p_batch AND sent_at IS NULL AND available_at > now();
    GET DIAGNOSTICS n = ROW_COUNT;
    PERFORM fanin_notify_relay('');
    RETURN n;
END
$$;

CREATE OR REPLACE FUNCTION fanin_republish_successor(p_batch uuid, p_step text, p_timeout double precision,
                                          p_grace double precision)
RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    v_outbox bigint;
BEGIN
    WITH s AS (
        UPDATE fanin_successors s
           SET state = CASE WHEN s.state = 'running' THEN 'sent' ELSE s.state END,
               lease_until = NULL, state_at = now()
         WHERE s.batch_id = p_batch AND s.step = p_step AND s.carrier IS NULL
           AND ((s.state IN ('sent', 'retrying', 'requeued', 'replaced')
                 AND coalesce(s.lease_until, s.state_at) < now() - make_interval(secs => greatest(p_timeout, 0)))
                OR (s.state = 'running'
                    AND coalesce(s.lease_until, s.state_at) < now() - make_interval(secs => greatest(p_grace, 0))))
     RETURNING s.batch_id, s.step
    )
    UPDATE fanin_outbox o SET sent_at = NULL, available_at = now(), last_error = 'republished: stalled'
      FROM s WHERE o.batch_id = s.batch_id AND o.step = s.step
 RETURNING o.id INTO v_outbox;
    IF v_outbox IS NULL THEN
        RETURN false;
    END IF;
    PERFORM fanin_notify_relay(v_outbox::text);
    RETURN true;
END
$$;

CREATE OR REPLACE FUNCTION fanin_rerun_successor(p_batch uuid, p_step text, p_task_id text, p_by text)
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
    PERFORM fanin_notify_relay(v_outbox::text);
    RETURN QUERY SELECT v_rerun, 'pending'::text, v_old.task_id, v_old.state;
END
$$;

-- Definer rights, the search path pinned, PUBLIC's EXECUTE revoked, for every function created or replaced here
-- (CREATE OR REPLACE resets both). The producer wakes the relay for its batch's children through the new function:
-- granted to each role that may add children, so that a producer granted before this migration goes on without
-- grants.sql.
DO $$
DECLARE
    r regrole;
    f text;
BEGIN
    FOREACH f IN ARRAY ARRAY[
        'fanin_notify_relay(text)',
        'fanin_create_successor_v2(uuid, text, text, text, double precision)',
        'fanin_wake_relay(uuid)',
        'fanin_republish_successor(uuid, text, double precision, double precision)',
        'fanin_rerun_successor(uuid, text, text, text)'] LOOP
        EXECUTE format('ALTER FUNCTION %s SECURITY DEFINER SET search_path = pg_catalog, %I, pg_temp', f,
                       current_schema());
        EXECUTE format('REVOKE EXECUTE ON FUNCTION %s FROM PUBLIC', f);
    END LOOP;
    FOR r IN SELECT DISTINCT a.grantee::regrole
               FROM pg_proc p, aclexplode(p.proacl) a
              WHERE p.oid = 'fanin_add_children(uuid, uuid[], integer[], integer, integer, bytea)'::regprocedure
                AND a.privilege_type = 'EXECUTE' AND a.grantee <> 0 AND a.grantee <> p.proowner LOOP
        EXECUTE format('GRANT EXECUTE ON FUNCTION fanin_notify_relay(text) TO %s', r);
    END LOOP;
END
$$;
