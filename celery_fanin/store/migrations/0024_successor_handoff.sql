-- celery-fanin schema, version 24: a successor handed to the worker whose report created it, with no lock held
-- across its publish.
--
-- A session that publishes what it creates (`fanin.successor_publisher = 'worker'`) also says for how long the
-- relay leaves such a successor to it (`fanin.successor_handoff`, seconds). When its report completes a batch,
-- the outbox row is created not due before then (`available_at`), so the relay's claim skips it meanwhile and the
-- worker publishes it with a plain read and a mark-sent afterwards: no claim, no lock held while it publishes. A
-- worker that dies or fails in between leaves the row to the relay once it is due; one slower than the handoff
-- is published twice, and the successor's run guard refuses the second copy. A batch that finished any other
-- way (past its failure threshold: the children left must be abandoned in the claim's transaction) gets a row
-- due at once, which the worker claims as before. fanin_wake_relay makes a batch's handed-off rows due at once
-- and wakes the relay: for a report from the worker's main process, which leaves its successors to the relay.

CREATE OR REPLACE FUNCTION fanin_create_successor(p_batch uuid, p_step text, p_task_id text, p_kind text)
RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    v_outbox bigint;
    v_worker boolean := coalesce(current_setting('fanin.successor_publisher', true), '') = 'worker';
    v_handoff double precision := coalesce(nullif(current_setting('fanin.successor_handoff', true), ''), '0');
BEGIN
    INSERT INTO fanin_successors (batch_id, step, task_id, kind)
    VALUES (p_batch, p_step, p_task_id, p_kind)
    ON CONFLICT (batch_id, step) DO NOTHING;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    IF v_worker AND v_handoff > 0 AND p_kind = 'then'
       AND EXISTS (SELECT 1 FROM fanin_batches b WHERE b.id = p_batch AND b.state = 'complete') THEN
        -- Handed to the worker that reported: not due for the relay before the handoff has passed.
        INSERT INTO fanin_outbox (batch_id, step, available_at)
        VALUES (p_batch, p_step, now() + make_interval(secs => v_handoff)) RETURNING id INTO v_outbox;
    ELSE
        INSERT INTO fanin_outbox (batch_id, step) VALUES (p_batch, p_step) RETURNING id INTO v_outbox;
    END IF;
    -- The worker that reported publishes it after this commits: no need to wake the relay (its scan is the fallback).
    IF NOT v_worker THEN
        PERFORM pg_notify('fanin_outbox', v_outbox::text);
    END IF;
    RETURN true;
END
$$;

CREATE FUNCTION fanin_wake_relay(p_batch uuid)
RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    n integer;
BEGIN
    -- Only brings a publish forward: the rows stay unsent, and the relay's claim decides who publishes them.
    UPDATE fanin_outbox SET available_at = now()
     WHERE batch_id = p_batch AND sent_at IS NULL AND available_at > now();
    GET DIAGNOSTICS n = ROW_COUNT;
    PERFORM pg_notify('fanin_outbox', '');
    RETURN n;
END
$$;

-- CREATE OR REPLACE resets SECURITY DEFINER and the pinned search path (its grants stay): set them again; the new
-- function is no one's until grants.sql grants it.
DO $$
DECLARE
    f text;
BEGIN
    FOREACH f IN ARRAY ARRAY['fanin_create_successor(uuid, text, text, text)', 'fanin_wake_relay(uuid)'] LOOP
        EXECUTE format('ALTER FUNCTION %s SECURITY DEFINER SET search_path = pg_catalog, %I, pg_temp', f,
                       current_schema());
    END LOOP;
    REVOKE EXECUTE ON FUNCTION fanin_wake_relay(uuid) FROM PUBLIC;
END
$$;
