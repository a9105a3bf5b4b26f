-- celery-fanin schema, version 9: a settle takes the batch's row lock with the UPDATE that moves its counters.
--
-- Every terminal report of a batch settles its counter row, and the row lock it takes is held until the report
-- commits: on a busy flat batch the reports queue on that lock, so what runs while it is held bounds the batch's
-- throughput. Version 3 took the lock with SELECT ... FOR UPDATE (reading the whole row), then updated it: two
-- statements under the lock. Here one UPDATE takes the lock, checks `remaining > 0`, moves the counters and, on
-- the last unit or past max_failures, the state, all against the newest version of the row (READ COMMITTED
-- evaluates an UPDATE's WHERE and SET again on the row it waited for). Measured with 16 concurrent reporters on
-- one batch (BENCHMARKS.md): about 18% more reports a second than version 3.
--
-- PostgreSQL before 18 cannot return a row's old values from an UPDATE, and the settle must know whether it was
-- this UPDATE that moved the batch out of `running` (only that one creates the successor or settles the root).
-- The UPDATE therefore writes that answer into the row it writes anyway: `last_settle_moved`. It means nothing
-- outside the settle that wrote it.

ALTER TABLE fanin_batches ADD COLUMN last_settle_moved boolean NOT NULL DEFAULT false;

-- fanin_settle runs with its caller's privileges: every role that may update a batch's counters (the worker,
-- producer and relay roles of docs/how-to/grants.sql, whatever their names here) may now write this column too,
-- so that a deployment upgraded before its grants are run again keeps settling.
DO $grants$
DECLARE
    grantee text;
BEGIN
    FOR grantee IN
        SELECT DISTINCT CASE WHEN a.grantee = 0 THEN 'PUBLIC' ELSE quote_ident(r.rolname) END
          FROM pg_attribute att
         CROSS JOIN LATERAL aclexplode(att.attacl) AS a
          LEFT JOIN pg_roles r ON r.oid = a.grantee
         WHERE att.attrelid = 'fanin_batches'::regclass AND att.attname = 'remaining'
           AND a.privilege_type = 'UPDATE'
    LOOP
        EXECUTE 'GRANT UPDATE (last_settle_moved) ON fanin_batches TO ' || grantee;
    END LOOP;
END
$grants$;

CREATE OR REPLACE FUNCTION fanin_settle(p_batch uuid, p_succeeded integer, p_failed integer)
RETURNS TABLE (remaining integer, successor_created boolean)
LANGUAGE plpgsql AS $$
DECLARE
    b record;
    v_kind text;
    v_outbox bigint;
    r record;
BEGIN
    UPDATE fanin_batches AS t
       SET remaining = t.remaining - 1,
           succeeded = t.succeeded + p_succeeded,
           failed = t.failed + p_failed,
           state = CASE WHEN t.state <> 'running' THEN t.state
                        WHEN t.remaining = 1 THEN 'complete'
                        WHEN t.max_failures IS NOT NULL AND t.failed + p_failed > t.max_failures
                            THEN 'failed_threshold'
                        ELSE t.state END,
           last_settle_moved = t.state = 'running'
                               AND (t.remaining = 1
                                    OR (t.max_failures IS NOT NULL AND t.failed + p_failed > t.max_failures)),
           completed_at = CASE WHEN t.state = 'running'
                                    AND (t.remaining = 1
                                         OR (t.max_failures IS NOT NULL AND t.failed + p_failed > t.max_failures))
                               THEN now() ELSE t.completed_at END
     WHERE t.id = p_batch AND t.remaining > 0
    RETURNING t.id, t.step, t.state, t.remaining, t.succeeded, t.failed, t.parent_id, t.successor_task_id,
              t.on_failure_message IS NOT NULL AS has_on_failure, t.last_settle_moved AS moved
         INTO b;
    IF NOT FOUND THEN
        -- Nothing left to settle (or no such batch): as version 3, report what is left and create nothing.
        RETURN QUERY SELECT (SELECT f.remaining FROM fanin_batches f WHERE f.id = p_batch), false;
        RETURN;
    END IF;
    IF NOT b.moved THEN
        RETURN QUERY SELECT b.remaining, false;
        RETURN;
    END IF;
    -- This call finished the batch: a leaf hands its totals to its root; a root gets its one successor.
    IF b.parent_id IS NOT NULL THEN
        SELECT * INTO r FROM fanin_settle(b.parent_id, b.succeeded, b.failed);
        RETURN QUERY SELECT b.remaining, coalesce(r.successor_created, false);
        RETURN;
    END IF;
    v_kind := CASE WHEN b.state = 'failed_threshold' AND b.has_on_failure THEN 'on_failure' ELSE 'then' END;
    INSERT INTO fanin_successors (batch_id, step, task_id, kind)
    VALUES (b.id, b.step, b.successor_task_id, v_kind)
    ON CONFLICT (batch_id, step) DO NOTHING;
    IF NOT FOUND THEN
        RETURN QUERY SELECT b.remaining, false;
        RETURN;
    END IF;
    INSERT INTO fanin_outbox (batch_id, step) VALUES (b.id, b.step) RETURNING id INTO v_outbox;
    PERFORM pg_notify('fanin_outbox', v_outbox::text);
    RETURN QUERY SELECT b.remaining, true;
END
$$;
