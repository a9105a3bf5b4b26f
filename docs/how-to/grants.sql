-- celery-fanin: database roles, step 2 of 2. Run as fanin_owner after every `fanin migrate` (GRANT and REVOKE are
-- idempotent). Rows are only ever deleted by retention; the stored task signatures (`message`, `*_message`) are
-- written once by producers and never updated, so no role but the owner can rewrite what a worker will run.

-- The functions that count a child and settle its batch run with the caller's privileges: keep them to the
-- roles below.
REVOKE EXECUTE ON FUNCTION fanin_settle(uuid, integer, integer),
                           fanin_record_terminal(text, text, bytea, text, text, text, text),
                           fanin_record_terminal(text, text, bytea, text, text, text, text, timestamptz, integer, text),
                           fanin_record_starts(text[], integer[], text[], timestamptz[]),
                           fanin_seal(uuid) FROM PUBLIC;

-- Producers: write a batch and its children, publish them, send an empty (or already finished) batch's successor.
GRANT SELECT, INSERT ON fanin_batches, fanin_children TO fanin_producer;
GRANT UPDATE (planned, remaining, digest, published_upto, state, succeeded, failed, completed_at, max_failures)
    ON fanin_batches TO fanin_producer;
GRANT SELECT, INSERT ON fanin_successors, fanin_outbox TO fanin_producer;
GRANT UPDATE (state, state_at) ON fanin_successors TO fanin_producer;
GRANT UPDATE (sent_at, attempts, last_error, available_at) ON fanin_outbox TO fanin_producer;
GRANT USAGE ON SEQUENCE fanin_outbox_id_seq TO fanin_producer;
GRANT EXECUTE ON FUNCTION fanin_seal(uuid), fanin_settle(uuid, integer, integer) TO fanin_producer;

-- Workers: a child's start and terminal outcome, the counter it settles, the successor it may create, and the
-- successor's own run (its start guard, state and result). Read access for BatchOutcome.results().
GRANT SELECT ON fanin_batches, fanin_children, fanin_successors, fanin_outbox TO fanin_worker;
GRANT UPDATE (state, started_at, attempt, starts, worker, finished_at, result, result_content_type,
              result_content_encoding, exc_type, exc_message, late_state, late_at, late_reports)
    ON fanin_children TO fanin_worker;
GRANT UPDATE (remaining, succeeded, failed, state, completed_at) ON fanin_batches TO fanin_worker;
GRANT INSERT ON fanin_successors, fanin_outbox TO fanin_worker;
GRANT UPDATE (state, runs, duplicates, started_at, state_at, finished_at, exc_type, exc_message, result,
              result_content_type, result_content_encoding)
    ON fanin_successors TO fanin_worker;
GRANT USAGE ON SEQUENCE fanin_outbox_id_seq TO fanin_worker;
GRANT EXECUTE ON FUNCTION fanin_record_terminal(text, text, bytea, text, text, text, text),
                          fanin_record_terminal(text, text, bytea, text, text, text, text, timestamptz, integer, text),
                          fanin_record_starts(text[], integer[], text[], timestamptz[]),
                          fanin_settle(uuid, integer, integer) TO fanin_worker;

-- The relay: the outbox, children no producer published, lost children, deadlines, stalled successors and
-- reconciliation. It never creates batches or children.
GRANT SELECT ON fanin_batches, fanin_children, fanin_successors, fanin_outbox TO fanin_relay;
GRANT UPDATE (published_upto, remaining, succeeded, failed, state, completed_at, max_failures)
    ON fanin_batches TO fanin_relay;
GRANT UPDATE (state, started_at, attempt, starts, worker, finished_at, result, result_content_type,
              result_content_encoding, exc_type, exc_message, late_state, late_at, late_reports, redrives,
              redriven_at)
    ON fanin_children TO fanin_relay;
GRANT INSERT ON fanin_successors, fanin_outbox TO fanin_relay;
GRANT UPDATE (state, state_at) ON fanin_successors TO fanin_relay;
GRANT UPDATE (sent_at, attempts, last_error, available_at) ON fanin_outbox TO fanin_relay;
GRANT USAGE ON SEQUENCE fanin_outbox_id_seq TO fanin_relay;
GRANT EXECUTE ON FUNCTION fanin_record_terminal(text, text, bytea, text, text, text, text),
                          fanin_record_terminal(text, text, bytea, text, text, text, text, timestamptz, integer, text),
                          fanin_settle(uuid, integer, integer), fanin_seal(uuid) TO fanin_relay;

-- Retention: find finished batches and delete them; ON DELETE CASCADE removes the rest (as the owner).
GRANT SELECT, DELETE ON fanin_batches TO fanin_maintenance;
GRANT SELECT ON fanin_successors TO fanin_maintenance;
GRANT SELECT (batch_id) ON fanin_children TO fanin_maintenance;  -- to size its transactions, not to read them
-- `fanin prune` locks the batches it deletes (FOR UPDATE SKIP LOCKED), which PostgreSQL allows only with an
-- UPDATE privilege. This one adds nothing to what DELETE already allows.
GRANT UPDATE (completed_at) ON fanin_batches TO fanin_maintenance;
