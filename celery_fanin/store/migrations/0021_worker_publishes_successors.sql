-- celery-fanin schema, version 21: the worker whose report created a successor publishes it itself.
-- A session that will publish what it creates (the worker's report connection, `fanin_worker_publishes_successors`)
-- says so with `fanin.successor_publisher = 'worker'`: the successor's outbox row is then created without a NOTIFY,
-- and the worker claims it after its commit through fanin_claim_outbox, as the relay would. A worker that dies in
-- between leaves the row unsent, and the relay's periodic scan publishes it.

CREATE OR REPLACE FUNCTION fanin_create_successor(p_batch uuid, p_step text, p_task_id text, p_kind text)
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
    -- The worker that reported publishes it after this commits: no need to wake the relay (its scan is the fallback).
    IF coalesce(current_setting('fanin.successor_publisher', true), '') <> 'worker' THEN
        PERFORM pg_notify('fanin_outbox', v_outbox::text);
    END IF;
    RETURN true;
END
$$;

-- CREATE OR REPLACE resets SECURITY DEFINER and the pinned search path (its grants stay): set them again.
DO $$
BEGIN
    EXECUTE format('ALTER FUNCTION fanin_create_successor(uuid, text, text, text) SECURITY DEFINER '
                   'SET search_path = pg_catalog, %I, pg_temp', current_schema());
END
$$;
