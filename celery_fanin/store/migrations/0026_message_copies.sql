-- Copies of a message (issue 38): a replaced successor admits only its replacement's carrier and is never
-- republished; a run is taken over before its lease lapses only by the worker that held it; an event about a copy
-- that never ran ends nothing another copy runs, and counts as a duplicate.

-- `carrier`: the token a replacement's carrier brings (NULL: no replacement, any delivery of the task id).
-- `run_owner_key`: the digest of the holding worker's key; only a caller with the key may call the run dead early.
ALTER TABLE fanin_successors ADD COLUMN carrier text, ADD COLUMN run_owner_key text;
-- Events about a copy of a child that never ran (expired, revoked unstarted, unknown, undecodable), refused
-- because another copy had started the child.
ALTER TABLE fanin_children ADD COLUMN duplicates integer NOT NULL DEFAULT 0;

-- fanin_claim_run_v2(uuid,text,text,integer,double precision,double precision,text,text,text,text)
CREATE FUNCTION fanin_claim_run_v2(p_batch uuid, p_step text, p_task_id text, p_retries integer,
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
       AND (s.state IN ('pending', 'sent', 'retrying', 'requeued', 'replaced')
            OR (s.state = 'running'
                AND (coalesce(s.lease_until, s.state_at) < now() - make_interval(secs => greatest(p_grace, 0))
                     OR (p_owner_key IS NOT NULL AND s.run_owner = p_dead_owner AND s.run_owner_key = v_key))))
 RETURNING s.runs, s.attempt INTO v_run, v_attempt;
    -- A refusal names the holder only to its own worker (which may then see that the holder's process is gone).
    RETURN QUERY SELECT v_run, v_attempt, s.state,
                        CASE WHEN p_owner_key IS NOT NULL AND s.run_owner_key = v_key THEN s.run_owner END
      FROM (SELECT 1) AS one
      LEFT JOIN fanin_successors s ON s.batch_id = p_batch AND s.step = p_step AND s.task_id = p_task_id;
END
$$;

-- fanin_hand_over_v2(uuid,text,integer,text,timestamp with time zone,text)
CREATE FUNCTION fanin_hand_over_v2(p_batch uuid, p_step text, p_run integer, p_state text, p_due timestamptz,
                                   p_carrier text)
RETURNS boolean
LANGUAGE plpgsql AS $$
BEGIN
    IF p_state NOT IN ('retrying', 'requeued', 'replaced') THEN
        RAISE EXCEPTION 'fanin_hand_over_v2: not a hand-over state: %', p_state USING ERRCODE = '22023';
    END IF;
    IF p_state = 'replaced' AND p_carrier IS NULL THEN
        RAISE EXCEPTION 'fanin_hand_over_v2: a replacement needs its carrier''s token' USING ERRCODE = '22023';
    END IF;
    UPDATE fanin_successors
       SET state = p_state, lease_until = p_due, state_at = now(),
           attempt = CASE p_state WHEN 'retrying' THEN attempt + 1 WHEN 'replaced' THEN 0 ELSE attempt END,
           carrier = CASE WHEN p_state = 'replaced' THEN p_carrier ELSE carrier END
     WHERE batch_id = p_batch AND step = p_step AND runs = p_run AND state = 'running';
    RETURN FOUND;
END
$$;

-- fanin_take_back_v2(uuid,text,integer,double precision,text)
CREATE FUNCTION fanin_take_back_v2(p_batch uuid, p_step text, p_run integer, p_lease double precision,
                                   p_carrier text)
RETURNS boolean
LANGUAGE plpgsql AS $$
BEGIN
    -- `p_carrier`: the token the run's own delivery came with, the one to admit again once it hands over.
    UPDATE fanin_successors
       SET state = 'running', lease_until = now() + make_interval(secs => p_lease), state_at = now(),
           attempt = CASE state WHEN 'retrying' THEN greatest(attempt - 1, 0) ELSE attempt END,
           carrier = CASE state WHEN 'replaced' THEN p_carrier ELSE carrier END
     WHERE batch_id = p_batch AND step = p_step AND runs = p_run AND state IN ('retrying', 'replaced');
    RETURN FOUND;
END
$$;

-- fanin_finish_successor_v2(uuid,text,text,integer,text,bytea,text,text,text,text,text,integer,text,text)
CREATE FUNCTION fanin_finish_successor_v2(p_batch uuid, p_step text, p_task_id text, p_run integer, p_state text,
                                          p_result bytea, p_rct text, p_rce text, p_exc_type text,
                                          p_exc_message text, p_carrier text, p_retries integer, p_ran_in text,
                                          p_owner_key text)
RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    v_parent_task_id text;
BEGIN
    IF p_state NOT IN ('succeeded', 'failed', 'revoked', 'ignored') THEN
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
       AND s.state NOT IN ('succeeded', 'failed', 'revoked', 'ignored')
       AND CASE WHEN p_run IS NOT NULL THEN s.runs = p_run AND s.state = 'running'
                WHEN p_ran_in IS NOT NULL THEN
                    s.task_id = p_task_id AND s.state = 'running' AND left(s.run_owner, length(p_ran_in)) = p_ran_in
                    AND s.run_owner_key = encode(sha256(convert_to(coalesce(p_owner_key, ''), 'UTF8')), 'hex')
                ELSE s.task_id = p_task_id AND s.state IN ('pending', 'sent', 'retrying', 'requeued', 'replaced')
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

-- fanin_report_unrun(text,uuid,integer,text,text,text,text)
CREATE FUNCTION fanin_report_unrun(p_task_id text, p_batch uuid, p_index integer, p_task_name text, p_state text,
                                   p_exc_type text, p_exc_message text)
RETURNS TABLE (counted boolean, late boolean, remaining integer, successor_created boolean, refused boolean)
LANGUAGE plpgsql AS $$
DECLARE
    v_state text;
BEGIN
    -- A copy that never ran ends its child only while no copy has started it: a started child is the running
    -- copy's to report. The row lock keeps a start from landing between this check and the report.
    SELECT c.state INTO v_state FROM fanin_children c
     WHERE c.task_id = p_task_id
       AND (c.batch_id = p_batch OR EXISTS (SELECT 1 FROM fanin_batches l WHERE l.id = c.batch_id AND l.parent_id = p_batch))
       AND c.idx = p_index AND (p_task_name IS NULL OR c.task_name = p_task_name)
       FOR UPDATE OF c;
    IF v_state = 'started' THEN
        UPDATE fanin_children SET duplicates = duplicates + 1 WHERE task_id = p_task_id;
        RETURN QUERY SELECT false, false, NULL::integer, false, false;
        RETURN;
    END IF;
    RETURN QUERY SELECT * FROM fanin_report_terminal(p_task_id, p_batch, p_index, p_task_name, p_state, NULL, NULL,
                                                     NULL, p_exc_type, p_exc_message, NULL, NULL, NULL);
END
$$;

-- A replaced successor is never republished: the original message would only be refused (its carrier is the
-- replacement's), and the replacement is the user's canvas, which Celery publishes and redelivers.
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
    PERFORM pg_notify('fanin_outbox', v_outbox::text);
    RETURN true;
END
$$;

-- The new functions: definer rights, the search path pinned, PUBLIC's EXECUTE revoked; each granted to the roles
-- that could call the one it replaces (fanin_report_unrun: those that may report), so that workers granted before
-- this migration go on without grants.sql being run again first. Then the old ones go.
DO $$
DECLARE
    pair text[];
    r regrole;
BEGIN
    -- Replaced in place above, which resets both (its grants stay).
    EXECUTE format('ALTER FUNCTION fanin_republish_successor(uuid, text, double precision, double precision) '
                   'SECURITY DEFINER SET search_path = pg_catalog, %I, pg_temp', current_schema());
    REVOKE EXECUTE ON FUNCTION fanin_republish_successor(uuid, text, double precision, double precision) FROM PUBLIC;
    FOREACH pair SLICE 1 IN ARRAY ARRAY[
        ['fanin_claim_run(uuid, text, text, integer, double precision, double precision, text, text)',
         'fanin_claim_run_v2(uuid, text, text, integer, double precision, double precision, text, text, text, text)'],
        ['fanin_hand_over(uuid, text, integer, text, timestamptz)',
         'fanin_hand_over_v2(uuid, text, integer, text, timestamptz, text)'],
        ['fanin_take_back(uuid, text, integer, double precision)',
         'fanin_take_back_v2(uuid, text, integer, double precision, text)'],
        ['fanin_finish_successor(uuid, text, text, integer, text, bytea, text, text, text, text)',
         'fanin_finish_successor_v2(uuid, text, text, integer, text, bytea, text, text, text, text, text, integer, '
         'text, text)'],
        ['fanin_report_terminal(text, uuid, integer, text, text, bytea, text, text, text, text, timestamptz, '
         'integer, text)',
         'fanin_report_unrun(text, uuid, integer, text, text, text, text)']] LOOP
        EXECUTE format('ALTER FUNCTION %s SECURITY DEFINER SET search_path = pg_catalog, %I, pg_temp', pair[2],
                       current_schema());
        EXECUTE format('REVOKE EXECUTE ON FUNCTION %s FROM PUBLIC', pair[2]);
        FOR r IN SELECT DISTINCT a.grantee::regrole
                   FROM pg_proc p, aclexplode(p.proacl) a
                  WHERE p.oid = pair[1]::regprocedure
                    AND a.privilege_type = 'EXECUTE' AND a.grantee <> 0 AND a.grantee <> p.proowner LOOP
            EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO %s', pair[2], r);
        END LOOP;
    END LOOP;
END
$$;

DROP FUNCTION fanin_claim_run(uuid, text, text, integer, double precision, double precision, text, text);
DROP FUNCTION fanin_hand_over(uuid, text, integer, text, timestamptz);
DROP FUNCTION fanin_take_back(uuid, text, integer, double precision);
DROP FUNCTION fanin_finish_successor(uuid, text, text, integer, text, bytea, text, text, text, text);
