-- celery-fanin schema, version 12: a failure threshold holds for a whole tree, and for a batch still being written.
--
-- A tree's root learned of its leaves' failures only when a whole leaf finished, so `max_failures` could not stop
-- a tree early: the root saw nothing until leaves of up to `max_width` children were done. Now a leaf of a root
-- that has a threshold (`fail_up`) adds each failure to its root's `failed` in the report that counts it, and the
-- root moves to `failed_threshold` (and gets its one successor) in that report's transaction. Successes still
-- reach the root once per leaf, so a tree without failures costs what it did, and a root without a threshold is
-- not touched by its leaves' failures at all. Locks are taken as before: the child row, its leaf, then the root.
--
-- An open batch (its producer still streaming children) with a count threshold may now finish early too: the
-- producer sees it is no longer open when it records its next chunk, and stops. A ratio becomes a count when
-- the batch is sealed (fanin_seal), which settles the failures every leaf has pushed up by then.

ALTER TABLE fanin_batches ADD COLUMN fail_up boolean NOT NULL DEFAULT false;

-- The batch's one successor (of `kind`) and its outbox row, once; only the call that inserted them sends NOTIFY.
CREATE FUNCTION fanin_create_successor(p_batch uuid, p_step text, p_task_id text, p_kind text)
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
    INSERT INTO fanin_outbox (batch_id, step) VALUES (p_batch, p_step) RETURNING id INTO v_outbox;
    PERFORM pg_notify('fanin_outbox', v_outbox::text);
    RETURN true;
END
$$;

-- A leaf's failures, added to its root as they are counted. Only `failed` moves (the root still waits for the
-- leaf itself), and the call that takes it past max_failures moves the root and creates its successor. Serialised
-- with every other settle of the root by the row lock its UPDATE takes, re-evaluated on the newest row version.
CREATE FUNCTION fanin_fail_up(p_root uuid, p_failed integer)
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
    RETURN fanin_create_successor(b.id, b.step, b.successor_task_id,
                                  CASE WHEN b.has_on_failure THEN 'on_failure' ELSE 'then' END);
END
$$;

-- As version 9, plus: a `fail_up` leaf pushes each failure to its root at once (and only the current report's
-- failure when it finishes, the earlier ones being there already), and an open batch with a count threshold can
-- cross it (an open batch never completes: it holds its producer's token).
CREATE OR REPLACE FUNCTION fanin_settle(p_batch uuid, p_succeeded integer, p_failed integer)
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
            RETURN QUERY SELECT b.remaining, fanin_fail_up(b.parent_id, p_failed);
            RETURN;
        END IF;
        RETURN QUERY SELECT b.remaining, false;
        RETURN;
    END IF;
    -- This call finished the batch: a leaf hands its totals to its root; a root gets its one successor.
    IF b.parent_id IS NOT NULL THEN
        SELECT * INTO r FROM fanin_settle(b.parent_id, b.succeeded,
                                          CASE WHEN b.fail_up THEN p_failed ELSE b.failed END);
        RETURN QUERY SELECT b.remaining, coalesce(r.successor_created, false);
        RETURN;
    END IF;
    RETURN QUERY SELECT b.remaining,
        fanin_create_successor(b.id, b.step, b.successor_task_id,
                               CASE WHEN b.state = 'failed_threshold' AND b.has_on_failure
                                    THEN 'on_failure' ELSE 'then' END);
END
$$;
