-- celery-fanin schema, version 6: children's starts written off the child's path.
--
-- A start is advisory: it tells "never started" from "started, never finished", `status` and `failures` show it,
-- and child_timeout measures a running child from it. A pool process queues its children's starts and a thread
-- writes them a stretch at a time with one call of fanin_record_starts (see celery_fanin/starts.py), committed
-- asynchronously: a start lost in a crash leaves the child timed from its creation. A child that ends before its
-- start was written hands the start to its terminal report instead (the 10-argument fanin_record_terminal), so
-- the start costs no statement of its own and `starts` still counts every run.

CREATE FUNCTION fanin_record_starts(p_task_ids text[], p_attempts integer[], p_workers text[],
                                    p_started_at timestamptz[])
RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    n integer;
BEGIN
    PERFORM set_config('synchronous_commit', 'off', true);
    -- Only an open child moves to `started`; a start written after the child's terminal report (a slow writer,
    -- a fast child) still counts the run and fills in when and where it started, and moves nothing else.
    UPDATE fanin_children c
       SET state = CASE WHEN c.state IN ('pending', 'started') THEN 'started' ELSE c.state END,
           started_at = CASE WHEN c.state IN ('pending', 'started') THEN s.started_at
                             ELSE coalesce(c.started_at, s.started_at) END,
           attempt = CASE WHEN c.state IN ('pending', 'started') THEN s.attempt ELSE greatest(c.attempt, s.attempt) END,
           worker = CASE WHEN c.state IN ('pending', 'started') THEN s.worker ELSE coalesce(c.worker, s.worker) END,
           starts = c.starts + 1
      FROM unnest(p_task_ids, p_attempts, p_workers, p_started_at) AS s(task_id, attempt, worker, started_at)
     WHERE c.task_id = s.task_id;
    GET DIAGNOSTICS n = ROW_COUNT;
    RETURN n;
END
$$;

-- The terminal report, optionally carrying the child's start (when, attempt, worker) that was not written yet.
-- The same conditional transition and settle as version 3's; the 7-argument form now calls this one.
CREATE FUNCTION fanin_record_terminal(p_task_id text, p_state text, p_result bytea, p_rct text, p_rce text,
                                      p_exc_type text, p_exc_message text, p_started_at timestamptz,
                                      p_attempt integer, p_worker text)
RETURNS TABLE (counted boolean, late boolean, remaining integer, successor_created boolean)
LANGUAGE plpgsql AS $$
DECLARE
    v_batch uuid;
    v_ok boolean := p_state = 'succeeded';
    v_start integer := CASE WHEN p_started_at IS NULL THEN 0 ELSE 1 END;
    r record;
BEGIN
    -- The conditional transition: only a child still pending or started moves, so a child counts at most once.
    UPDATE fanin_children
       SET state = p_state, finished_at = now(), result = p_result, result_content_type = p_rct,
           result_content_encoding = p_rce, exc_type = p_exc_type, exc_message = p_exc_message,
           started_at = coalesce(p_started_at, started_at), starts = starts + v_start,
           attempt = coalesce(p_attempt, attempt), worker = coalesce(p_worker, worker)
     WHERE task_id = p_task_id AND state IN ('pending', 'started')
    RETURNING batch_id INTO v_batch;
    IF NOT FOUND THEN
        -- Already counted (or unknown): record the report as late. A new statement, so a report that raced the
        -- one that counted sees that one's committed row here.
        UPDATE fanin_children
           SET late_state = p_state, late_at = now(), late_reports = late_reports + 1, starts = starts + v_start
         WHERE task_id = p_task_id AND state NOT IN ('pending', 'started');
        RETURN QUERY SELECT false, FOUND, NULL::integer, false;
        RETURN;
    END IF;
    SELECT * INTO r FROM fanin_settle(v_batch, CASE WHEN v_ok THEN 1 ELSE 0 END, CASE WHEN v_ok THEN 0 ELSE 1 END);
    RETURN QUERY SELECT true, false, r.remaining, r.successor_created;
END
$$;

CREATE OR REPLACE FUNCTION fanin_record_terminal(p_task_id text, p_state text, p_result bytea, p_rct text,
                                                 p_rce text, p_exc_type text, p_exc_message text)
RETURNS TABLE (counted boolean, late boolean, remaining integer, successor_created boolean)
LANGUAGE sql AS $$
    SELECT * FROM fanin_record_terminal(p_task_id, p_state, p_result, p_rct, p_rce, p_exc_type, p_exc_message,
                                        NULL::timestamptz, NULL::integer, NULL::text)
$$;
