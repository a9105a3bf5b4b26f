-- celery-fanin schema, version 34: what the functions and the relay's queries ask of a successor row is said once,
-- in four predicates (a final state, handed over, a lapsed run, stalled), where it was restated in each (issue 42).
-- No behaviour changes. The predicates are plain SQL-standard functions of their arguments, bound when created, that
-- the planner inlines: not definer functions, callable by PUBLIC (tests/store/test_predicates.py).

CREATE FUNCTION fanin_successor_final(p_state text)
RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE
RETURN p_state IN ('succeeded', 'failed', 'revoked', 'ignored');

CREATE FUNCTION fanin_successor_handed_over(p_state text)
RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE
RETURN p_state IN ('sent', 'retrying', 'requeued', 'replaced');

CREATE FUNCTION fanin_successor_lapsed(p_lease_until timestamptz, p_state_at timestamptz, p_seconds double precision)
RETURNS boolean
LANGUAGE sql STABLE PARALLEL SAFE
RETURN coalesce(p_lease_until, p_state_at) < now() - make_interval(secs => greatest(p_seconds, 0));

CREATE FUNCTION fanin_successor_stalled(p_state text, p_carrier text, p_lease_until timestamptz,
                                        p_state_at timestamptz, p_timeout double precision, p_grace double precision)
RETURNS boolean
LANGUAGE sql STABLE PARALLEL SAFE
RETURN p_carrier IS NULL
       AND ((fanin_successor_handed_over(p_state) AND fanin_successor_lapsed(p_lease_until, p_state_at, p_timeout))
            OR (p_state = 'running' AND fanin_successor_lapsed(p_lease_until, p_state_at, p_grace)));

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
         WHERE s.batch_id = p_batch AND s.step = p_step
           AND fanin_successor_stalled(s.state, s.carrier, s.lease_until, s.state_at, p_timeout, p_grace)
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

CREATE OR REPLACE FUNCTION fanin_fail_lost_replacement(p_batch uuid, p_step text, p_timeout double precision, p_message text)
RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    v_parent_task_id text;
BEGIN
    -- A live carrier run renews its lease, so only a carrier that never came or whose run died (its lease lapsed)
    -- is past the bound; the row's lock orders this against the carrier's own admission and end.
    UPDATE fanin_successors s
       SET state = 'failed', exc_type = 'ReplacementLost', exc_message = left(p_message, 2000), state_at = now(),
           finished_at = now(), lease_until = NULL
      FROM fanin_batches b
     WHERE s.batch_id = p_batch AND s.step = p_step AND b.id = s.batch_id
       AND s.carrier IS NOT NULL AND s.state IN ('replaced', 'running')
       AND fanin_successor_lapsed(s.lease_until, s.state_at, p_timeout)
 RETURNING b.parent_task_id INTO v_parent_task_id;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    IF v_parent_task_id IS NOT NULL THEN
        PERFORM fanin_record_terminal_v2(v_parent_task_id, 'failed', NULL, NULL, NULL, 'ReplacementLost',
                                         left(p_message, 2000), NULL, NULL, NULL);
    END IF;
    RETURN true;
END
$$;

CREATE OR REPLACE FUNCTION fanin_claim_run_v2(p_batch uuid, p_step text, p_task_id text, p_retries integer,
                                   p_lease double precision, p_grace double precision, p_owner text,
                                   p_owner_key text, p_carrier text, p_dead_owner text)
RETURNS TABLE (run integer, attempt integer, state text, run_owner text)
LANGUAGE plpgsql AS $$
DECLARE
    v_run integer;
    v_attempt integer;
    v_key text := encode(sha256(convert_to(coalesce(p_owner_key, ''), 'UTF8')), 'hex');
BEGIN
    -- Admitted: a successor no run holds, or whose run is dead: its lease lapsed over p_grace seconds ago, or the
    -- caller holds the key of the worker whose run it was and saw that run's process gone. Once replaced, only the
    -- replacement's carrier is admitted, never a copy of the message it replaced.
    UPDATE fanin_successors s
       SET state = 'running', runs = s.runs + 1, attempt = greatest(s.attempt, p_retries),
           lease_until = now() + make_interval(secs => p_lease),
           run_owner = p_owner, run_owner_key = v_key, started_at = coalesce(s.started_at, now()),
           state_at = now()
     WHERE s.batch_id = p_batch AND s.step = p_step AND s.task_id = p_task_id
       AND (s.carrier IS NULL OR s.carrier = p_carrier)
       AND ((s.state = 'pending' OR fanin_successor_handed_over(s.state))
            OR (s.state = 'running'
                AND (fanin_successor_lapsed(s.lease_until, s.state_at, p_grace)
                     OR (p_owner_key IS NOT NULL AND s.run_owner = p_dead_owner AND s.run_owner_key = v_key))))
 RETURNING s.runs, s.attempt INTO v_run, v_attempt;
    -- A refusal names the holder only to its own worker (which may then see that the holder's process is gone).
    RETURN QUERY SELECT v_run, v_attempt, s.state,
                        CASE WHEN p_owner_key IS NOT NULL AND s.run_owner_key = v_key THEN s.run_owner END
      FROM (SELECT 1) AS one
      LEFT JOIN fanin_successors s ON s.batch_id = p_batch AND s.step = p_step AND s.task_id = p_task_id;
END
$$;

CREATE OR REPLACE FUNCTION fanin_finish_successor_v2(p_batch uuid, p_step text, p_task_id text, p_run integer, p_state text,
                                          p_result bytea, p_rct text, p_rce text, p_exc_type text,
                                          p_exc_message text, p_carrier text, p_retries integer, p_ran_in text,
                                          p_owner_key text)
RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    v_parent_task_id text;
BEGIN
    IF NOT fanin_successor_final(p_state) THEN
        RAISE EXCEPTION 'fanin_finish_successor_v2: not a final successor state: %', p_state USING ERRCODE = '22023';
    END IF;
    -- Three callers: the run itself (p_run); a worker's main process about a copy that ran in its pool process
    -- p_ran_in ('host:machine:pid:', a hard time limit, a lost or terminated process): only that process's run, of
    -- that worker; or about a copy that never ran (expired, revoked unstarted, unknown, undecodable): only a
    -- successor no run holds, that this copy could still have started (its carrier, its retry).
    UPDATE fanin_successors s
       SET state = p_state, exc_type = p_exc_type, exc_message = p_exc_message, state_at = now(),
           result = p_result, result_content_type = p_rct, result_content_encoding = p_rce,
           finished_at = now(), lease_until = NULL
      FROM fanin_batches b
     WHERE s.batch_id = p_batch AND s.step = p_step AND b.id = s.batch_id
       AND NOT fanin_successor_final(s.state)
       AND CASE WHEN p_run IS NOT NULL THEN s.runs = p_run AND s.state = 'running'
                WHEN p_ran_in IS NOT NULL THEN
                    s.task_id = p_task_id AND s.state = 'running' AND left(s.run_owner, length(p_ran_in)) = p_ran_in
                    AND s.run_owner_key = encode(sha256(convert_to(coalesce(p_owner_key, ''), 'UTF8')), 'hex')
                ELSE s.task_id = p_task_id AND (s.state = 'pending' OR fanin_successor_handed_over(s.state))
                     AND (s.carrier IS NULL OR s.carrier = p_carrier)
                     AND (s.state <> 'retrying' OR coalesce(p_retries, 0) >= s.attempt) END
 RETURNING b.parent_task_id INTO v_parent_task_id;
    IF NOT FOUND THEN
        IF p_run IS NULL THEN
            UPDATE fanin_successors SET duplicates = duplicates + 1
             WHERE batch_id = p_batch AND step = p_step AND task_id = p_task_id;
        END IF;
        RETURN false;
    END IF;
    IF v_parent_task_id IS NOT NULL THEN
        -- Ignore() ended the body without an error and without a value: the outer child succeeded.
        PERFORM fanin_record_terminal_v2(v_parent_task_id,
                                         CASE WHEN p_state = 'ignored' THEN 'succeeded' ELSE p_state END,
                                         p_result, p_rct, p_rce, p_exc_type, p_exc_message, NULL, NULL, NULL);
    END IF;
    RETURN true;
END
$$;

-- Definer rights, the search path pinned, PUBLIC's EXECUTE revoked, for every function replaced here (CREATE OR
-- REPLACE resets both); the grants on them stay. Not for the predicates, which must stay inlinable.
DO $$
DECLARE
    f text;
BEGIN
    FOREACH f IN ARRAY ARRAY[
        'fanin_republish_successor(uuid, text, double precision, double precision)',
        'fanin_fail_lost_replacement(uuid, text, double precision, text)',
        'fanin_claim_run_v2(uuid, text, text, integer, double precision, double precision, text, text, text, text)',
        'fanin_finish_successor_v2(uuid, text, text, integer, text, bytea, text, text, text, text, text, integer, text, text)'] LOOP
        EXECUTE format('ALTER FUNCTION %s SECURITY DEFINER SET search_path = pg_catalog, %I, pg_temp', f,
                       current_schema());
        EXECUTE format('REVOKE EXECUTE ON FUNCTION %s FROM PUBLIC', f);
    END LOOP;
END
$$;
