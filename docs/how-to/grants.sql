-- celery-fanin: database roles, step 2 of 2. Run as fanin_owner after every `fanin migrate` (GRANT and REVOKE are
-- idempotent). Rows are only ever deleted by retention; the stored task signatures (`message`, `*_message`) are
-- written once by producers and never updated, so no role but the owner can rewrite what a worker will run.

-- Every write to a counter, a batch's state, a child's outcome, a successor or the outbox is made by a function
-- that runs with its owner's rights (SECURITY DEFINER, search path pinned: the checked_reports and definer_writes migrations), each with
-- the checks of its own path. EXECUTE on one of them is the right to make that move, on its terms; no runtime
-- role may UPDATE fanin_batches, fanin_children, fanin_successors or fanin_outbox, or INSERT into the last two.
-- The migrations revoke PUBLIC's EXECUTE on them already; this repeats it for a database migrated before.
-- Internal (no role calls them): fanin_settle_v2, fanin_fail_up_v2, fanin_create_successor_v2,
-- fanin_record_terminal_v2. fanin_report_terminal and fanin_report_unrun are the entry points of the workers of
-- version 31 and before, kept until a later migration (a role granted them before keeps them).
REVOKE EXECUTE ON FUNCTION fanin_settle_v2(uuid, integer, integer, double precision),
                           fanin_fail_up_v2(uuid, integer, double precision),
                           fanin_create_successor_v2(uuid, text, text, text, double precision),
                           fanin_record_terminal_v2(text, text, bytea, text, text, text, text, timestamptz, integer,
                                                    text),
                           fanin_report_terminal(text, uuid, integer, text, text, bytea, text, text, text, text,
                                                 timestamptz, integer, text),
                           fanin_report_unrun(text, uuid, integer, text, text, text, text),
                           fanin_report_terminal_v2(text, uuid, integer, text, text, bytea, text, text, text, text,
                                                    timestamptz, integer, text, double precision),
                           fanin_report_unrun_v2(text, uuid, integer, text, text, text, text, double precision),
                           fanin_note_traceback(text, text),
                           fanin_note_traceback_v2(text, text, text, text),
                           fanin_note_successor_traceback(uuid, text, text),
                           fanin_record_starts(text[], integer[], text[], timestamptz[]),
                           fanin_seal(uuid),
                           fanin_ensure_successor(uuid, text),
                           fanin_add_children(uuid, uuid[], integer[], integer, integer, bytea),
                           fanin_mark_published(uuid, integer),
                           fanin_expire_batch(uuid, text, boolean),
                           fanin_cancel_open(uuid),
                           fanin_reconcile_batch(uuid),
                           fanin_abandon_after_threshold(uuid),
                           fanin_claim_redrive(text, integer),
                           fanin_fail_lost(text),
                           fanin_revoke_expired(text, double precision),
                           fanin_renew_open_batches(),
                           fanin_seal_open(uuid, double precision),
                           fanin_claim_outbox(integer, bigint[]),
                           fanin_outbox_sent(bigint[]),
                           fanin_outbox_failed(bigint, text, double precision),
                           fanin_republish_successor(uuid, text, double precision, double precision),
                           fanin_fail_lost_replacement(uuid, text, double precision, text),
                           fanin_rerun_successor(uuid, text, text, text),
                           fanin_record_action(text, text, uuid, text, text),
                           fanin_claim_run_v2(uuid, text, text, integer, double precision, double precision, text,
                                              text, text, text),
                           fanin_count_duplicate(uuid, text),
                           fanin_hand_over_v2(uuid, text, integer, text, timestamptz, text),
                           fanin_take_back_v2(uuid, text, integer, double precision, text),
                           fanin_renew_leases(uuid[], text[], integer[], double precision),
                           fanin_finish_successor_v2(uuid, text, text, integer, text, bytea, text, text, text,
                                                     text, text, integer, text, text),
                           fanin_end_replacement(uuid, text, text, text, text, text, text),
                           fanin_wake_relay(uuid),
                           fanin_notify_relay(text)
    FROM PUBLIC;
-- Direct writes a database migrated (and granted) before definer_writes still has: revoked, so that re-running this
-- file after the upgrade leaves only the functions. (Revoking what was never granted is a no-op.)
REVOKE UPDATE, INSERT ON fanin_batches, fanin_children, fanin_successors, fanin_outbox
    FROM fanin_producer, fanin_worker, fanin_relay;
REVOKE USAGE ON SEQUENCE fanin_outbox_id_seq FROM fanin_producer, fanin_relay;

-- Producers: write a batch and its children (a child's row as published: no outcome columns), and through the
-- functions raise a streamed batch's counters, mark children published, seal, cancel a streamed batch whose input
-- raised (only while it is open), create an empty batch's successor and publish it (claim and mark the outbox row),
-- and wake the relay for a batch's children when its transaction commits (fanin_notify_relay: a NOTIFY, no write).
GRANT SELECT, INSERT ON fanin_batches TO fanin_producer;
GRANT SELECT ON fanin_children, fanin_successors, fanin_successor_reruns, fanin_outbox TO fanin_producer;
GRANT INSERT (task_id, batch_id, idx, task_name, message, content_type, content_encoding, expires_at, eta_at)
    ON fanin_children TO fanin_producer;
GRANT EXECUTE ON FUNCTION fanin_add_children(uuid, uuid[], integer[], integer, integer, bytea),
                          fanin_mark_published(uuid, integer),
                          fanin_seal(uuid),
                          fanin_cancel_open(uuid),
                          fanin_ensure_successor(uuid, text),
                          fanin_claim_outbox(integer, bigint[]),
                          fanin_outbox_sent(bigint[]),
                          fanin_outbox_failed(bigint, text, double precision),
                          fanin_abandon_after_threshold(uuid),
                          fanin_notify_relay(text) TO fanin_producer;

-- Workers: a child's start and terminal outcome (fanin_report_terminal_v2 counts a report only if the child row
-- matches its message; the last one creates the successor), and a successor's run: admitted only under its
-- pre-assigned task id, every later write fenced to the run's number (or, from the main process, to that task
-- id); a nested batch's successor reports its outer child inside fanin_finish_successor. The successor a report
-- created is published by that worker after its commit (`fanin_worker_publishes_successors`): a completed batch's
-- returned by the report that created it (fanin_handed_off, also read on its own) and marked sent, any other
-- through the relay's claim, marked sent or failed, and the rest of a batch past its threshold abandoned; one the
-- worker leaves to the relay is made due at once (fanin_wake_relay). A failed child's or successor's traceback is
-- written once, after the report that counted the failure or its late resend (fanin_note_traceback_v2,
-- fanin_note_successor_traceback; fanin_note_traceback for workers not yet restarted).
-- A replaced successor ends when a task of its replacement before the carrier fails (fanin_end_replacement).
-- Read access for BatchOutcome.results().
GRANT SELECT ON fanin_batches, fanin_children, fanin_successors, fanin_successor_reruns, fanin_outbox TO fanin_worker;
GRANT EXECUTE ON FUNCTION fanin_report_terminal_v2(text, uuid, integer, text, text, bytea, text, text, text, text,
                                                   timestamptz, integer, text, double precision),
                          fanin_report_unrun_v2(text, uuid, integer, text, text, text, text, double precision),
                          fanin_note_traceback(text, text),
                          fanin_note_traceback_v2(text, text, text, text),
                          fanin_note_successor_traceback(uuid, text, text),
                          fanin_record_starts(text[], integer[], text[], timestamptz[]),
                          fanin_claim_run_v2(uuid, text, text, integer, double precision, double precision, text,
                                              text, text, text),
                          fanin_count_duplicate(uuid, text),
                          fanin_hand_over_v2(uuid, text, integer, text, timestamptz, text),
                          fanin_take_back_v2(uuid, text, integer, double precision, text),
                          fanin_renew_leases(uuid[], text[], integer[], double precision),
                          fanin_finish_successor_v2(uuid, text, text, integer, text, bytea, text, text, text,
                                                     text, text, integer, text, text),
                          fanin_end_replacement(uuid, text, text, text, text, text, text),
                          fanin_claim_outbox(integer, bigint[]),
                          fanin_outbox_sent(bigint[]),
                          fanin_outbox_failed(bigint, text, double precision),
                          fanin_abandon_after_threshold(uuid),
                          fanin_wake_relay(uuid),
                          fanin_handed_off(uuid)
    TO fanin_worker;

-- The relay: the outbox, children no producer published, lost children (only overdue ones), expired children
-- (only past their expiry), deadlines (only due ones) and cancels, stalled successors, open batches whose
-- producer is gone, thresholds and reconciliation. It never creates batches or children.
GRANT SELECT ON fanin_batches, fanin_children, fanin_successors, fanin_successor_reruns, fanin_outbox TO fanin_relay;
GRANT SELECT ON fanin_operator_actions TO fanin_producer, fanin_worker, fanin_relay, fanin_maintenance;
GRANT EXECUTE ON FUNCTION fanin_claim_outbox(integer, bigint[]),
                          fanin_outbox_sent(bigint[]),
                          fanin_outbox_failed(bigint, text, double precision),
                          fanin_mark_published(uuid, integer),
                          fanin_claim_redrive(text, integer),
                          fanin_fail_lost(text),
                          fanin_revoke_expired(text, double precision),
                          fanin_expire_batch(uuid, text, boolean),
                          fanin_reconcile_batch(uuid),
                          fanin_abandon_after_threshold(uuid),
                          fanin_renew_open_batches(),
                          fanin_seal_open(uuid, double precision),
                          fanin_republish_successor(uuid, text, double precision, double precision),
                          fanin_fail_lost_replacement(uuid, text, double precision, text),
                          fanin_rerun_successor(uuid, text, text, text),
                          fanin_record_action(text, text, uuid, text, text) TO fanin_relay;

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
GRANT SELECT ON fanin_successors, fanin_successor_reruns, fanin_outbox TO fanin_maintenance;
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
GRANT SELECT ON fanin_batches, fanin_children, fanin_successors, fanin_successor_reruns, fanin_outbox, fanin_sagas,
                fanin_saga_steps, fanin_saga_compensations, fanin_operator_actions TO fanin_dashboard;

-- The node view (`fanin_nodes`, version 22): what `status`, `ls`, `retry-failed` and the dashboard's batch pages
-- read. It reads fanin_batches, fanin_successors and fanin_children with its owner's rights, so it goes to the
-- roles that may read all three already (it shows them nothing new), and to no other: not fanin_maintenance.
GRANT SELECT ON fanin_nodes TO fanin_producer, fanin_worker, fanin_relay, fanin_dashboard;
