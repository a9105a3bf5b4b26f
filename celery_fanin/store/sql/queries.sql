-- celery-fanin: the statements the store runs, each under a name and a one-line description.
--
-- Loaded by celery_fanin/store/statements.py (`q(name)`), the one loader: `.text` for SQLAlchemy, `.psycopg` for
-- the worker's own psycopg connection and `exec_driver_sql` (the same text with `%(name)s` placeholders).
-- Placeholders are `:name`; casts are written CAST(... AS type) where a placeholder is cast. Every write to a
-- counter, a batch's state, a child's outcome, a successor or the outbox is a call of a function of schema.sql.
-- Grouped by the module that runs them.

-- --- store/queries.py ---------------------------------------------------------------------------------------------

-- name: batch
-- One batch's row, as BatchRow is built from it (the relay's claim reads the same columns: fanin_claim_outbox).
SELECT b.id, b.step, b.state, b.planned, b.remaining, b.succeeded, b.failed, b.published_upto, b.successor_task_id,
       b.successor_name, b.successor_message, b.successor_content_type, b.successor_content_encoding,
       b.created_at, b.completed_at, b.deadline_at, b.on_expire_message, b.on_expire_content_type,
       b.on_expire_content_encoding, b.on_failure_message, b.on_failure_content_type,
       b.on_failure_content_encoding, extract(epoch FROM b.child_timeout) AS child_timeout_seconds,
       b.round, b.retry_of, b.refused_reports
  FROM fanin_batches b WHERE b.id = :id;

-- name: successor
-- One successor's row, as SuccessorRow is built from it.
SELECT s.task_id AS s_task_id, s.state AS s_state, s.runs AS s_runs, s.duplicates AS s_duplicates,
       s.exc_type AS s_exc_type, s.exc_message AS s_exc_message, s.started_at AS s_started_at,
       s.finished_at AS s_finished_at, s.kind AS s_kind, s.traceback AS s_traceback
  FROM fanin_successors s WHERE s.batch_id = :id AND s.step = :step;

-- name: unfinished_leaves
-- (count, succeeded, failed) of a root's leaves still counting
SELECT count(*), coalesce(sum(succeeded), 0), coalesce(sum(failed) FILTER (WHERE NOT fail_up), 0)
  FROM fanin_batches
 WHERE parent_id = :id AND state IN ('open', 'running');

-- name: successor_result
-- A successor's return value (a nested batch's result)
SELECT result, result_content_type, result_content_encoding FROM fanin_successors WHERE batch_id = :id AND step = :step;

-- name: depth
-- How deep a batch is nested (0: not nested)
SELECT depth FROM fanin_batches WHERE id = :id;

-- name: child_counts
-- How many children are in each state (pending, started, succeeded, failed, lost, ...)
SELECT state, count(*) FROM fanin_children WHERE batch_id IN (SELECT id FROM fanin_batches WHERE id = :id OR parent_id = :id) GROUP BY state;

-- name: failures
-- Children that did not succeed, in child order, with their stored signatures (to show their arguments)
SELECT idx, task_id, task_name, state, exc_type, exc_message, starts, late_state,
       message, content_type, content_encoding, traceback
  FROM fanin_children
 WHERE batch_id IN (SELECT id FROM fanin_batches WHERE id = :id OR parent_id = :id)
   AND state NOT IN ('pending', 'started', 'succeeded')
 ORDER BY idx LIMIT :n;

-- name: stream_failures
-- `failures`, streamed with a server-side cursor (memory bounded by `fetch_size`)
SELECT idx, task_id, task_name, state, exc_type, exc_message, starts, late_state,
       message, content_type, content_encoding, traceback
  FROM fanin_children
 WHERE batch_id IN (SELECT id FROM fanin_batches WHERE id = :id OR parent_id = :id)
   AND state NOT IN ('pending', 'started', 'succeeded')
   AND idx > coalesce(CAST(:after AS integer), -1)
 ORDER BY idx;

-- name: child_results
-- Every child's (index, task id, state, encoded result), in child order, streamed with a server-side cursor
SELECT idx, task_id, state, result, result_content_type, result_content_encoding
  FROM fanin_children
 WHERE batch_id IN (SELECT id FROM fanin_batches WHERE id = :id OR parent_id = :id)
 ORDER BY idx;

-- name: round_results
-- Every child of round 1 of `id`'s batch, in round 1's child order, with its last outcome in rounds up to `id`'s:
-- a retry round's children are the failures of the round before in child order (ops/rounds.py), so its child k
-- is that round's k-th failure. Streamed with a server-side cursor, as child_results
WITH RECURSIVE this AS (
    SELECT coalesce(retry_of, id) AS original, round FROM fanin_batches WHERE id = :id
), rounds AS (
    SELECT b.id, b.round FROM fanin_batches b, this
     WHERE (b.id = this.original OR b.retry_of = this.original) AND b.parent_id IS NULL AND b.round <= this.round
), kids AS (
    SELECT r.round, c.idx, c.task_id, c.state, c.result, c.result_content_type, c.result_content_encoding,
           CASE WHEN c.state NOT IN ('pending', 'started', 'succeeded')
                THEN row_number() OVER (PARTITION BY r.round, c.state NOT IN ('pending', 'started', 'succeeded')
                                        ORDER BY c.idx) - 1 END AS failure_rank
      FROM rounds r
      JOIN fanin_children c ON c.batch_id IN (SELECT l.id FROM fanin_batches l WHERE l.id = r.id OR l.parent_id = r.id)
), last AS (
    SELECT k.idx AS first_idx, k.* FROM kids k WHERE k.round = 1
    UNION ALL
    SELECT l.first_idx, k.* FROM last l JOIN kids k ON k.round = l.round + 1 AND k.idx = l.failure_rank
)
SELECT DISTINCT ON (first_idx) first_idx AS idx, task_id, state, result, result_content_type, result_content_encoding
  FROM last
 ORDER BY first_idx, round DESC;

-- name: unfinished_children
-- A batch's children (leaves included) not yet terminal, in child order, with their stored messages
SELECT c.idx, c.task_id, c.task_name, c.state, c.message, c.content_type, c.content_encoding
  FROM fanin_children c
 WHERE c.batch_id IN (SELECT id FROM fanin_batches WHERE id = :id OR parent_id = :id)
   AND c.state IN ('pending', 'started')
 ORDER BY c.idx;

-- --- store/batches.py ---------------------------------------------------------------------------------------------

-- name: report_terminal
-- A worker's terminal report, counted once if the child row has its message's batch, index, task name (+ handed_off)
SELECT counted, late, remaining, successor_created, refused,
       CASE WHEN successor_created THEN fanin_handed_off(CAST(:batch_id AS uuid)) END AS handed_off
  FROM fanin_report_terminal_v2(:task_id, :batch_id, :index, :task_name, :state, :result, :rct, :rce, :exc_type,
                                :exc_message, :started_at, :attempt, :worker, CAST(:handoff AS double precision));

-- name: report_terminal_many
-- Many workers' terminal reports in one statement and one commit (a prefork worker's group commit,
-- worker/batching.py): each row exactly as report_terminal, in the order given (sorted by batch and index),
-- with its position n in the arrays
SELECT u.n, r.counted, r.late, r.remaining, r.successor_created, r.refused,
       CASE WHEN r.successor_created THEN fanin_handed_off(u.batch_id) END AS handed_off
  FROM unnest(CAST(:task_ids AS text[]), CAST(:batch_ids AS uuid[]), CAST(:indexes AS integer[]),
              CAST(:task_names AS text[]), CAST(:states AS text[]), CAST(:results AS bytea[]),
              CAST(:rcts AS text[]), CAST(:rces AS text[]), CAST(:exc_types AS text[]),
              CAST(:exc_messages AS text[]), CAST(:started_ats AS timestamptz[]), CAST(:attempts AS integer[]),
              CAST(:workers AS text[]))
       WITH ORDINALITY AS u(task_id, batch_id, idx, task_name, state, result, rct, rce, exc_type, exc_message,
                            started_at, attempt, worker, n)
 CROSS JOIN LATERAL fanin_report_terminal_v2(u.task_id, u.batch_id, u.idx, u.task_name, u.state, u.result, u.rct,
                                             u.rce, u.exc_type, u.exc_message, u.started_at, u.attempt, u.worker,
                                             CAST(:handoff AS double precision)) AS r;

-- name: report_unrun
-- A main-process event about a copy of a child that never ran: counted only while no copy has started the child
SELECT counted, late, remaining, successor_created, refused,
       CASE WHEN successor_created THEN fanin_handed_off(CAST(:batch_id AS uuid)) END AS handed_off
  FROM fanin_report_unrun_v2(:task_id, :batch_id, :index, :task_name, :state, :exc_type, :exc_message,
                             CAST(:handoff AS double precision));

-- name: record_terminal
-- A child's terminal outcome by task id alone (tests and tools run as the owner; no runtime role may call it).
SELECT counted, late, remaining, successor_created
  FROM fanin_record_terminal_v2(:task_id, :state, :result, :rct, :rce, :exc_type, :exc_message, :started_at,
                                :attempt, :worker);

-- name: wake_relay
-- Make a batch's successor this session created, and will not publish itself, due now, and wake the relay
SELECT fanin_wake_relay(:batch);

-- name: record_starts
-- Many children's starts in one statement, committed asynchronously.
SELECT fanin_record_starts(:task_ids, :attempts, :workers, :started_at);

-- name: copy_children
-- A chunk of children, by binary COPY (no ON CONFLICT: a taken task id must fail the chunk).
COPY fanin_children (task_id, batch_id, idx, task_name, message, content_type, content_encoding, expires_at, eta_at)
FROM STDIN (FORMAT BINARY);

-- name: insert_batch
-- Insert one batch row
INSERT INTO fanin_batches (id, step, state, planned, remaining, successor_task_id, successor_name,
                           successor_message, successor_content_type, successor_content_encoding,
                           completed_at, child_timeout, on_lost, max_redrives, deadline_at, on_deadline,
                           max_failures, max_failures_ratio, on_expire_message, on_expire_content_type,
                           on_expire_content_encoding, on_failure_message, on_failure_content_type,
                           on_failure_content_encoding, app_name, key, digest, parent_id, depth,
                           lineage, parent_task_id, round, retry_of, fail_up)
VALUES (:id, :step, :state, :planned, :remaining, :stid, :sname, :smsg, :sct, :sce,
        CASE WHEN :state = 'complete' THEN now() END,
        :child_timeout, :on_lost, :max_redrives, :deadline_at, :on_deadline, :max_failures, :ratio,
        :emsg, :ect, :ece, :fmsg, :fct, :fce, :app_name, :key, :digest, :parent_id, :depth, :lineage,
        :parent_task_id, :round, :retry_of, :fail_up)
ON CONFLICT (app_name, key) WHERE key IS NOT NULL DO NOTHING
RETURNING id;

-- name: add_children
-- Write one chunk of an open batch's children and raise the counters that wait for them, in one transaction
SELECT fanin_add_children(:root, CAST(:ids AS uuid[]), CAST(:ns AS integer[]), :total, :direct, :digest);

-- name: state_of
-- A batch's state now (None if there is no such batch)
SELECT state FROM fanin_batches WHERE id = :id;

-- name: seal
-- Release an open batch's token
SELECT * FROM fanin_seal(:id);

-- name: lock_membership
-- Serialise a chunk of an open batch against its cancel, deadline or seal (the batch id's second 64 bits)
SELECT pg_advisory_xact_lock(:k1, :k2);

-- name: takes_children
-- Whether a batch is still open, read under its membership lock (a cancel, a deadline or a seal waits for it)
SELECT state = 'open' FROM fanin_batches WHERE id = :id;

-- name: successor_task_id
-- The task id a batch assigned its successor when it was created
SELECT successor_task_id FROM fanin_batches WHERE id = :id;

-- name: find_by_key
-- The batch holding an idempotency key
SELECT id, state, planned, digest FROM fanin_batches WHERE app_name = :a AND key = :k;

-- name: direct_children
-- Children written to the batch row itself (not to its leaves)
SELECT count(*) FROM fanin_children WHERE batch_id = :id;

-- name: open_leaves
-- An open root's open leaves and how many children each holds (to resume a producer)
SELECT id, planned FROM fanin_batches WHERE parent_id = :id AND state = 'open' ORDER BY created_at, id;

-- name: insert_successor
-- Create the batch's one successor (`kind` says which signature it runs) and its outbox row, once
SELECT fanin_ensure_successor(:id, :kind);

-- name: hold_publish_lock
-- Take the session-level lock that says "this batch's children are being published by a live process"
SELECT pg_advisory_lock(:k1, :k2);

-- name: try_publish_lock
-- Take a batch's publish lock if no live session holds it
SELECT pg_try_advisory_lock(:k1, :k2);

-- name: release_publish_lock
-- Release a batch's publish lock
SELECT pg_advisory_unlock(:k1, :k2);

-- name: mark_published
-- Record that children with idx < upto are on the broker or need not be (monotonic
SELECT fanin_mark_published(:id, CAST(:upto AS integer));

-- name: unpublished_batches
-- Batches some of whose children may never have reached the broker (their producer died or is publishing)
SELECT id FROM fanin_batches WHERE published_upto < planned AND parent_id IS NULL ORDER BY created_at LIMIT :n;

-- name: unpublished_children
-- The next children of a batch not yet known to be published and still waited for, in index order, with...
SELECT c.idx, c.task_id, c.task_name, c.message, c.content_type, c.content_encoding
  FROM fanin_batches root
  JOIN fanin_batches b ON b.id = root.id OR b.parent_id = root.id
  JOIN fanin_children c ON c.batch_id = b.id AND c.idx >= root.published_upto AND c.state = 'pending'
 WHERE root.id = :id
 ORDER BY c.idx LIMIT :n;

-- --- store/outbox.py ----------------------------------------------------------------------------------------------

-- name: claim
-- Lock up to `limit` due, unsent rows that no other transaction holds (only `ids`, when given)
SELECT * FROM fanin_claim_outbox(:n, CAST(:ids AS bigint[]));

-- name: claim_batch
-- Lock a batch's unsent rows, through the same claim (the worker whose report created its successor, after commit)
SELECT * FROM fanin_claim_outbox(:n, ARRAY(SELECT o.id FROM fanin_outbox o WHERE o.batch_id = :batch AND o.sent_at IS NULL));

-- name: handed_off
-- A batch's successor handed to this session by its report (unsent, not yet due for the relay), with its batch's
-- and successor's rows, as a jsonb array (`handed_off_rows` reads it); read, not locked (a relay claims it only
-- once it is due)
SELECT fanin_handed_off(:batch) AS handed_off;

-- name: mark_sent
-- Mark the rows sent and their successors `sent`, in one statement (a started successor keeps its state)
SELECT fanin_outbox_sent(CAST(:ids AS bigint[]));

-- name: mark_sent_async
-- The same, and the transaction's commit does not wait for its WAL flush (lost in a crash: published again)
SELECT fanin_outbox_sent(CAST(:ids AS bigint[])), set_config('synchronous_commit', 'off', true);

-- name: mark_failed
-- Keep the row pending, due again after a backoff, with the error for `status` and the logs
SELECT fanin_outbox_failed(:id, :err, :delay);

-- name: backlog
-- How many rows wait to be published, and the age in seconds of the oldest
SELECT count(*), extract(epoch FROM now() - min(created_at)) FROM fanin_outbox WHERE sent_at IS NULL;

-- name: pending_ids
-- A batch's outbox rows not yet sent (to publish a successor at once rather than on NOTIFY)
SELECT id FROM fanin_outbox WHERE batch_id = :id AND sent_at IS NULL ORDER BY id;

-- --- store/successors.py ------------------------------------------------------------------------------------------

-- name: stalled
-- Successors published or handed over and not started `timeout` seconds after they were due, or whose run is dead
-- (never a replaced one: only its replacement's carrier may run it, and Celery, not the relay, publishes that).
SELECT s.batch_id, s.step FROM fanin_successors s
 WHERE fanin_successor_stalled(s.state, s.carrier, s.lease_until, s.state_at, CAST(:timeout AS double precision),
                               CAST(:grace AS double precision))
 LIMIT :n;

-- name: claim_run
-- Admit one delivery of a successor, or say why not
SELECT run, attempt, state, run_owner FROM fanin_claim_run_v2(:id, :step, :task_id, :retries, CAST(:lease AS double precision), CAST(:grace AS double precision), :owner, :owner_key, :carrier, :dead_owner);

-- name: note_traceback
-- A failed child's traceback, after the report that counted the failure or a late resend of it (bounded, written
-- once, and only onto a counted failure of the same error type and text, by the function)
SELECT fanin_note_traceback_v2(:task_id, :traceback, :exc_type, :exc_message);

-- name: note_successor_traceback
-- A failed successor's traceback, after its run was recorded failed
SELECT fanin_note_successor_traceback(:id, :step, :traceback);

-- name: count_duplicate
-- Count a refused delivery (shown by `status` as the successor's duplicates)
SELECT fanin_count_duplicate(:id, :step);

-- name: hand_over
-- End `run` without finishing the successor
SELECT fanin_hand_over_v2(:id, :step, :run, :state, CAST(:due AS timestamptz), :carrier);

-- name: take_back
-- Undo `hand_over` when the retry or replacement was never published (Celery raised instead)
SELECT fanin_take_back_v2(:id, :step, :run, CAST(:lease AS double precision), :carrier);

-- name: renew_leases
-- Extend the leases of live runs, in one statement
SELECT batch_id, step, runs FROM fanin_renew_leases(CAST(:ids AS uuid[]), CAST(:steps AS text[]), CAST(:runs AS integer[]), CAST(:lease AS double precision));

-- name: record_state
-- Move the successor to a final state
SELECT fanin_finish_successor_v2(:id, :step, :task_id, CAST(:run AS integer), :state, :result, :rct, :rce, :exc_type, :exc_message, :carrier, CAST(:retries AS integer), :ran_in, :owner_key);

-- name: end_replacement
-- A part of the successor's replacement failed or was revoked: end the successor that still waits for its carrier
SELECT fanin_end_replacement(:id, :step, :task_id, :carrier, :state, :exc_type, :exc_message);

-- name: republish
-- Put a stalled successor's outbox row back in line (same task id
SELECT fanin_republish_successor(:id, :step, CAST(:timeout AS double precision), CAST(:grace AS double precision));

-- name: lost_replacements
-- Replaced successors whose carrier never came or whose carrier's run died, `timeout` seconds ago
SELECT s.batch_id, s.step FROM fanin_successors s
 WHERE s.carrier IS NOT NULL AND s.state IN ('replaced', 'running')
   AND fanin_successor_lapsed(s.lease_until, s.state_at, CAST(:timeout AS double precision))
 LIMIT :n;

-- name: fail_lost_replacement
-- Record a replaced successor whose replacement was lost as failed (ReplacementLost)
SELECT fanin_fail_lost_replacement(:id, :step, CAST(:timeout AS double precision), :message);

-- name: rerun
-- An operator's rerun of a failed or revoked successor under a new task id: (rerun number, state, previous task
-- id, previous state); no row: no such successor; a NULL rerun: refused, its state says why
SELECT rerun, state, previous_task_id, previous_state FROM fanin_rerun_successor(:id, :step, :task_id, :by);

-- name: successor_states
-- A batch's successors (its `then`, or its on_failure / on_expire), oldest first
SELECT step, state FROM fanin_successors WHERE batch_id = :id ORDER BY created_at, step;

-- name: reruns
-- A successor's reruns, oldest first
SELECT rerun, task_id, previous_task_id, previous_state, previous_exc_type, previous_exc_message, previous_runs,
       requested_by, requested_at
  FROM fanin_successor_reruns WHERE batch_id = :id AND step = :step ORDER BY rerun;

-- --- store/recovery.py --------------------------------------------------------------------------------------------

-- name: held_publish_locks
-- How many batches a live session holds the publish lock of (the key `lapsed_open_batches` matches).
SELECT count(*) FROM fanin_batches b
 WHERE EXISTS (
       SELECT 1 FROM pg_locks l
        WHERE l.granted AND l.locktype = 'advisory' AND l.objsubid = 2
          AND l.classid = CAST(CAST(CAST('x' || substr(replace(b.id::text, '-', ''), 1, 8) AS bit(32)) AS integer) AS oid)
          AND l.objid = CAST(CAST(CAST('x' || substr(replace(b.id::text, '-', ''), 9, 8) AS bit(32)) AS integer) AS oid)
          AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()));

-- name: lapsed_open_batches
-- Open root batches nobody holds the publish lock of, whose producer was last seen longer ago than the grace.
SELECT b.id FROM fanin_batches b
 WHERE b.state = 'open' AND b.parent_id IS NULL
   AND b.producer_seen_at < now() - make_interval(secs => :grace)
   AND NOT EXISTS (
       SELECT 1 FROM pg_locks l
        WHERE l.granted AND l.locktype = 'advisory' AND l.objsubid = 2
          AND l.classid = CAST(CAST(CAST('x' || substr(replace(b.id::text, '-', ''), 1, 8) AS bit(32)) AS integer) AS oid)
          AND l.objid = CAST(CAST(CAST('x' || substr(replace(b.id::text, '-', ''), 9, 8) AS bit(32)) AS integer) AS oid)
          AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()))
 ORDER BY b.producer_seen_at LIMIT :n;

-- name: overdue_children
-- Unfinished children of running batches whose child_timeout has passed since they last started (or were...
-- batch_id is the batch the child's message names: a tree's root for a leaf's child (as the producer published it),
-- so that a redriven copy's report finds the successor it creates (handed to its worker, or woken for the relay)
SELECT c.task_id, coalesce(b.parent_id, b.id) AS batch_id, c.idx, c.task_name, c.state, b.on_lost, c.redrives,
       b.max_redrives,
       c.message, c.content_type, c.content_encoding
  FROM fanin_batches b
  JOIN fanin_children c ON c.batch_id = b.id AND c.state IN ('pending', 'started')
 WHERE b.state IN ('open', 'running') AND b.child_timeout IS NOT NULL
   AND greatest(b.created_at, c.started_at, c.redriven_at, c.eta_at) + b.child_timeout < now()
   -- a nested fan-in's child is alive for as long as its inner batch is
   AND NOT EXISTS (SELECT 1 FROM fanin_batches n
                    WHERE n.parent_task_id = c.task_id AND n.state IN ('open', 'running'))
 ORDER BY b.created_at, c.idx
 LIMIT :n;

-- name: claim_redrive
-- Take the right to re-publish an overdue child once
SELECT fanin_claim_redrive(:task_id, :seen);

-- name: fail_lost
-- Count an overdue child as a terminal failure with state `lost`
SELECT fanin_fail_lost(:task_id);

-- name: expired_children
-- Children never started whose `expires` passed more than `grace_seconds` ago
SELECT c.task_id, c.batch_id, c.idx
  FROM fanin_children c
  JOIN fanin_batches b ON b.id = c.batch_id AND b.state IN ('open', 'running')
 WHERE c.expires_at IS NOT NULL AND c.state = 'pending'
   AND c.expires_at + make_interval(secs => :grace) < now()
 ORDER BY c.expires_at
 LIMIT :n;

-- name: revoke_expired
-- Count a child as `revoked` (expired) if it is still pending and past its expiry
SELECT fanin_revoke_expired(:task_id, :grace);

-- name: due_deadlines
-- Open and running roots whose deadline has passed, oldest deadline first
SELECT id FROM fanin_batches
 WHERE state IN ('open', 'running') AND parent_id IS NULL
   AND deadline_at IS NOT NULL AND deadline_at <= now()
 ORDER BY deadline_at LIMIT :n;

-- name: expire_batch
-- Apply a passed deadline (or a cancel) to a running or open batch, once
SELECT * FROM fanin_expire_batch(:id, :reason, CAST(:proceed AS boolean));

-- name: cancel_open_batch
-- `expire_batch(reason="cancel", proceed=False)` for a batch that is still open (its producer's input raised)
SELECT * FROM fanin_cancel_open(:id);

-- name: batches_to_reconcile
-- Open and running batches (leaves before roots, so a leaf finished here is counted in its root's recount),...
SELECT id FROM (
    SELECT id, parent_id IS NULL AS is_root FROM fanin_batches WHERE state IN ('open', 'running')
    UNION
    SELECT b.id, true FROM fanin_batches b
      LEFT JOIN fanin_successors s ON s.batch_id = b.id AND s.step = b.step
      LEFT JOIN fanin_outbox o ON o.batch_id = b.id AND o.step = b.step
     WHERE b.parent_id IS NULL AND b.state IN ('complete', 'partial', 'failed_threshold')
       AND (s.batch_id IS NULL OR o.id IS NULL)
) candidates
 ORDER BY is_root
 LIMIT :n;

-- name: reconcile_batch
-- Recompute one batch's counters from its child rows (and leaves) and repair what disagrees
SELECT problems, actions FROM fanin_reconcile_batch(:id);

-- name: pruned_part
-- A finished root: its planned count, the rows kept (its own children, its leaves' planned counts), and its totals
-- less its leaves' (what the leaves retention deleted counted, if that is all that is missing)
SELECT b.planned, d.created + l.planned AS created, d.created AS direct, l.unfinished,
       b.succeeded - l.succeeded AS pruned_succeeded, b.failed - l.failed AS pruned_failed
  FROM fanin_batches b,
       LATERAL (SELECT count(*) AS created FROM fanin_children c WHERE c.batch_id = b.id) d,
       LATERAL (SELECT coalesce(sum(x.planned), 0) AS planned, coalesce(sum(x.succeeded), 0) AS succeeded,
                       coalesce(sum(x.failed), 0) AS failed,
                       count(*) FILTER (WHERE x.state IN ('open', 'running')) AS unfinished
                  FROM fanin_batches x WHERE x.parent_id = b.id) l
 WHERE b.id = :id AND b.parent_id IS NULL AND b.state NOT IN ('open', 'running');

-- name: abandon_after_threshold
-- Stop a batch that passed its failure threshold
SELECT fanin_abandon_after_threshold(:id);

-- name: renew_open_batches
-- Renew the producer's lease of every open root whose publish lock a live session holds
SELECT fanin_renew_open_batches();

-- name: seal_open_batch
-- Seal an open root batch and its open leaves
SELECT planned, successor_created FROM fanin_seal_open(:id, CAST(:grace AS double precision));

-- name: batch_state
-- A batch's state and its root (for a leaf), to explain why it could not be sealed or cancelled
SELECT state, parent_id FROM fanin_batches WHERE id = :id;

-- --- store/admin.py -----------------------------------------------------------------------------------------------

-- The node statements read the view `fanin_nodes` (migration 0022): a batch with its unfinished leaves' counts
-- added, its successor's state and, for a nested batch, its outer child's index.
-- name: node
-- One batch as a node of the batch graph (`status`, `ls`, the tree views)
SELECT * FROM fanin_nodes b WHERE b.id = :id;

-- name: node_leaves
-- A tree root's leaf counters as nodes, oldest first
SELECT * FROM fanin_nodes b WHERE b.parent_id = :id ORDER BY b.created_at, b.id LIMIT :n;

-- name: node_descendants
-- The batches this batch's children or successor created, as nodes
SELECT * FROM fanin_nodes b
 WHERE b.lineage = :id AND b.parent_id IS NULL
 ORDER BY b.child_index NULLS LAST, b.created_at, b.id LIMIT :n;

-- name: node_rounds
-- Round 1 of a batch and every retry round of it, as nodes, in round order
SELECT * FROM fanin_nodes b
 WHERE (b.id = :id AND b.retry_of IS NULL) OR b.retry_of = :id
 ORDER BY b.round, b.created_at;

-- name: list_batches
-- Root batches newest first, filtered by state, stuck-ness, age and step
SELECT p.last_progress, now() AS now, b.*
  FROM fanin_nodes b
  LEFT JOIN LATERAL (
        SELECT max(ch.finished_at) AS last_progress FROM fanin_children ch
         WHERE b.state IN ('open', 'running')
           AND ch.batch_id IN (SELECT y.id FROM fanin_batches y WHERE y.id = b.id OR y.parent_id = b.id)
  ) p ON true
 WHERE b.parent_id IS NULL
   AND (CAST(:any_state AS boolean)
        OR b.state = ANY(CAST(:states AS text[]))
        OR (CAST(:stuck AS boolean) AND b.state IN ('open', 'running')
            AND greatest(b.created_at, p.last_progress) < now() - make_interval(secs => :threshold)))
   AND (CAST(:older AS double precision) IS NULL
        OR b.created_at < now() - make_interval(secs => CAST(:older AS double precision)))
   AND (CAST(:newer AS double precision) IS NULL
        OR b.created_at > now() - make_interval(secs => CAST(:newer AS double precision)))
   AND (CAST(:step AS text) IS NULL OR b.step = CAST(:step AS text))
 ORDER BY b.created_at DESC, b.id
 LIMIT :n;

-- A root batch retention may delete: finished, with its successor finished too (an expired or cancelled batch may
-- have none), finished before the cut-off, with no retry round still running, and not a step or compensation of a saga that
-- may still roll back (its rollback reads which of the batch's children succeeded). `created_at < cut-off` is
-- implied by the completion time and lets the planner walk the creation index instead of the whole table.
-- name: prunable_totals
-- How many root batches (and children) retention would delete now
SELECT count(*) AS n, coalesce(sum(b.planned), 0) AS children
  FROM fanin_batches b
 WHERE b.parent_id IS NULL
   AND b.state IN ('complete', 'partial', 'failed_threshold', 'expired', 'cancelled')
   AND b.created_at < now() - make_interval(secs => :age)
   AND coalesce(b.completed_at, b.created_at) < now() - make_interval(secs => :age)
   AND (EXISTS (SELECT 1 FROM fanin_successors s
                 WHERE s.batch_id = b.id AND s.step = b.step
                   AND fanin_successor_final(s.state))
        OR (b.state IN ('expired', 'cancelled')
            AND NOT EXISTS (SELECT 1 FROM fanin_successors s WHERE s.batch_id = b.id)))
   AND NOT EXISTS (SELECT 1 FROM fanin_batches r
                    WHERE r.retry_of = b.id AND r.state IN ('open', 'running'))
   AND NOT EXISTS (SELECT 1 FROM fanin_saga_steps st JOIN fanin_sagas g ON g.id = st.saga_id
                    WHERE st.batch_id = b.id AND g.state IN ('running', 'compensating', 'compensation_failed'))
   AND NOT EXISTS (SELECT 1 FROM fanin_saga_compensations c JOIN fanin_sagas g ON g.id = c.saga_id
                    WHERE c.batch_id = b.id AND g.state IN ('running', 'compensating', 'compensation_failed'));

-- name: lock_prunable
-- Lock up to `n` prunable roots, oldest first, skipping rows another session holds
SELECT b.id, b.planned, (SELECT count(*) FROM fanin_batches x WHERE x.parent_id = b.id) AS leaves
  FROM fanin_batches b
 WHERE b.parent_id IS NULL
   AND b.state IN ('complete', 'partial', 'failed_threshold', 'expired', 'cancelled')
   AND b.created_at < now() - make_interval(secs => :age)
   AND coalesce(b.completed_at, b.created_at) < now() - make_interval(secs => :age)
   AND (EXISTS (SELECT 1 FROM fanin_successors s
                 WHERE s.batch_id = b.id AND s.step = b.step
                   AND fanin_successor_final(s.state))
        OR (b.state IN ('expired', 'cancelled')
            AND NOT EXISTS (SELECT 1 FROM fanin_successors s WHERE s.batch_id = b.id)))
   AND NOT EXISTS (SELECT 1 FROM fanin_batches r
                    WHERE r.retry_of = b.id AND r.state IN ('open', 'running'))
   AND NOT EXISTS (SELECT 1 FROM fanin_saga_steps st JOIN fanin_sagas g ON g.id = st.saga_id
                    WHERE st.batch_id = b.id AND g.state IN ('running', 'compensating', 'compensation_failed'))
   AND NOT EXISTS (SELECT 1 FROM fanin_saga_compensations c JOIN fanin_sagas g ON g.id = c.saga_id
                    WHERE c.batch_id = b.id AND g.state IN ('running', 'compensating', 'compensation_failed'))
 ORDER BY b.created_at, b.id LIMIT :n FOR UPDATE OF b SKIP LOCKED;

-- A saga retention may delete: finished for good (succeeded, or compensated with every manual action acknowledged)
-- before the cut-off. Its steps and compensations go with it (ON DELETE CASCADE); its batches are batches like any
-- other (no foreign key), pruned by the rules above. A saga waiting for an operator (`manual_action_required`,
-- `compensation_failed`) is never deleted, whatever its age.
-- name: prunable_sagas
-- How many sagas retention would delete now
SELECT count(*) FROM fanin_sagas
 WHERE state IN ('succeeded', 'compensated') AND finished_at < now() - make_interval(secs => :age);

-- name: delete_sagas
-- Delete up to `n` prunable sagas, oldest first, checked again on rows changed meanwhile
DELETE FROM fanin_sagas
 WHERE id IN (SELECT id FROM fanin_sagas
               WHERE state IN ('succeeded', 'compensated') AND finished_at < now() - make_interval(secs => :age)
               ORDER BY finished_at, id LIMIT :n)
   AND state IN ('succeeded', 'compensated') AND finished_at < now() - make_interval(secs => :age);

-- name: open_children
-- (pending, started) children of a batch and its leaves
SELECT count(*) FILTER (WHERE state = 'pending') AS pending,
       count(*) FILTER (WHERE state = 'started') AS started
  FROM fanin_children
 WHERE batch_id IN (SELECT id FROM fanin_batches WHERE id = :id OR parent_id = :id)
   AND state IN ('pending', 'started');

-- name: last_progress
-- When a child of the batch (or of its leaves) last reached a terminal state
SELECT max(finished_at) FROM fanin_children WHERE batch_id IN (SELECT id FROM fanin_batches WHERE id = :id OR parent_id = :id);

-- name: child_location
-- The root batch a child belongs to (its leaf's root for a tree) and the child's index
SELECT coalesce(b.parent_id, b.id) AS root, c.idx FROM fanin_children c JOIN fanin_batches b ON b.id = c.batch_id WHERE c.task_id = :t;

-- name: recovery_policy
-- What a batch does about lost children (a retry round of it does the same)
SELECT extract(epoch FROM child_timeout) AS timeout_s, on_lost, max_redrives FROM fanin_batches WHERE id = :id;

-- name: db_now
-- The database's clock
SELECT now();

-- name: failure_count
-- Children of a batch (and its leaves) that ended in any terminal state but `succeeded`
SELECT count(*) FROM fanin_children
 WHERE batch_id IN (SELECT id FROM fanin_batches WHERE id = :id OR parent_id = :id)
   AND state NOT IN ('pending', 'started', 'succeeded');

-- name: latest_round
-- The batch of the highest round of `original_id` (itself when it was never retried)
SELECT id FROM fanin_batches
 WHERE (id = :id AND retry_of IS NULL) OR retry_of = :id
 ORDER BY round DESC, created_at DESC LIMIT 1;

-- name: highest_round
-- The highest retry round of a batch of round 1
SELECT coalesce(max(round), 1) FROM fanin_batches WHERE id = :id OR retry_of = :id;

-- name: lock_leaves
-- Up to `limit` leaves of a locked prunable root, with their child counts
SELECT id, planned FROM fanin_batches WHERE parent_id = :id ORDER BY id LIMIT :n FOR UPDATE SKIP LOCKED;

-- name: child_rows
-- Child rows held directly by these batches (about to be deleted with them)
SELECT count(*) FROM fanin_children WHERE batch_id = ANY(CAST(:ids AS uuid[]));

-- name: delete_batches
-- Delete batch rows
DELETE FROM fanin_batches WHERE id = ANY(CAST(:ids AS uuid[]));

-- name: record_action
-- An operator's action from the dashboard, with who, what and how it ended (fanin_operator_actions)
SELECT fanin_record_action(:actor, :action, :batch, :outcome, :detail);

-- --- store/observability.py ---------------------------------------------------------------------------------------

-- name: open_and_stuck
-- Unfinished root batches, and how many of them had no child start or finish for `stuck_after` seconds
SELECT count(*),
       count(*) FILTER (WHERE b.created_at < now() - make_interval(secs => :stuck) AND NOT EXISTS (
           SELECT 1 FROM fanin_children c
            WHERE c.batch_id IN (SELECT id FROM fanin_batches WHERE id = b.id OR parent_id = b.id)
              AND greatest(c.started_at, c.finished_at) >= now() - make_interval(secs => :stuck)))
  FROM fanin_batches b
 WHERE b.parent_id IS NULL AND b.state IN ('open', 'running');

-- name: database_now
-- The database's clock, less a lag (rows committed late still land in the next window)
SELECT now() - make_interval(secs => :lag);

-- name: finished_by_state
-- Batches that finished in the window, by state
SELECT c.state, count(*) FROM fanin_batches b JOIN fanin_children c ON c.batch_id = b.id
 WHERE (b.state IN ('open', 'running') OR b.completed_at >= :since)
   AND c.finished_at >= :since AND c.finished_at < :until
 GROUP BY c.state;

-- name: successor_latencies
-- Seconds from each batch's completion to its successor's start, for successors started in the window
SELECT extract(epoch FROM s.started_at - b.completed_at)
  FROM fanin_successors s JOIN fanin_batches b ON b.id = s.batch_id
 WHERE s.started_at >= :since AND s.started_at < :until AND b.completed_at IS NOT NULL;

-- name: successors_finished_by_state
-- Successors that reached a final state in the window, by state
SELECT state, count(*) FROM fanin_successors
 WHERE finished_at >= :since AND finished_at < :until
 GROUP BY state;

-- --- store/sagas.py -----------------------------------------------------------------------------------------------

-- name: get_saga
-- A saga's row.
SELECT id, app_name, key, state, steps, current_step, failed_step, exc_type, exc_message, current_stage,
       resumes, failed_compensation, compensation_timeout, compensation_redrives, created_at, state_at,
       finished_at
  FROM fanin_sagas WHERE id = :id;

-- name: get_saga_locked
-- A saga's row, locked until the transaction ends (every transition of the saga takes this lock).
SELECT id, app_name, key, state, steps, current_step, failed_step, exc_type, exc_message, current_stage,
       resumes, failed_compensation, compensation_timeout, compensation_redrives, created_at, state_at,
       finished_at
  FROM fanin_sagas WHERE id = :id
   FOR UPDATE;

-- name: first_child
-- A step batch's one child (a task step's task, or the nested child standing for a group step).
SELECT c.task_id, c.batch_id, c.idx, c.task_name, c.state, c.exc_type, c.exc_message, c.message,
       c.content_type, c.content_encoding
  FROM fanin_children c WHERE c.batch_id = :b AND c.idx = 0 ORDER BY c.idx, c.batch_id;

-- name: succeeded_children_marked
-- Children of these batches that succeeded and whose stored message contains the marker, in child order.
SELECT c.task_id, c.batch_id, c.idx, c.task_name, c.state, c.exc_type, c.exc_message, c.message,
       c.content_type, c.content_encoding
  FROM fanin_children c
 WHERE c.batch_id = ANY(CAST(:bs AS uuid[])) AND c.state = 'succeeded'
   AND position(CAST(:m AS bytea) IN c.message) > 0
 ORDER BY c.idx, c.batch_id;

-- name: get_compensations
-- A saga's compensations in the order they run (one stage, or all of them)
SELECT
   undo_of, position, stage, ordinal, kind, unit, task_name, message, content_type, content_encoding, manual_text,
   state, attempt, task_id, batch_id, exc_type, exc_message, acked_at, acked_by, finished_at
FROM fanin_saga_compensations WHERE saga_id = :id AND (CAST(:stage AS integer) IS NULL OR stage = :stage) ORDER BY stage, ordinal;

-- name: create_saga_1
-- Write the saga and every step in one transaction
INSERT INTO fanin_sagas (id, app_name, key, steps, compensation_timeout, compensation_redrives)
VALUES (:id, :app_name, :key, :steps, :timeout, :redrives)
ON CONFLICT (app_name, key) WHERE key IS NOT NULL DO NOTHING
RETURNING id;

-- name: create_saga_2
-- Write the saga and every step in one transaction
INSERT INTO fanin_saga_steps (saga_id, position, kind, name, manual_text, definition, content_type,
                              content_encoding, undo_message, undo_content_type, undo_content_encoding)
VALUES (:saga_id, :position, :kind, :name, :manual_text, :definition, :ct, :ce, :undo, :uct, :uce);

-- name: find_saga
-- The saga holding an idempotency key
SELECT id FROM fanin_sagas WHERE app_name = :a AND key = :k;

-- name: get_steps
-- A saga's steps, in order
SELECT position, kind, name, manual_text, definition, content_type, content_encoding, undo_message,
       undo_content_type, undo_content_encoding, state, batch_id, exc_type, exc_message, started_at,
       finished_at
  FROM fanin_saga_steps WHERE saga_id = :id ORDER BY position;

-- name: start_step
-- Record the step's batch (the same one, whoever created it
UPDATE fanin_saga_steps SET batch_id = :b, state = 'running', started_at = coalesce(started_at, now())
 WHERE saga_id = :id AND position = :p AND state IN ('pending', 'running');

-- name: finish_step
-- A step's final state and why
UPDATE fanin_saga_steps SET state = :state, exc_type = :et, exc_message = :em, finished_at = now()
 WHERE saga_id = :id AND position = :p;

-- name: set_step_states
-- Move the given steps to `state`, those still in one of `only_from`
UPDATE fanin_saga_steps SET state = :state
 WHERE saga_id = :id AND position = ANY(CAST(:ps AS integer[])) AND state = ANY(CAST(:from AS text[]));

-- name: advance
-- Move a running saga to its next step
UPDATE fanin_sagas SET current_step = :n, state_at = now() WHERE id = :id;

-- name: set_state
-- A saga's new state, with why it failed or how its rollback stopped
UPDATE fanin_sagas
   SET state = :state, state_at = now(), failed_compensation = :fc,
       finished_at = CASE WHEN :finished THEN now() END
 WHERE id = :id;

-- name: start_rollback_1
-- The step failed for good
INSERT INTO fanin_saga_compensations (saga_id, undo_of, position, stage, ordinal, kind, unit,
                                      task_name, message, content_type, content_encoding,
                                      manual_text, task_id)
VALUES (:saga_id, :undo_of, :position, :stage, :ordinal, :kind, :unit, :task_name, :message, :ct,
        :ce, :manual_text, :task_id)
ON CONFLICT (saga_id, undo_of) DO NOTHING;

-- name: start_rollback_2
-- The step failed for good
UPDATE fanin_sagas
   SET state = 'compensating', failed_step = :p, exc_type = :et, exc_message = :em, current_stage = 0,
       state_at = now()
 WHERE id = :id;

-- name: start_rollback_3
-- The step failed for good
UPDATE fanin_saga_steps SET state = 'skipped' WHERE saga_id = :id AND position > :p;

-- name: start_rollback_4
-- The step failed for good
UPDATE fanin_saga_steps s SET state = 'nothing_to_undo'
 WHERE s.saga_id = :id AND s.position < :p AND s.state = 'succeeded'
   AND NOT EXISTS (SELECT 1 FROM fanin_saga_compensations c
                    WHERE c.saga_id = s.saga_id AND c.position = s.position);

-- name: set_stage
-- Move a compensating saga to its next rollback stage
UPDATE fanin_sagas SET current_stage = :s, state_at = now() WHERE id = :id;

-- name: request_manual
-- The rollback reached these manual steps
UPDATE fanin_saga_compensations SET state = 'manual_action_required'
    WHERE saga_id = :id AND stage = :s AND kind = 'manual' AND state = 'pending'
RETURNING position;

-- name: set_stage_batch
-- Record the compensation batch that runs these compensations' current attempt
UPDATE fanin_saga_compensations SET batch_id = :b, state = 'running'
 WHERE saga_id = :id AND undo_of = ANY(CAST(:u AS text[])) AND state IN ('pending', 'running');

-- name: stage_outcomes
-- The automated compensations of a stage, each with the terminal state of its current attempt's task
SELECT r.undo_of, r.position, r.task_id, r.task_name, r.state, r.batch_id, c.state AS child_state,
       c.exc_type, c.exc_message
  FROM fanin_saga_compensations r
  LEFT JOIN fanin_children c ON c.task_id = r.task_id
 WHERE r.saga_id = :id AND r.stage = :s AND r.kind <> 'manual'
 ORDER BY r.ordinal;

-- name: finish_compensation
-- A compensation's final state and why
UPDATE fanin_saga_compensations
   SET state = :state, exc_type = :et, exc_message = :em, finished_at = now()
 WHERE saga_id = :id AND undo_of = :u AND state IN ('pending', 'running');

-- name: retry_compensation
-- A new attempt of a compensation that did not succeed
UPDATE fanin_saga_compensations
   SET attempt = :a, task_id = :t, message = :m, content_type = :ct, content_encoding = :ce,
       batch_id = NULL, state = 'pending', exc_type = NULL, exc_message = NULL, finished_at = NULL
 WHERE saga_id = :id AND undo_of = :u AND state NOT IN ('succeeded', 'manual_action_required',
                                                         'acknowledged');

-- name: mark_resumed
-- A stopped rollback restarted by `saga resume`
UPDATE fanin_sagas SET state = 'compensating', failed_compensation = NULL, finished_at = NULL,
                       resumes = resumes + 1, state_at = now()
 WHERE id = :id;

-- name: waiting_on
-- The (saga, stage) pairs whose compensations a compensation batch runs
SELECT DISTINCT saga_id, stage FROM fanin_saga_compensations WHERE batch_id = :b;

-- name: acknowledge
-- An operator did the manual undo of a step
UPDATE fanin_saga_compensations SET state = 'acknowledged', acked_at = now(), acked_by = :by,
                                       finished_at = now()
    WHERE saga_id = :id AND position = :p AND kind = 'manual' AND state = 'manual_action_required'
RETURNING 1;

-- name: manual_pending
-- Manual actions an operator has been asked for and not yet acknowledged
SELECT count(*) FROM fanin_saga_compensations WHERE saga_id = :id AND kind = 'manual' AND state = 'manual_action_required';

-- name: sagas_batch_state
-- A batch's state and whether its successor succeeded
SELECT state FROM fanin_batches WHERE id = :id;

-- name: nested_batch
-- The batch a nested fan-in child created (`celery_fanin.run_group` as a child), if it did
SELECT id FROM fanin_batches WHERE parent_task_id = :t ORDER BY created_at LIMIT 1;

-- name: leaves
-- The leaf batches of a wide batch (a tree of counters)
SELECT id FROM fanin_batches WHERE parent_id = :b ORDER BY id;

-- name: nested_batches
-- The batches nested fan-in children of these batches created, whatever those children ended in (the inner...
SELECT n.id FROM fanin_children c JOIN fanin_batches n ON n.parent_task_id = c.task_id
 WHERE c.batch_id = ANY(CAST(:bs AS uuid[])) AND c.task_name = :run_group
 ORDER BY c.idx, n.id;

-- name: caller_database
-- The database a caller's transaction (`transaction=`) is on, and whether it holds the fan-in schema
SELECT current_database(), to_regclass('fanin_batches') IS NOT NULL;

-- name: wake_relay_for_batch
-- Wake the relay when the caller's transaction commits (a NOTIFY is delivered then): it publishes the batch's children
SELECT fanin_notify_relay(:payload);

-- name: ping
-- Whether the store answers (the relay's readiness probe)
SELECT 1;

-- name: listen_outbox
-- The relay's subscription to the channel new outbox rows and new batches are announced on (protocol.OUTBOX_CHANNEL)
LISTEN fanin_outbox;

-- name: backend_pid
-- The server process of this session (the pooler probe watches whether a client keeps it)
SELECT pg_backend_pid();
