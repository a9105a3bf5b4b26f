-- celery-fanin schema, version 14: a worker's terminal report counts only when its message matches the child.
--
-- fanin_record_terminal (0006) finds the child by task id alone, so any message carrying a pending child's task
-- id finished that child, whatever batch, index and task name its headers named. fanin_report_terminal is the
-- report the workers send: the same conditional transition and settle, one statement, but the child row must
-- also have the batch, index and task name the report's message carries. A report that names a child by its
-- task id but disagrees on any of them is refused: it changes no child and no counter, and the child's batch
-- counts it in `refused_reports` (shown by `status`).
--
-- p_task_name NULL: the reporter cannot say which task the child was published as (a chain child published
-- before this version, whose earlier task failed); batch and index are still checked. The recovery paths (the
-- relay counting a lost or expired child, a successor's hand-over) keep calling fanin_record_terminal: they
-- read the child from the store, not from a message.

ALTER TABLE fanin_batches ADD COLUMN refused_reports integer NOT NULL DEFAULT 0;

CREATE FUNCTION fanin_report_terminal(p_task_id text, p_batch uuid, p_index integer, p_task_name text,
                                      p_state text, p_result bytea, p_rct text, p_rce text, p_exc_type text,
                                      p_exc_message text, p_started_at timestamptz, p_attempt integer,
                                      p_worker text)
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
        SELECT * INTO r FROM fanin_settle(v_batch, CASE WHEN v_ok THEN 1 ELSE 0 END,
                                          CASE WHEN v_ok THEN 0 ELSE 1 END);
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

-- Least privilege by construction. The functions that move a child or a counter run with their owner's rights (the
-- schema owner, who ran this migration) and a search path pinned to this schema, so the runtime roles need
-- EXECUTE on the entry points they call and no write at all to the counters, the successors or the outbox: a
-- worker's credential cannot decrement a batch except through a child's transition (docs/how-to/grants.sql,
-- tests/test_roles.py). PostgreSQL gives PUBLIC EXECUTE on every new function; a SECURITY DEFINER function
-- must not keep it, so it is revoked here rather than left to the grants file.
DO $$
DECLARE
    f text;
BEGIN
    FOREACH f IN ARRAY ARRAY[
        'fanin_settle(uuid, integer, integer)',
        'fanin_fail_up(uuid, integer)',
        'fanin_create_successor(uuid, text, text, text)',
        'fanin_record_terminal(text, text, bytea, text, text, text, text)',
        'fanin_record_terminal(text, text, bytea, text, text, text, text, timestamptz, integer, text)',
        'fanin_report_terminal(text, uuid, integer, text, text, bytea, text, text, text, text, timestamptz, integer, text)',
        'fanin_record_starts(text[], integer[], text[], timestamptz[])',
        'fanin_seal(uuid)'
    ] LOOP
        EXECUTE format('ALTER FUNCTION %s SECURITY DEFINER SET search_path = pg_catalog, %I, pg_temp', f,
                       current_schema());
        EXECUTE format('REVOKE EXECUTE ON FUNCTION %s FROM PUBLIC', f);
    END LOOP;
END
$$;
