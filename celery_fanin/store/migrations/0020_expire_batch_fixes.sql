-- celery-fanin schema, version 20: fanin_expire_batch, as the protocol model (tests/model) found it wanting.
-- - A tree whose deadline passes (or that is cancelled) leaves each leaf's counters agreeing with its child rows:
--   the root's totals were set from the children, but the leaves were only closed and kept their old counts.
-- - A deadline or cancel that abandoned children and then found the batch finished by a report meanwhile (its last
--   child, or past its threshold) gives those children back: they were left abandoned under a finished batch.
-- (Its callers also take the batch's membership lock first, so a producer's chunk cannot slip in between.)

CREATE OR REPLACE FUNCTION fanin_expire_batch(p_batch uuid, p_reason text, p_proceed boolean)
RETURNS TABLE (on_deadline text, abandoned text[], successor_created boolean, state text)
LANGUAGE plpgsql AS $$
DECLARE
    h record;
    v_proceed boolean;
    v_exc_type text;
    v_exc_message text;
    v_abandoned text[];
    v_state text;
    v_created boolean := false;
BEGIN
    IF p_reason = 'deadline' THEN
        v_exc_type := 'DeadlineExceeded';
        v_exc_message := 'the batch deadline passed before this child finished';
    ELSIF p_reason = 'cancel' THEN
        v_exc_type := 'Cancelled';
        v_exc_message := 'the batch was cancelled before this child finished';
    ELSE
        RAISE EXCEPTION 'fanin_expire_batch: unknown reason %', p_reason USING ERRCODE = '22023';
    END IF;
    SELECT t.on_deadline, t.on_expire_message IS NOT NULL AS has_on_expire, t.parent_task_id INTO h
      FROM fanin_batches t
     WHERE t.id = p_batch AND t.state IN ('open', 'running') AND t.parent_id IS NULL
       AND (p_reason = 'cancel' OR t.deadline_at <= now());
    IF NOT FOUND THEN
        RETURN;
    END IF;
    v_proceed := coalesce(p_proceed, p_reason = 'deadline' AND h.on_deadline = 'proceed');
    -- The children are abandoned before the root is locked (the order every report takes), so a report that held
    -- one of them may have finished the batch meanwhile (its last child, or past its threshold): then the batch is
    -- no longer this call's to end, and the children abandoned go back as they were (the block's subtransaction).
    BEGIN
        WITH a AS (
            UPDATE fanin_children c
               SET state = 'abandoned', finished_at = now(), exc_type = v_exc_type, exc_message = v_exc_message
             WHERE c.batch_id IN (SELECT t.id FROM fanin_batches t WHERE t.id = p_batch OR t.parent_id = p_batch)
               AND c.state IN ('pending', 'started')
         RETURNING c.task_id
        )
        SELECT coalesce(array_agg(a.task_id), '{}') INTO v_abandoned FROM a;
        PERFORM 1 FROM fanin_batches t WHERE t.parent_id = p_batch ORDER BY t.id FOR UPDATE;
        PERFORM 1 FROM fanin_batches t WHERE t.id = p_batch AND t.state IN ('open', 'running') FOR UPDATE;
        IF NOT FOUND THEN
            RAISE EXCEPTION 'batch % finished meanwhile', p_batch USING ERRCODE = 'FNI01';
        END IF;
    EXCEPTION WHEN SQLSTATE 'FNI01' THEN
        RETURN;
    END;
    v_state := CASE WHEN v_proceed THEN 'partial' WHEN p_reason = 'cancel' THEN 'cancelled' ELSE 'expired' END;
    WITH totals AS (
        SELECT count(*) FILTER (WHERE c.state = 'succeeded') AS s,
               count(*) FILTER (WHERE c.state NOT IN ('pending', 'started', 'succeeded')) AS f
          FROM fanin_children c
         WHERE c.batch_id IN (SELECT t.id FROM fanin_batches t WHERE t.id = p_batch OR t.parent_id = p_batch)
    ), leaves AS (
        -- Each leaf counts its own children too, the abandoned ones included: a leaf's counters always agree
        -- with its child rows (status, reconciliation and the root's sums read them).
        UPDATE fanin_batches l
           SET state = v_state, remaining = 0, completed_at = now(),
               succeeded = (SELECT count(*) FROM fanin_children c WHERE c.batch_id = l.id AND c.state = 'succeeded'),
               failed = (SELECT count(*) FROM fanin_children c
                          WHERE c.batch_id = l.id AND c.state NOT IN ('pending', 'started', 'succeeded'))
         WHERE l.parent_id = p_batch AND l.state IN ('open', 'running')
    )
    UPDATE fanin_batches b
       SET state = v_state, remaining = 0, succeeded = totals.s, failed = totals.f, completed_at = now()
      FROM totals
     WHERE b.id = p_batch;
    IF v_proceed THEN
        v_created := fanin_ensure_successor(p_batch, 'then') IS NOT NULL;
    ELSIF h.has_on_expire THEN
        v_created := fanin_ensure_successor(p_batch, 'on_expire') IS NOT NULL;
    ELSIF h.parent_task_id IS NOT NULL THEN
        -- A nested batch abandoned with nothing to run: the outer child it stands for fails now.
        PERFORM fanin_record_terminal_v2(h.parent_task_id, 'failed', NULL, NULL, NULL, v_exc_type,
                                         format('nested batch %s was %s', p_batch,
                                                CASE WHEN p_reason = 'cancel' THEN 'cancelled'
                                                     ELSE 'abandoned at its deadline' END),
                                         NULL, NULL, NULL);
    END IF;
    RETURN QUERY SELECT CASE WHEN v_proceed THEN 'proceed' ELSE 'abandon' END, v_abandoned, v_created, v_state;
END
$$;

-- CREATE OR REPLACE resets SECURITY DEFINER and the pinned search path (its grants stay): set them again.
DO $$
BEGIN
    EXECUTE format('ALTER FUNCTION fanin_expire_batch(uuid, text, boolean) SECURITY DEFINER '
                   'SET search_path = pg_catalog, %I, pg_temp', current_schema());
END
$$;
