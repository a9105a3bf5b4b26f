-- celery-fanin schema, version 32: who publishes a successor a report creates is an argument of the report's
-- function (p_handoff, down to fanin_create_successor_v2), no longer two settings of the worker's session that
-- changed what every statement of that session did (issue 42). Only the worker's report statements pass it; every
-- other caller (a successor's end that finishes an outer batch, a seal, reconciliation, recovery) passes NULL: the
-- relay publishes, woken by NOTIFY, as it did for them before.

-- The batch's one successor and its outbox row, once per (batch, step). p_handoff says who publishes it: NULL, the
-- relay (woken by NOTIFY); a number, the worker whose report created it, after its commit (no NOTIFY: the relay's
-- scan is the fallback), and a completed batch's row is not due for the relay for that many seconds (version 32:
-- an argument, where it was a setting of the worker's session).
-- fanin_create_successor_v2(uuid,text,text,text,double precision)
CREATE FUNCTION fanin_create_successor_v2(p_batch uuid, p_step text, p_task_id text, p_kind text,
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
        PERFORM pg_notify('fanin_outbox', v_outbox::text);
    END IF;
    RETURN true;
END
$$;

-- fanin_fail_up_v2(uuid,integer,double precision)
CREATE FUNCTION fanin_fail_up_v2(p_root uuid, p_failed integer, p_handoff double precision)
RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    b record;
BEGIN
    UPDATE fanin_batches AS t
       SET failed = t.failed + p_failed,
           state = CASE WHEN t.state IN ('running', 'open') AND t.max_failures IS NOT NULL
                             AND t.failed + p_failed > t.max_failures THEN 'failed_threshold'
                        ELSE t.state END,
           last_settle_moved = t.state IN ('running', 'open') AND t.max_failures IS NOT NULL
                               AND t.failed + p_failed > t.max_failures,
           completed_at = CASE WHEN t.state IN ('running', 'open') AND t.max_failures IS NOT NULL
                                    AND t.failed + p_failed > t.max_failures THEN now()
                               ELSE t.completed_at END
     WHERE t.id = p_root AND t.remaining > 0
    RETURNING t.id, t.step, t.successor_task_id, t.on_failure_message IS NOT NULL AS has_on_failure,
              t.last_settle_moved AS moved
         INTO b;
    IF NOT FOUND OR NOT b.moved THEN
        RETURN false;
    END IF;
    RETURN fanin_create_successor_v2(b.id, b.step, b.successor_task_id,
                                     CASE WHEN b.has_on_failure THEN 'on_failure' ELSE 'then' END,
                                     p_handoff);
END
$$;

-- fanin_settle_v2(uuid,integer,integer,double precision)
CREATE FUNCTION fanin_settle_v2(p_batch uuid, p_succeeded integer, p_failed integer,
                                p_handoff double precision)
RETURNS TABLE (remaining integer, successor_created boolean)
LANGUAGE plpgsql AS $$
DECLARE
    b record;
    r record;
BEGIN
    UPDATE fanin_batches AS t
       SET remaining = t.remaining - 1,
           succeeded = t.succeeded + p_succeeded,
           failed = t.failed + p_failed,
           state = CASE WHEN t.state NOT IN ('running', 'open') THEN t.state
                        WHEN t.state = 'running' AND t.remaining = 1 THEN 'complete'
                        WHEN t.max_failures IS NOT NULL AND t.failed + p_failed > t.max_failures
                            THEN 'failed_threshold'
                        ELSE t.state END,
           last_settle_moved = (t.state = 'running' AND t.remaining = 1)
                               OR (t.state IN ('running', 'open') AND t.max_failures IS NOT NULL
                                   AND t.failed + p_failed > t.max_failures),
           completed_at = CASE WHEN (t.state = 'running' AND t.remaining = 1)
                                    OR (t.state IN ('running', 'open') AND t.max_failures IS NOT NULL
                                        AND t.failed + p_failed > t.max_failures)
                               THEN now() ELSE t.completed_at END
     WHERE t.id = p_batch AND t.remaining > 0
    RETURNING t.id, t.step, t.state, t.remaining, t.succeeded, t.failed, t.parent_id, t.successor_task_id,
              t.on_failure_message IS NOT NULL AS has_on_failure, t.last_settle_moved AS moved, t.fail_up
         INTO b;
    IF NOT FOUND THEN
        -- Nothing left to settle (or no such batch): report what is left and create nothing.
        RETURN QUERY SELECT (SELECT f.remaining FROM fanin_batches f WHERE f.id = p_batch), false;
        RETURN;
    END IF;
    IF NOT b.moved THEN
        IF b.fail_up AND p_failed > 0 THEN
            RETURN QUERY SELECT b.remaining, fanin_fail_up_v2(b.parent_id, p_failed, p_handoff);
            RETURN;
        END IF;
        RETURN QUERY SELECT b.remaining, false;
        RETURN;
    END IF;
    -- This call finished the batch: a leaf hands its totals to its root; a root gets its one successor.
    IF b.parent_id IS NOT NULL THEN
        SELECT * INTO r FROM fanin_settle_v2(b.parent_id, b.succeeded,
                                             CASE WHEN b.fail_up THEN p_failed ELSE b.failed END,
                                             p_handoff);
        RETURN QUERY SELECT b.remaining, coalesce(r.successor_created, false);
        RETURN;
    END IF;
    RETURN QUERY SELECT b.remaining,
        fanin_create_successor_v2(b.id, b.step, b.successor_task_id,
                                  CASE WHEN b.state = 'failed_threshold' AND b.has_on_failure
                                       THEN 'on_failure' ELSE 'then' END, p_handoff);
END
$$;

-- A worker's terminal report; p_handoff: see fanin_create_successor_v2 (NULL from every caller but a worker's
-- report statement).
-- fanin_report_terminal_v2(text,uuid,integer,text,text,bytea,text,text,text,text,timestamp with time zone,integer,text,double precision)
CREATE FUNCTION fanin_report_terminal_v2(p_task_id text, p_batch uuid, p_index integer, p_task_name text,
                                         p_state text, p_result bytea, p_rct text, p_rce text,
                                         p_exc_type text, p_exc_message text, p_started_at timestamptz,
                                         p_attempt integer, p_worker text, p_handoff double precision)
RETURNS TABLE (counted boolean, late boolean, remaining integer, successor_created boolean, refused boolean)
LANGUAGE plpgsql AS $$
DECLARE
    v_batch uuid;
    v_ok boolean := p_state = 'succeeded';
    v_start integer := CASE WHEN p_started_at IS NULL THEN 0 ELSE 1 END;
    r record;
BEGIN
    -- The conditional transition, now also on the message's batch, index and task name (same primary-key row).
    -- A tree's children are rows of its leaves while their messages name the root (and the index in the whole
    -- batch): a leaf of the named batch matches too; its row is read only when the child's batch is not the one
    -- named, so a flat batch's report reads nothing more.
    UPDATE fanin_children
       SET state = p_state, finished_at = now(), result = p_result, result_content_type = p_rct,
           result_content_encoding = p_rce, exc_type = p_exc_type, exc_message = p_exc_message,
           started_at = coalesce(p_started_at, started_at), starts = starts + v_start,
           attempt = coalesce(p_attempt, attempt), worker = coalesce(p_worker, worker)
     WHERE task_id = p_task_id AND state IN ('pending', 'started')
       AND (batch_id = p_batch OR EXISTS (SELECT 1 FROM fanin_batches l WHERE l.id = fanin_children.batch_id AND l.parent_id = p_batch))
       AND idx = p_index AND (p_task_name IS NULL OR task_name = p_task_name)
    RETURNING batch_id INTO v_batch;
    IF FOUND THEN
        SELECT * INTO r FROM fanin_settle_v2(v_batch, CASE WHEN v_ok THEN 1 ELSE 0 END,
                                             CASE WHEN v_ok THEN 0 ELSE 1 END, p_handoff);
        RETURN QUERY SELECT true, false, r.remaining, r.successor_created, false;
        RETURN;
    END IF;
    -- Already counted: record the report as late (a new statement sees a racing report's committed row).
    UPDATE fanin_children
       SET late_state = p_state, late_at = now(), late_reports = late_reports + 1, starts = starts + v_start
     WHERE task_id = p_task_id AND state NOT IN ('pending', 'started')
       AND (batch_id = p_batch OR EXISTS (SELECT 1 FROM fanin_batches l WHERE l.id = fanin_children.batch_id AND l.parent_id = p_batch))
       AND idx = p_index AND (p_task_name IS NULL OR task_name = p_task_name);
    IF FOUND THEN
        RETURN QUERY SELECT false, true, NULL::integer, false, false;
        RETURN;
    END IF;
    -- A child with this task id whose batch, index or task name differ from the message's: refused, and counted
    -- on the child's own batch (a tree's root, for a leaf's child). No such child at all: unknown, as before.
    UPDATE fanin_batches
       SET refused_reports = refused_reports + 1
     WHERE id = (SELECT coalesce(b.parent_id, b.id) FROM fanin_children c JOIN fanin_batches b ON b.id = c.batch_id
                  WHERE c.task_id = p_task_id);
    RETURN QUERY SELECT false, false, NULL::integer, false, FOUND;
END
$$;

-- fanin_report_unrun_v2(text,uuid,integer,text,text,text,text,double precision)
CREATE FUNCTION fanin_report_unrun_v2(p_task_id text, p_batch uuid, p_index integer, p_task_name text,
                                      p_state text, p_exc_type text, p_exc_message text,
                                      p_handoff double precision)
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
    RETURN QUERY SELECT * FROM fanin_report_terminal_v2(p_task_id, p_batch, p_index, p_task_name, p_state,
                                                        NULL, NULL, NULL, p_exc_type, p_exc_message, NULL,
                                                        NULL, NULL, p_handoff);
END
$$;

-- The callers that keep their arguments: moved to the new versions.
CREATE OR REPLACE FUNCTION fanin_seal(p_batch uuid)
RETURNS TABLE (remaining integer, successor_created boolean)
LANGUAGE plpgsql AS $$
BEGIN
    -- Release the producer's token: the batch takes no more children. A ratio of failures becomes a count now
    -- that the number of children is known.
    UPDATE fanin_batches
       SET state = 'running',
           max_failures = CASE WHEN max_failures_ratio IS NOT NULL
                               THEN floor(max_failures_ratio * planned)::integer ELSE max_failures END
     WHERE id = p_batch AND state = 'open';
    IF NOT FOUND THEN
        RETURN QUERY SELECT NULL::integer, false;
        RETURN;
    END IF;
    RETURN QUERY SELECT * FROM fanin_settle_v2(p_batch, 0, 0, NULL);
END
$$;

CREATE OR REPLACE FUNCTION fanin_record_terminal_v2(p_task_id text, p_state text, p_result bytea, p_rct text, p_rce text,
                                         p_exc_type text, p_exc_message text, p_started_at timestamptz,
                                         p_attempt integer, p_worker text)
RETURNS TABLE (counted boolean, late boolean, remaining integer, successor_created boolean)
LANGUAGE plpgsql AS $$
DECLARE
    c record;
BEGIN
    -- The child's own row is the claim (these columns never change), so the worker's statement decides.
    SELECT f.batch_id, f.idx, f.task_name INTO c FROM fanin_children f WHERE f.task_id = p_task_id;
    RETURN QUERY
    SELECT r.counted, r.late, r.remaining, r.successor_created
      FROM fanin_report_terminal_v2(p_task_id, c.batch_id, c.idx, c.task_name, p_state, p_result, p_rct,
                                    p_rce, p_exc_type, p_exc_message, p_started_at, p_attempt, p_worker,
                                    NULL) r;
END
$$;

CREATE OR REPLACE FUNCTION fanin_ensure_successor(p_batch uuid, p_kind text)
RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    b record;
BEGIN
    SELECT x.id, x.step, x.successor_task_id INTO b FROM fanin_batches x
     WHERE x.id = p_batch AND x.parent_id IS NULL
       AND ((p_kind = 'then' AND x.state IN ('complete', 'partial', 'failed_threshold'))
            OR (p_kind = 'on_failure' AND x.state = 'failed_threshold' AND x.on_failure_message IS NOT NULL)
            OR (p_kind = 'on_expire' AND x.state IN ('expired', 'cancelled') AND x.on_expire_message IS NOT NULL));
    IF NOT FOUND OR NOT fanin_create_successor_v2(b.id, b.step, b.successor_task_id, p_kind, NULL) THEN
        RETURN NULL;
    END IF;
    RETURN (SELECT o.id FROM fanin_outbox o WHERE o.batch_id = b.id AND o.step = b.step);
END
$$;

CREATE OR REPLACE FUNCTION fanin_reconcile_batch(p_batch uuid, OUT problems text[], OUT actions text[])
LANGUAGE plpgsql AS $$
DECLARE
    b record;
    c record;
    v_token integer;
    v_finish boolean;
    v_state text;
    v_kind text;
BEGIN
    SELECT t.id, t.step, t.state, t.planned, t.remaining, t.succeeded, t.failed, t.parent_id,
           t.on_failure_message IS NOT NULL AS has_on_failure
      INTO b FROM fanin_batches t WHERE t.id = p_batch FOR UPDATE;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    problems := '{}';
    actions := '{}';
    WITH direct AS (
        SELECT count(*) AS created,
               count(*) FILTER (WHERE x.state IN ('pending', 'started')) AS open,
               count(*) FILTER (WHERE x.state = 'succeeded') AS succeeded,
               count(*) FILTER (WHERE x.state NOT IN ('pending', 'started', 'succeeded')) AS failed
          FROM fanin_children x WHERE x.batch_id = p_batch
    ), leaves AS (
        -- a `fail_up` leaf has handed its failures to the root as they were counted, finished or not
        SELECT coalesce(sum(l.planned), 0) AS created,
               count(*) FILTER (WHERE l.state IN ('open', 'running')) AS open,
               coalesce(sum(l.succeeded) FILTER (WHERE l.state NOT IN ('open', 'running')), 0) AS succeeded,
               coalesce(sum(l.failed) FILTER (WHERE l.state NOT IN ('open', 'running') OR l.fail_up), 0) AS failed
          FROM fanin_batches l WHERE l.parent_id = p_batch
    )
    SELECT direct.created + leaves.created AS created, direct.open + leaves.open AS open,
           direct.succeeded + leaves.succeeded AS succeeded, direct.failed + leaves.failed AS failed
      INTO c FROM direct, leaves;
    IF c.created <> b.planned THEN
        problems := problems || format('planned %s children but %s rows exist', b.planned, c.created);
    END IF;
    -- An open batch (or leaf) holds its producer's token and never finishes here.
    v_token := CASE WHEN b.state = 'open' THEN 1 ELSE 0 END;
    IF b.state IN ('open', 'running') AND c.created = b.planned THEN
        IF (b.remaining, b.succeeded, b.failed) <> (c.open + v_token, c.succeeded, c.failed) THEN
            problems := problems || format(
                'counter says remaining=%s succeeded=%s failed=%s, children say remaining=%s succeeded=%s failed=%s',
                b.remaining, b.succeeded, b.failed, c.open + v_token, c.succeeded, c.failed);
            actions := actions || 'counters recomputed from child rows'::text;
        END IF;
        v_finish := c.open = 0 AND v_token = 0;
        IF v_finish THEN
            IF cardinality(problems) = 0 THEN
                problems := problems || 'all children are terminal but the batch was still running'::text;
            END IF;
            actions := actions || 'batch finished'::text;
        END IF;
        IF cardinality(problems) > 0 THEN
            -- Leave one unit for fanin_settle_v2 to take, so that finishing goes the way a last report's would.
            UPDATE fanin_batches t
               SET remaining = c.open + v_token + CASE WHEN v_finish THEN 1 ELSE 0 END,
                   succeeded = c.succeeded, failed = c.failed
             WHERE t.id = p_batch;
            IF v_finish THEN
                PERFORM fanin_settle_v2(p_batch, 0, 0, NULL);
            END IF;
        END IF;
    END IF;
    SELECT t.state INTO v_state FROM fanin_batches t WHERE t.id = p_batch;
    IF b.parent_id IS NULL AND v_state IN ('complete', 'partial', 'failed_threshold') THEN
        v_kind := CASE WHEN v_state = 'failed_threshold' AND b.has_on_failure THEN 'on_failure' ELSE 'then' END;
        IF fanin_ensure_successor(p_batch, v_kind) IS NOT NULL THEN
            IF NOT EXISTS (SELECT 1 FROM unnest(actions) a WHERE a LIKE '%successor%') THEN
                problems := problems || format('batch is %s but had no successor', v_state);
            END IF;
            actions := actions || 'successor and outbox row inserted'::text;
        ELSE
            INSERT INTO fanin_outbox (batch_id, step)
            SELECT s.batch_id, s.step FROM fanin_successors s
             WHERE s.batch_id = p_batch AND s.step = b.step AND s.state = 'pending'
               AND NOT EXISTS (SELECT 1 FROM fanin_outbox o WHERE o.batch_id = s.batch_id AND o.step = s.step)
            ON CONFLICT (batch_id, step) DO NOTHING;
            IF FOUND THEN
                problems := problems || 'successor had no outbox row'::text;
                actions := actions || 'outbox row inserted'::text;
            END IF;
        END IF;
    END IF;
END
$$;

-- The entry point of the workers of version 31 and before, kept so that a worker not yet restarted after this
-- migration goes on reporting: such a worker said once per session that it publishes the successors its reports
-- create (the two settings read here, which nothing else reads any more). A later migration drops it.
-- fanin_report_terminal(text,uuid,integer,text,text,bytea,text,text,text,text,timestamp with time zone,integer,text)
CREATE OR REPLACE FUNCTION fanin_report_terminal(p_task_id text, p_batch uuid, p_index integer, p_task_name text,
                                      p_state text, p_result bytea, p_rct text, p_rce text, p_exc_type text,
                                      p_exc_message text, p_started_at timestamptz, p_attempt integer,
                                      p_worker text)
RETURNS TABLE (counted boolean, late boolean, remaining integer, successor_created boolean, refused boolean)
LANGUAGE plpgsql AS $$
BEGIN
    RETURN QUERY SELECT * FROM fanin_report_terminal_v2(
        p_task_id, p_batch, p_index, p_task_name, p_state, p_result, p_rct, p_rce, p_exc_type, p_exc_message,
        p_started_at, p_attempt, p_worker,
        CASE WHEN coalesce(current_setting('fanin.successor_publisher', true), '') = 'worker'
             THEN coalesce(nullif(current_setting('fanin.successor_handoff', true), ''), '0')::double precision END);
END
$$;

-- The same for a worker of version 31 and before (see fanin_report_terminal).
-- fanin_report_unrun(text,uuid,integer,text,text,text,text)
CREATE OR REPLACE FUNCTION fanin_report_unrun(p_task_id text, p_batch uuid, p_index integer, p_task_name text, p_state text,
                                   p_exc_type text, p_exc_message text)
RETURNS TABLE (counted boolean, late boolean, remaining integer, successor_created boolean, refused boolean)
LANGUAGE plpgsql AS $$
BEGIN
    RETURN QUERY SELECT * FROM fanin_report_unrun_v2(
        p_task_id, p_batch, p_index, p_task_name, p_state, p_exc_type, p_exc_message,
        CASE WHEN coalesce(current_setting('fanin.successor_publisher', true), '') = 'worker'
             THEN coalesce(nullif(current_setting('fanin.successor_handoff', true), ''), '0')::double precision END);
END
$$;

DROP FUNCTION fanin_settle(uuid, integer, integer);
DROP FUNCTION fanin_fail_up(uuid, integer);
DROP FUNCTION fanin_create_successor(uuid, text, text, text);

-- Definer rights, the search path pinned, PUBLIC's EXECUTE revoked, for every function created or replaced here
-- (CREATE OR REPLACE resets both). The new report functions are granted to each role that may call the ones they
-- succeed, so that a worker granted before this migration goes on without grants.sql.
DO $$
DECLARE
    r regrole;
    f text;
    pair text[];
BEGIN
    FOREACH f IN ARRAY ARRAY[
        'fanin_create_successor_v2(uuid, text, text, text, double precision)',
        'fanin_fail_up_v2(uuid, integer, double precision)',
        'fanin_settle_v2(uuid, integer, integer, double precision)',
        'fanin_report_terminal_v2(text, uuid, integer, text, text, bytea, text, text, text, text, timestamptz, integer, text, double precision)',
        'fanin_report_unrun_v2(text, uuid, integer, text, text, text, text, double precision)',
        'fanin_seal(uuid)',
        'fanin_record_terminal_v2(text, text, bytea, text, text, text, text, timestamptz, integer, text)',
        'fanin_ensure_successor(uuid, text)',
        'fanin_reconcile_batch(uuid)',
        'fanin_report_terminal(text, uuid, integer, text, text, bytea, text, text, text, text, timestamptz, integer, text)',
        'fanin_report_unrun(text, uuid, integer, text, text, text, text)'] LOOP
        EXECUTE format('ALTER FUNCTION %s SECURITY DEFINER SET search_path = pg_catalog, %I, pg_temp', f,
                       current_schema());
        EXECUTE format('REVOKE EXECUTE ON FUNCTION %s FROM PUBLIC', f);
    END LOOP;
    FOREACH pair SLICE 1 IN ARRAY ARRAY[
        ARRAY['fanin_report_terminal(text, uuid, integer, text, text, bytea, text, text, text, text, timestamptz, integer, text)',
              'fanin_report_terminal_v2(text, uuid, integer, text, text, bytea, text, text, text, text, timestamptz, integer, text, double precision)'],
        ARRAY['fanin_report_unrun(text, uuid, integer, text, text, text, text)',
              'fanin_report_unrun_v2(text, uuid, integer, text, text, text, text, double precision)']] LOOP
        FOR r IN SELECT DISTINCT a.grantee::regrole
                   FROM pg_proc p, aclexplode(p.proacl) a
                  WHERE p.oid = pair[1]::regprocedure
                    AND a.privilege_type = 'EXECUTE' AND a.grantee <> 0 AND a.grantee <> p.proowner LOOP
            EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO %s', pair[2], r);
        END LOOP;
    END LOOP;
END
$$;
