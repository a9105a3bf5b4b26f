-- celery-fanin schema, version 3: streaming producers, trees of counters, idempotent keys, depth and lineage.
--
-- The counting moves into two server-side functions, so that one round trip still carries a child's whole
-- terminal transition while a finished leaf can hand its totals up to its root in the same transaction:
--   fanin_record_terminal(child)  the conditional child transition, then fanin_settle(its batch)
--   fanin_settle(batch, s, f)     the conditional decrement of one batch; the call that finishes a leaf settles
--                                 its parent; the call that finishes a root inserts the successor and outbox row
-- A batch still being added to is `open` and holds one extra unit in `remaining` (the producer's token), so it
-- cannot finish early; fanin_seal releases the token.

ALTER TABLE fanin_batches
    ADD COLUMN app_name     text,
    ADD COLUMN key          text,                 -- idempotency key, unique per app
    ADD COLUMN digest       bytea,                -- sha256 chain over the children's messages, in order
    ADD COLUMN parent_id    uuid REFERENCES fanin_batches (id) ON DELETE CASCADE,  -- a leaf's root
    ADD COLUMN depth        integer NOT NULL DEFAULT 0,
    ADD COLUMN lineage      uuid,                 -- the batch whose child or successor created this one
    ADD COLUMN parent_task_id text,               -- nested: the outer child this batch's successor completes
    ADD COLUMN max_failures_ratio double precision;

CREATE UNIQUE INDEX fanin_batches_key ON fanin_batches (app_name, key) WHERE key IS NOT NULL;
CREATE INDEX fanin_batches_leaves ON fanin_batches (parent_id) WHERE parent_id IS NOT NULL;
CREATE INDEX fanin_batches_lineage ON fanin_batches (lineage) WHERE lineage IS NOT NULL;
CREATE INDEX fanin_batches_parent_task ON fanin_batches (parent_task_id) WHERE parent_task_id IS NOT NULL;
DROP INDEX fanin_batches_running;
CREATE INDEX fanin_batches_running ON fanin_batches (created_at) WHERE state IN ('open', 'running');

ALTER TABLE fanin_successors
    ADD COLUMN result                  bytea,     -- the successor's return value (a nested batch's result)
    ADD COLUMN result_content_type     text,
    ADD COLUMN result_content_encoding text;

CREATE FUNCTION fanin_settle(p_batch uuid, p_succeeded integer, p_failed integer)
RETURNS TABLE (remaining integer, successor_created boolean)
LANGUAGE plpgsql AS $$
DECLARE
    b fanin_batches%ROWTYPE;
    v_state text;
    v_kind text;
    v_outbox bigint;
    r record;
BEGIN
    -- The row lock serialises every settle of this batch; under READ COMMITTED this read sees the newest version.
    SELECT * INTO b FROM fanin_batches WHERE id = p_batch FOR UPDATE;
    IF NOT FOUND OR b.remaining <= 0 THEN
        RETURN QUERY SELECT b.remaining, false;
        RETURN;
    END IF;
    v_state := b.state;
    IF b.state = 'running' THEN
        IF b.remaining = 1 THEN
            v_state := 'complete';
        ELSIF b.max_failures IS NOT NULL AND b.failed + p_failed > b.max_failures THEN
            v_state := 'failed_threshold';
        END IF;
    END IF;
    UPDATE fanin_batches
       SET remaining = b.remaining - 1,
           succeeded = b.succeeded + p_succeeded,
           failed = b.failed + p_failed,
           state = v_state,
           completed_at = CASE WHEN v_state <> b.state THEN now() ELSE b.completed_at END
     WHERE id = p_batch;
    IF v_state = b.state THEN
        RETURN QUERY SELECT b.remaining - 1, false;
        RETURN;
    END IF;
    -- This call finished the batch: a leaf hands its totals to its root; a root gets its one successor.
    IF b.parent_id IS NOT NULL THEN
        SELECT * INTO r FROM fanin_settle(b.parent_id, b.succeeded + p_succeeded, b.failed + p_failed);
        RETURN QUERY SELECT b.remaining - 1, coalesce(r.successor_created, false);
        RETURN;
    END IF;
    v_kind := CASE WHEN v_state = 'failed_threshold' AND b.on_failure_message IS NOT NULL
                   THEN 'on_failure' ELSE 'then' END;
    INSERT INTO fanin_successors (batch_id, step, task_id, kind)
    VALUES (b.id, b.step, b.successor_task_id, v_kind)
    ON CONFLICT (batch_id, step) DO NOTHING;
    IF NOT FOUND THEN
        RETURN QUERY SELECT b.remaining - 1, false;
        RETURN;
    END IF;
    INSERT INTO fanin_outbox (batch_id, step) VALUES (b.id, b.step) RETURNING id INTO v_outbox;
    PERFORM pg_notify('fanin_outbox', v_outbox::text);
    RETURN QUERY SELECT b.remaining - 1, true;
END
$$;

CREATE FUNCTION fanin_record_terminal(p_task_id text, p_state text, p_result bytea, p_rct text, p_rce text,
                                      p_exc_type text, p_exc_message text)
RETURNS TABLE (counted boolean, late boolean, remaining integer, successor_created boolean)
LANGUAGE plpgsql AS $$
DECLARE
    v_batch uuid;
    v_ok boolean := p_state = 'succeeded';
    r record;
BEGIN
    -- The conditional transition: only a child still pending or started moves, so a child counts at most once.
    UPDATE fanin_children
       SET state = p_state, finished_at = now(), result = p_result, result_content_type = p_rct,
           result_content_encoding = p_rce, exc_type = p_exc_type, exc_message = p_exc_message
     WHERE task_id = p_task_id AND state IN ('pending', 'started')
    RETURNING batch_id INTO v_batch;
    IF NOT FOUND THEN
        -- Already counted (or unknown): record the report as late. A new statement, so a report that raced the
        -- one that counted sees that one's committed row here.
        UPDATE fanin_children
           SET late_state = p_state, late_at = now(), late_reports = late_reports + 1
         WHERE task_id = p_task_id AND state NOT IN ('pending', 'started');
        RETURN QUERY SELECT false, FOUND, NULL::integer, false;
        RETURN;
    END IF;
    SELECT * INTO r FROM fanin_settle(v_batch, CASE WHEN v_ok THEN 1 ELSE 0 END, CASE WHEN v_ok THEN 0 ELSE 1 END);
    RETURN QUERY SELECT true, false, r.remaining, r.successor_created;
END
$$;

CREATE FUNCTION fanin_seal(p_batch uuid)
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
    RETURN QUERY SELECT * FROM fanin_settle(p_batch, 0, 0);
END
$$;

CREATE FUNCTION fanin_record_start(p_task_id text, p_attempt integer, p_worker text)
RETURNS boolean
LANGUAGE plpgsql AS $$
BEGIN
    -- A start is advisory (it tells "never started" from "started, never finished"): its commit need not wait
    -- for the WAL flush, which halves the fsyncs a child costs. Terminal outcomes stay synchronous: a successor
    -- published from a commit that a crash then lost could run twice.
    PERFORM set_config('synchronous_commit', 'off', true);
    UPDATE fanin_children
       SET state = 'started', started_at = now(), attempt = p_attempt, starts = starts + 1, worker = p_worker
     WHERE task_id = p_task_id AND state IN ('pending', 'started');
    RETURN FOUND;
END
$$;
