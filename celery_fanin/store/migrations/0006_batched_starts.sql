-- celery-fanin schema, version 6: children's starts recorded in batches by the worker's main process.
--
-- A start is advisory: it tells "never started" from "started, never finished", and child_timeout measures a
-- running child from it. The worker's main process learns of a start when a pool process accepts the task and
-- writes the starts that accumulated since its last write with one call of this function (see
-- celery_fanin/starts.py), so starts cost no round trip on a child's own path. The commit does not wait for the
-- WAL flush: a start lost in a crash leaves the child timed from its creation. Only a child still pending or
-- started moves, so a start that arrives after the child's terminal report changes nothing.

CREATE FUNCTION fanin_record_starts(p_task_ids text[], p_attempts integer[], p_workers text[],
                                    p_started_at timestamptz[])
RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    n integer;
BEGIN
    PERFORM set_config('synchronous_commit', 'off', true);
    UPDATE fanin_children c
       SET state = 'started', started_at = s.started_at, attempt = s.attempt, starts = c.starts + 1,
           worker = s.worker
      FROM unnest(p_task_ids, p_attempts, p_workers, p_started_at) AS s(task_id, attempt, worker, started_at)
     WHERE c.task_id = s.task_id AND c.state IN ('pending', 'started');
    GET DIAGNOSTICS n = ROW_COUNT;
    RETURN n;
END
$$;
