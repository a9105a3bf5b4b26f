-- The dashboard's reads (celery_fanin.web), beside what store/queries.py and store/admin.py already read.
-- Every filter is a parameter that is NULL when unused; the dashboard's connections never prepare statements
-- server-side, so each is planned with its values, the unused filters fold away, and the page walks the index
-- of the filter it has (migration 0016; tests/web/test_explain.py reads the plans).

-- name: batches_page
-- Root batches newest first, filtered (a NULL filter matches all), after the keyset cursor (created_at, id).
SELECT b.id, b.app_name, b.key, b.step, b.state, b.planned, b.round, b.succeeded, b.failed,
       b.created_at, b.completed_at, b.successor_state, now() AS now
  FROM fanin_nodes b
 WHERE b.parent_id IS NULL
   AND (CAST(:state AS text) IS NULL OR b.state = CAST(:state AS text))
   AND (CAST(:step AS text) IS NULL OR b.step = CAST(:step AS text))
   AND (CAST(:app AS text) IS NULL OR b.app_name = CAST(:app AS text))
   AND (CAST(:key_from AS text) IS NULL
        OR (b.key IS NOT NULL AND b.key COLLATE "C" >= CAST(:key_from AS text)
            AND (CAST(:key_to AS text) IS NULL OR b.key COLLATE "C" < CAST(:key_to AS text))))
   AND (CAST(:before_at AS timestamptz) IS NULL
        OR (b.created_at, b.id) < (CAST(:before_at AS timestamptz), CAST(:before_id AS uuid)))
 ORDER BY b.created_at DESC, b.id DESC
 LIMIT :n;

-- name: active_counts
-- How many root batches are open and running now.
SELECT b.state, count(*) AS n
  FROM fanin_batches b
 WHERE b.parent_id IS NULL AND b.state IN ('open', 'running')
 GROUP BY b.state;

-- name: batch_detail
-- One batch (a root, a leaf or a retry round) with its counts in children and the saga it is a step of, if any.
SELECT b.id, b.app_name, b.key, b.step, b.state, b.planned, b.published_upto, b.refused_reports,
       b.succeeded + coalesce(l.succeeded, 0) AS succeeded,
       b.failed + coalesce(l.failed, 0) AS failed, coalesce(l.leaves, 0) AS counting_leaves,
       b.max_failures, b.max_failures_ratio, b.deadline_at, b.on_deadline,
       extract(epoch FROM b.child_timeout) AS child_timeout_s, b.on_lost, b.max_redrives,
       b.successor_name, b.successor_task_id, b.created_at, b.completed_at, b.parent_id, b.parent_task_id,
       b.lineage, b.depth, b.round, b.retry_of, now() AS now,
       coalesce((SELECT st.saga_id FROM fanin_saga_steps st WHERE st.batch_id = b.id LIMIT 1),
                (SELECT c.saga_id FROM fanin_saga_compensations c WHERE c.batch_id = b.id LIMIT 1)) AS saga_id
  FROM fanin_batches b
  LEFT JOIN LATERAL (
        SELECT count(*) AS leaves, sum(x.succeeded) AS succeeded,
               sum(x.failed) FILTER (WHERE NOT x.fail_up) AS failed
          FROM fanin_batches x
         WHERE x.parent_id = b.id AND x.state IN ('open', 'running')
  ) l ON true
 WHERE b.id = :id;

-- name: failure_counts
-- The children of a batch and its leaves that did not succeed, counted by state.
SELECT c.state, count(*) AS n
  FROM fanin_children c
 WHERE c.batch_id IN (SELECT x.id FROM fanin_batches x WHERE x.id = :id OR x.parent_id = :id)
   AND c.state NOT IN ('pending', 'started', 'succeeded')
 GROUP BY c.state;

-- name: failures_page
-- The children of a batch and its leaves that did not succeed, in child order, past index :after.
SELECT c.idx, c.task_id, c.task_name, c.state, c.exc_type, c.exc_message, c.starts, c.late_state, c.worker,
       c.finished_at, c.message, c.content_type, c.content_encoding, c.traceback
  FROM fanin_children c
 WHERE c.batch_id IN (SELECT x.id FROM fanin_batches x WHERE x.id = :id OR x.parent_id = :id)
   AND c.state NOT IN ('pending', 'started', 'succeeded')
   AND c.idx > :after
 ORDER BY c.idx
 LIMIT :n;

-- name: leaf_sizes
-- A tree root's leaf counters, with how many children each holds.
SELECT x.id, x.planned
  FROM fanin_batches x
 WHERE x.parent_id = :id;

-- name: start_sample
-- When a sample of a batch's children started: from each of :ids (the root, its leaves), :counts children spread over its index range.
SELECT b.id AS batch_id, c.idx, c.started_at
  FROM unnest(CAST(:ids AS uuid[]), CAST(:counts AS integer[])) AS b(id, n)
 CROSS JOIN LATERAL (SELECT min(x.idx) AS lo, max(x.idx) AS hi FROM fanin_children x WHERE x.batch_id = b.id) r
 CROSS JOIN LATERAL generate_series(0, b.n - 1) AS k(i)
 CROSS JOIN LATERAL (
        SELECT x.idx, x.started_at
          FROM fanin_children x
         WHERE x.batch_id = b.id AND x.idx >= r.lo + CAST(r.hi - r.lo + 1 AS bigint) * k.i / b.n
         ORDER BY x.idx
         LIMIT 1) c;

-- name: batch_briefs
-- State and counts of a few batches by id (a saga's steps and compensation stages).
SELECT b.id, b.state, b.planned, b.succeeded, b.failed
  FROM fanin_batches b
 WHERE b.id = ANY(CAST(:ids AS uuid[]));

-- name: sagas_page
-- Sagas newest first, filtered by state (NULL: any), after the keyset cursor, with their unacknowledged manual actions.
SELECT g.id, g.app_name, g.key, g.state, g.steps, g.current_step, g.failed_step, g.exc_type, g.exc_message,
       g.created_at, g.finished_at, now() AS now,
       (SELECT count(*) FROM fanin_saga_compensations c
         WHERE c.saga_id = g.id AND c.state = 'manual_action_required') AS manual_actions
  FROM fanin_sagas g
 WHERE (CAST(:state AS text) IS NULL OR g.state = CAST(:state AS text))
   AND (CAST(:before_at AS timestamptz) IS NULL
        OR (g.created_at, g.id) < (CAST(:before_at AS timestamptz), CAST(:before_id AS uuid)))
 ORDER BY g.created_at DESC, g.id DESC
 LIMIT :n;

-- name: successor_by_task_id
-- The batch whose successor has this task id (pre-assigned when the batch was created). No index serves it: a scan
-- of the batches, bounded by the dashboard's statement timeout (a child's task id, the usual lookup, is a key)
-- (or a rerun's task id: `fanin rerun` gives the successor a new one, recorded in fanin_successor_reruns)
SELECT id AS batch_id FROM fanin_batches WHERE successor_task_id = :t AND parent_id IS NULL
 UNION ALL
SELECT batch_id FROM fanin_successor_reruns WHERE task_id = :t
 LIMIT 1;

-- name: relays_connected
-- The relays connected to this database now: each holds a LISTEN connection named "celery-fanin relay HOST:PID"
-- (application_name, which pg_stat_activity shows every role)
SELECT application_name AS name FROM pg_stat_activity
 WHERE datname = current_database() AND starts_with(application_name, 'celery-fanin relay ')
 ORDER BY application_name;

-- name: outbox_panel
-- The outbox as the relay panel shows it: unsent rows, how many are due, how many failed to publish, and the age
-- in seconds of the oldest unsent one
SELECT count(*) AS unsent, count(*) FILTER (WHERE available_at <= now()) AS due,
       count(*) FILTER (WHERE attempts > 0) AS failing,
       extract(epoch FROM now() - min(created_at)) AS oldest_s
  FROM fanin_outbox WHERE sent_at IS NULL;

-- name: oldest_unsent
-- The oldest unsent successor: its batch, step, since when, and the last error publishing it
SELECT o.batch_id, o.step, o.created_at, o.available_at, o.attempts, o.last_error
  FROM fanin_outbox o WHERE o.sent_at IS NULL ORDER BY o.created_at, o.id LIMIT 1;

-- name: operator_actions
-- What operators did to a batch from the dashboard, newest first
SELECT at, actor, action, outcome, detail FROM fanin_operator_actions
 WHERE batch_id = :id ORDER BY at DESC, id DESC LIMIT 20;

