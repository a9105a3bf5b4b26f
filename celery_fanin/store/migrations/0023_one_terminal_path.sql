-- celery-fanin schema, version 23: one path for a terminal outcome, one creation of a successor.
--
-- fanin_record_terminal_v2 (a child's outcome by task id: tests and tools, run as the owner) kept its own copy of
-- the conditional transition. It now reads the child's own batch, index and task name and goes through
-- fanin_report_terminal, the worker's path, so the counting rule is written once. fanin_ensure_successor (the
-- producer's empty batch, reconcile) inserted the successor, its outbox row and the NOTIFY itself; it now checks
-- that the batch is a finished root and calls fanin_create_successor, which every settle calls too.

CREATE OR REPLACE FUNCTION fanin_record_terminal_v2(p_task_id text, p_state text, p_result bytea, p_rct text,
                                                    p_rce text, p_exc_type text, p_exc_message text,
                                                    p_started_at timestamptz, p_attempt integer, p_worker text)
RETURNS TABLE (counted boolean, late boolean, remaining integer, successor_created boolean)
LANGUAGE plpgsql AS $$
DECLARE
    c record;
BEGIN
    -- The child's own row is the claim (these columns never change), so the worker's statement decides.
    SELECT f.batch_id, f.idx, f.task_name INTO c FROM fanin_children f WHERE f.task_id = p_task_id;
    RETURN QUERY
    SELECT r.counted, r.late, r.remaining, r.successor_created
      FROM fanin_report_terminal(p_task_id, c.batch_id, c.idx, c.task_name, p_state, p_result, p_rct, p_rce,
                                 p_exc_type, p_exc_message, p_started_at, p_attempt, p_worker) r;
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
    IF NOT FOUND OR NOT fanin_create_successor(b.id, b.step, b.successor_task_id, p_kind) THEN
        RETURN NULL;
    END IF;
    RETURN (SELECT o.id FROM fanin_outbox o WHERE o.batch_id = b.id AND o.step = b.step);
END
$$;

-- CREATE OR REPLACE resets SECURITY DEFINER and the pinned search path (its grants stay): set them again.
DO $$
DECLARE
    f text;
BEGIN
    FOREACH f IN ARRAY ARRAY[
        'fanin_record_terminal_v2(text, text, bytea, text, text, text, text, timestamptz, integer, text)',
        'fanin_ensure_successor(uuid, text)']
    LOOP
        EXECUTE format('ALTER FUNCTION %s SECURITY DEFINER SET search_path = pg_catalog, %I, pg_temp', f,
                       current_schema());
    END LOOP;
END
$$;
