-- celery-fanin: database roles, step 2 of 2. Run as fanin_owner after every `fanin migrate` (GRANT and REVOKE are
-- idempotent). Rows are only ever deleted by retention; the stored task signatures (`message`, `*_message`) are
-- written once by producers and never updated, so no role but the owner can rewrite what a worker will run.

-- The functions that count a child and settle its batch run with their owner's rights (SECURITY DEFINER, search
-- path pinned: migration 0014), so EXECUTE on them is the right to move a batch, and only on their terms. The
-- migration revokes them from PUBLIC already; this repeats it for a database migrated before.
REVOKE EXECUTE ON FUNCTION fanin_settle(uuid, integer, integer),
                           fanin_fail_up(uuid, integer),
                           fanin_create_successor(uuid, text, text, text),
                           fanin_record_terminal(text, text, bytea, text, text, text, text),
                           fanin_record_terminal(text, text, bytea, text, text, text, text, timestamptz, integer, text),
                           fanin_report_terminal(text, uuid, integer, text, text, bytea, text, text, text, text,
                                                 timestamptz, integer, text),
                           fanin_record_starts(text[], integer[], text[], timestamptz[]),
                           fanin_seal(uuid) FROM PUBLIC;

-- Producers: write a batch and its children, publish them, send an empty (or already finished) batch's successor.
GRANT SELECT, INSERT ON fanin_batches, fanin_children TO fanin_producer;
GRANT UPDATE (planned, remaining, digest, published_upto, state, succeeded, failed, completed_at, max_failures,
              last_settle_moved, producer_seen_at)
    ON fanin_batches TO fanin_producer;
-- A streamed batch whose generator raises (no key) is cancelled by its producer: its unfinished children are
-- marked abandoned.
GRANT UPDATE (state, finished_at, exc_type, exc_message) ON fanin_children TO fanin_producer;
GRANT SELECT, INSERT ON fanin_successors, fanin_outbox TO fanin_producer;
GRANT UPDATE (state, state_at) ON fanin_successors TO fanin_producer;
GRANT UPDATE (sent_at, attempts, last_error, available_at) ON fanin_outbox TO fanin_producer;
GRANT USAGE ON SEQUENCE fanin_outbox_id_seq TO fanin_producer;
GRANT EXECUTE ON FUNCTION fanin_seal(uuid) TO fanin_producer;

-- Workers: a child's start and terminal outcome, through the functions only (no write to a child, a counter, a
-- successor row's creation or the outbox), and the successor's own run: its start guard, lease, state and result
-- are columns of its row the worker updates (store/successors.py; none of them moves a counter). Read access for
-- BatchOutcome.results(). fanin_record_terminal (by task id) is for a nested batch's successor, which finishes
-- the outer child it stands for.
GRANT SELECT ON fanin_batches, fanin_children, fanin_successors, fanin_outbox TO fanin_worker;
GRANT UPDATE (state, runs, duplicates, started_at, state_at, finished_at, exc_type, exc_message, result,
              result_content_type, result_content_encoding, lease_until, attempt, run_owner)
    ON fanin_successors TO fanin_worker;
GRANT EXECUTE ON FUNCTION fanin_record_terminal(text, text, bytea, text, text, text, text),
                          fanin_record_terminal(text, text, bytea, text, text, text, text, timestamptz, integer, text),
                          fanin_report_terminal(text, uuid, integer, text, text, bytea, text, text, text, text,
                                                timestamptz, integer, text),
                          fanin_record_starts(text[], integer[], text[], timestamptz[]) TO fanin_worker;

-- The relay: the outbox, children no producer published, lost children, deadlines, stalled successors and
-- reconciliation. It never creates batches or children.
GRANT SELECT ON fanin_batches, fanin_children, fanin_successors, fanin_outbox TO fanin_relay;
GRANT UPDATE (published_upto, remaining, succeeded, failed, state, completed_at, max_failures, last_settle_moved,
              producer_seen_at)
    ON fanin_batches TO fanin_relay;
GRANT UPDATE (state, started_at, attempt, starts, worker, finished_at, result, result_content_type,
              result_content_encoding, exc_type, exc_message, late_state, late_at, late_reports, redrives,
              redriven_at)
    ON fanin_children TO fanin_relay;
GRANT INSERT ON fanin_successors, fanin_outbox TO fanin_relay;
GRANT UPDATE (state, state_at, lease_until) ON fanin_successors TO fanin_relay;
GRANT UPDATE (sent_at, attempts, last_error, available_at) ON fanin_outbox TO fanin_relay;
GRANT USAGE ON SEQUENCE fanin_outbox_id_seq TO fanin_relay;
GRANT EXECUTE ON FUNCTION fanin_record_terminal(text, text, bytea, text, text, text, text),
                          fanin_record_terminal(text, text, bytea, text, text, text, text, timestamptz, integer, text),
                          fanin_settle(uuid, integer, integer), fanin_seal(uuid) TO fanin_relay;

-- Sagas (schema version 4). Every move of a saga is made by `kick`, which runs in the producer's
-- saga(...).apply_async() (record the saga, start step 1, and settle it if its batch already finished) and in the
-- internal tasks `celery_fanin.saga_step_done` and `compensation_done` on workers. Each of those may create a
-- fan-in batch (the next step's, a compensation stage's), which only the producer role may, so these rights go to
-- fanin_producer, and a worker that runs sagas logs in as a member of fanin_producer and fanin_worker. The steps'
-- definitions and undos are written once; a compensation's signature (`message`, `task_id`, `attempt`) is only
-- rewritten by `saga resume`, and `acked_*` only by `saga ack`: those are operator commands, run as fanin_owner.
GRANT SELECT, INSERT ON fanin_sagas, fanin_saga_steps, fanin_saga_compensations TO fanin_producer;
GRANT UPDATE (state, current_step, failed_step, exc_type, exc_message, current_stage, failed_compensation, state_at,
              finished_at)
    ON fanin_sagas TO fanin_producer;
GRANT UPDATE (state, batch_id, exc_type, exc_message, started_at, finished_at) ON fanin_saga_steps TO fanin_producer;
GRANT UPDATE (state, batch_id, exc_type, exc_message, finished_at) ON fanin_saga_compensations TO fanin_producer;
-- Workers record the outcomes of saga steps and compensations like any child's (above). The relay never touches
-- the saga tables; retention reads which batches a saga may still need and deletes finished sagas (below). The
-- saga tables have no foreign key to fanin_batches, so pruning a batch deletes no saga row.

-- Retention: find finished batches and delete them; ON DELETE CASCADE removes the rest (as the owner).
GRANT SELECT, DELETE ON fanin_batches TO fanin_maintenance;
GRANT SELECT ON fanin_successors TO fanin_maintenance;
GRANT SELECT (batch_id) ON fanin_children TO fanin_maintenance;  -- to size its transactions, not to read them
-- To skip the batches of sagas that may still roll back (their rollback reads those batches' children), and to
-- delete sagas that finished for good (their steps and compensations go by ON DELETE CASCADE, as the owner).
GRANT SELECT (id, state, finished_at), DELETE ON fanin_sagas TO fanin_maintenance;
GRANT SELECT (saga_id, batch_id) ON fanin_saga_steps, fanin_saga_compensations TO fanin_maintenance;
-- `fanin prune` locks the batches it deletes (FOR UPDATE SKIP LOCKED), which PostgreSQL allows only with an
-- UPDATE privilege. This one adds nothing to what DELETE already allows.
GRANT UPDATE (completed_at) ON fanin_batches TO fanin_maintenance;

-- The dashboard reads and never writes: SELECT on what its pages show (a failed child's arguments are in its
-- stored message), nothing else. It also opens every transaction read-only.
GRANT SELECT ON fanin_batches, fanin_children, fanin_successors, fanin_sagas, fanin_saga_steps,
                fanin_saga_compensations TO fanin_dashboard;
