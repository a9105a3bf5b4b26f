-- celery-fanin: the current schema, every table, index, view and function, as the migrations leave it.
--
-- This file is the reference, not an installer: `celery -A proj fanin migrate` applies migrations/ (deltas, in
-- order, recorded in fanin_migrations). tests/store/test_schema_sql.py loads this file into one empty database
-- and the migrations into another and compares their catalogs (tables, columns in order, constraints, indexes,
-- sequences, views, and each function's whole definition), so the two cannot drift apart. To change the schema:
-- write the next migration, then make the same change here (docs/concepts/layout.md, "Changing the schema").
--
-- Functions are versioned by name: a function whose arguments or result change gets a new name (`_v2`, `_v3`)
-- and the old one is dropped once nothing calls it; no function is overloaded. Every function runs with its
-- owner's rights, search path pinned to this schema (the block at the end).

-- Tables

-- A batch: its counter (`remaining` children still to report; an open batch holds one more, its producer's
-- token), its totals, its state, its successor's stored signature and recovery policy. A tree's leaves are rows
-- here too (`parent_id`: the root). No counter column is in any index, so a settle is a HOT update (fillfactor).
CREATE TABLE fanin_batches (
    id                          uuid NOT NULL,
    step                        text NOT NULL,
    state                       text NOT NULL,
    planned                     integer NOT NULL,
    remaining                   integer NOT NULL,
    succeeded                   integer NOT NULL DEFAULT 0,
    failed                      integer NOT NULL DEFAULT 0,
    published_upto              integer NOT NULL DEFAULT 0,
    successor_task_id           text NOT NULL,
    successor_name              text NOT NULL,
    successor_message           bytea NOT NULL,
    successor_content_type      text NOT NULL,
    successor_content_encoding  text NOT NULL,
    created_at                  timestamptz NOT NULL DEFAULT now(),
    completed_at                timestamptz,
    child_timeout               interval,
    on_lost                     text NOT NULL DEFAULT 'fail',
    max_redrives                integer NOT NULL DEFAULT 3,
    deadline_at                 timestamptz,
    on_deadline                 text NOT NULL DEFAULT 'proceed',
    max_failures                integer,
    on_expire_message           bytea,
    on_expire_content_type      text,
    on_expire_content_encoding  text,
    on_failure_message          bytea,
    on_failure_content_type     text,
    on_failure_content_encoding text,
    app_name                    text,
    key                         text,
    digest                      bytea,
    parent_id                   uuid,
    depth                       integer NOT NULL DEFAULT 0,
    lineage                     uuid,
    parent_task_id              text,
    max_failures_ratio          double precision,
    round                       integer NOT NULL DEFAULT 1,
    retry_of                    uuid,
    last_settle_moved           boolean NOT NULL DEFAULT false,
    fail_up                     boolean NOT NULL DEFAULT false,
    producer_seen_at            timestamptz NOT NULL DEFAULT now(),
    refused_reports             integer NOT NULL DEFAULT 0,
    CONSTRAINT fanin_batches_pkey PRIMARY KEY (id),
    CONSTRAINT fanin_batches_planned_check CHECK (planned >= 0),
    CONSTRAINT fanin_batches_remaining_check CHECK (remaining >= 0),
    CONSTRAINT fanin_batches_on_lost_check CHECK (on_lost IN ('fail', 'redrive')),
    CONSTRAINT fanin_batches_on_deadline_check CHECK (on_deadline IN ('proceed', 'abandon')),
    CONSTRAINT fanin_batches_state_check CHECK (state IN ('open', 'running', 'complete', 'partial',
                                                          'failed_threshold', 'expired', 'cancelled')),
    CONSTRAINT fanin_batches_parent_id_fkey FOREIGN KEY (parent_id) REFERENCES fanin_batches(id) ON DELETE CASCADE
) WITH (fillfactor=70);
CREATE INDEX fanin_batches_created ON fanin_batches (created_at);
CREATE UNIQUE INDEX fanin_batches_key ON fanin_batches (app_name, key) WHERE key IS NOT NULL;
CREATE INDEX fanin_batches_leaves ON fanin_batches (parent_id) WHERE parent_id IS NOT NULL;
CREATE INDEX fanin_batches_lineage ON fanin_batches (lineage) WHERE lineage IS NOT NULL;
CREATE INDEX fanin_batches_parent_task ON fanin_batches (parent_task_id) WHERE parent_task_id IS NOT NULL;
CREATE INDEX fanin_batches_retry_of ON fanin_batches (retry_of, round) WHERE retry_of IS NOT NULL;
CREATE INDEX fanin_batches_roots ON fanin_batches (created_at, id) WHERE parent_id IS NULL;
CREATE INDEX fanin_batches_roots_app ON fanin_batches (app_name, created_at, id) WHERE parent_id IS NULL;
CREATE INDEX fanin_batches_roots_key ON fanin_batches (key COLLATE "C") WHERE parent_id IS NULL AND key IS NOT NULL;
CREATE INDEX fanin_batches_roots_state ON fanin_batches (state, created_at, id) WHERE parent_id IS NULL;
CREATE INDEX fanin_batches_roots_step ON fanin_batches (step, created_at, id) WHERE parent_id IS NULL;
CREATE INDEX fanin_batches_running ON fanin_batches (created_at) WHERE state IN ('open', 'running');
CREATE INDEX fanin_batches_unpublished ON fanin_batches (created_at) WHERE published_upto < planned;

-- A child: its stored signature (for re-publishing), its state (pending | started until its one terminal
-- transition), its outcome, its start, redrives and late reports.
CREATE TABLE fanin_children (
    task_id                 text NOT NULL,
    batch_id                uuid NOT NULL,
    idx                     integer NOT NULL,
    task_name               text NOT NULL,
    state                   text NOT NULL DEFAULT 'pending',
    message                 bytea NOT NULL,
    content_type            text NOT NULL,
    content_encoding        text NOT NULL,
    result                  bytea,
    result_content_type     text,
    result_content_encoding text,
    exc_type                text,
    exc_message             text,
    finished_at             timestamptz,
    started_at              timestamptz,
    attempt                 integer NOT NULL DEFAULT 0,
    starts                  integer NOT NULL DEFAULT 0,
    worker                  text,
    redrives                integer NOT NULL DEFAULT 0,
    redriven_at             timestamptz,
    late_state              text,
    late_at                 timestamptz,
    late_reports            integer NOT NULL DEFAULT 0,
    expires_at              timestamptz,
    eta_at                  timestamptz,
    duplicates              integer NOT NULL DEFAULT 0,
    traceback               text,
    CONSTRAINT fanin_children_pkey PRIMARY KEY (task_id),
    CONSTRAINT fanin_children_batch_id_idx_key UNIQUE (batch_id, idx),
    CONSTRAINT fanin_children_state_check CHECK (state IN ('pending', 'started', 'succeeded', 'failed', 'time_limit',
                                                           'worker_lost', 'revoked', 'rejected', 'unknown', 'lost',
                                                           'abandoned')),
    CONSTRAINT fanin_children_batch_id_fkey FOREIGN KEY (batch_id) REFERENCES fanin_batches(id) ON DELETE CASCADE
);
CREATE INDEX fanin_children_expiring ON fanin_children (expires_at) WHERE expires_at IS NOT NULL AND state = 'pending';
CREATE INDEX fanin_children_failures ON fanin_children (batch_id, idx) WHERE state NOT IN ('pending', 'started', 'succeeded');
CREATE INDEX fanin_children_open ON fanin_children (batch_id) WHERE state IN ('pending', 'started');

-- A finished batch's one successor (`kind`: the `then` signature, or on_expire / on_failure instead) and its run:
-- a lease (`lease_until`) fenced by the run number `runs`.
CREATE TABLE fanin_successors (
    batch_id                uuid NOT NULL,
    step                    text NOT NULL,
    task_id                 text NOT NULL,
    state                   text NOT NULL DEFAULT 'pending',
    runs                    integer NOT NULL DEFAULT 0,
    duplicates              integer NOT NULL DEFAULT 0,
    exc_type                text,
    exc_message             text,
    created_at              timestamptz NOT NULL DEFAULT now(),
    started_at              timestamptz,
    finished_at             timestamptz,
    kind                    text NOT NULL DEFAULT 'then',
    state_at                timestamptz NOT NULL DEFAULT now(),
    result                  bytea,
    result_content_type     text,
    result_content_encoding text,
    lease_until             timestamptz,
    attempt                 integer NOT NULL DEFAULT 0,
    run_owner               text,
    carrier                 text,
    run_owner_key           text,
    traceback               text,
    CONSTRAINT fanin_successors_pkey PRIMARY KEY (batch_id, step),
    CONSTRAINT fanin_successors_kind_check CHECK (kind IN ('then', 'on_expire', 'on_failure')),
    CONSTRAINT fanin_successors_state_check CHECK (state IN ('pending', 'sent', 'running', 'retrying', 'requeued',
                                                             'replaced', 'succeeded', 'failed', 'revoked', 'ignored')),
    CONSTRAINT fanin_successors_batch_id_fkey FOREIGN KEY (batch_id) REFERENCES fanin_batches(id) ON DELETE CASCADE
);

-- Successors waiting to be published; the relay claims them FOR UPDATE SKIP LOCKED and marks them sent.
CREATE TABLE fanin_outbox (
    id           bigserial,
    batch_id     uuid NOT NULL,
    step         text NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now(),
    available_at timestamptz NOT NULL DEFAULT now(),
    sent_at      timestamptz,
    attempts     integer NOT NULL DEFAULT 0,
    last_error   text,
    CONSTRAINT fanin_outbox_pkey PRIMARY KEY (id),
    CONSTRAINT fanin_outbox_batch_id_step_key UNIQUE (batch_id, step),
    CONSTRAINT fanin_outbox_batch_id_fkey FOREIGN KEY (batch_id) REFERENCES fanin_batches(id) ON DELETE CASCADE
);
CREATE INDEX fanin_outbox_pending ON fanin_outbox (available_at, id) WHERE sent_at IS NULL;

-- What operators did from the dashboard, who and when (version 30); kept when batches are pruned.
CREATE TABLE fanin_operator_actions (
    id       bigserial,
    at       timestamptz NOT NULL DEFAULT now(),
    actor    text NOT NULL,
    action   text NOT NULL,
    batch_id uuid NOT NULL,
    outcome  text NOT NULL,
    detail   text,
    CONSTRAINT fanin_operator_actions_pkey PRIMARY KEY (id),
    CONSTRAINT fanin_operator_actions_action_check CHECK (action IN ('retry-failed', 'cancel', 'seal', 'rerun')),
    CONSTRAINT fanin_operator_actions_outcome_check CHECK (outcome IN ('done', 'refused', 'error'))
);
CREATE INDEX fanin_operator_actions_batch ON fanin_operator_actions (batch_id, at);


-- An operator's reruns of a failed or revoked successor (version 29): who asked, when, and what each replaced.
CREATE TABLE fanin_successor_reruns (
    batch_id             uuid NOT NULL,
    step                 text NOT NULL,
    rerun                integer NOT NULL,
    task_id              text NOT NULL,
    previous_task_id     text NOT NULL,
    previous_state       text NOT NULL,
    previous_exc_type    text,
    previous_exc_message text,
    previous_runs        integer NOT NULL,
    requested_by         text NOT NULL,
    requested_at         timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT fanin_successor_reruns_pkey PRIMARY KEY (batch_id, step, rerun),
    CONSTRAINT fanin_successor_reruns_previous_state_check CHECK (previous_state IN ('failed', 'revoked')),
    CONSTRAINT fanin_successor_reruns_batch_id_step_fkey FOREIGN KEY (batch_id, step)
        REFERENCES fanin_successors(batch_id, step) ON DELETE CASCADE
);

-- Sagas (version 4): an ordered list of steps, each a fan-in batch, and the rollback of completed work.
CREATE TABLE fanin_sagas (
    id                    uuid NOT NULL,
    app_name              text NOT NULL,
    key                   text,
    state                 text NOT NULL DEFAULT 'running',
    steps                 integer NOT NULL,
    current_step          integer NOT NULL DEFAULT 1,
    failed_step           integer,
    exc_type              text,
    exc_message           text,
    current_stage         integer NOT NULL DEFAULT 0,
    resumes               integer NOT NULL DEFAULT 0,
    failed_compensation   text,
    compensation_timeout  interval,
    compensation_redrives integer NOT NULL DEFAULT 3,
    created_at            timestamptz NOT NULL DEFAULT now(),
    state_at              timestamptz NOT NULL DEFAULT now(),
    finished_at           timestamptz,
    CONSTRAINT fanin_sagas_pkey PRIMARY KEY (id),
    CONSTRAINT fanin_sagas_steps_check CHECK (steps > 0),
    CONSTRAINT fanin_sagas_state_check CHECK (state IN ('running', 'compensating', 'succeeded', 'compensated',
                                                        'compensation_failed', 'manual_action_required'))
);
CREATE INDEX fanin_sagas_created ON fanin_sagas (created_at, id);
CREATE INDEX fanin_sagas_finished ON fanin_sagas (finished_at) WHERE state IN ('succeeded', 'compensated');
CREATE UNIQUE INDEX fanin_sagas_key ON fanin_sagas (app_name, key) WHERE key IS NOT NULL;
CREATE INDEX fanin_sagas_open ON fanin_sagas (state_at) WHERE state IN ('running', 'compensating');

-- A saga's steps, written once; `batch_id` is the step's batch (no foreign key: retention may prune it).
CREATE TABLE fanin_saga_steps (
    saga_id               uuid NOT NULL,
    position              integer NOT NULL,
    kind                  text NOT NULL,
    name                  text NOT NULL,
    manual_text           text,
    definition            bytea NOT NULL,
    content_type          text NOT NULL,
    content_encoding      text NOT NULL,
    undo_message          bytea,
    undo_content_type     text,
    undo_content_encoding text,
    state                 text NOT NULL DEFAULT 'pending',
    batch_id              uuid,
    exc_type              text,
    exc_message           text,
    started_at            timestamptz,
    finished_at           timestamptz,
    CONSTRAINT fanin_saga_steps_pkey PRIMARY KEY (saga_id, "position"),
    CONSTRAINT fanin_saga_steps_kind_check CHECK (kind IN ('task', 'group')),
    CONSTRAINT fanin_saga_steps_state_check CHECK (state IN ('pending', 'running', 'succeeded', 'failed', 'skipped',
        'nothing_to_undo', 'compensating', 'compensated', 'compensation_failed', 'manual_action_required',
        'acknowledged')),
    CONSTRAINT fanin_saga_steps_saga_id_fkey FOREIGN KEY (saga_id) REFERENCES fanin_sagas(id) ON DELETE CASCADE
);
CREATE INDEX fanin_saga_steps_batch ON fanin_saga_steps (batch_id) WHERE batch_id IS NOT NULL;

-- A saga's compensations, written once when a step fails for good, each under what it undoes (`undo_of`).
CREATE TABLE fanin_saga_compensations (
    saga_id          uuid NOT NULL,
    undo_of          text NOT NULL,
    position         integer NOT NULL,
    stage            integer NOT NULL,
    ordinal          integer NOT NULL,
    kind             text NOT NULL,
    unit             text,
    task_name        text,
    message          bytea,
    content_type     text,
    content_encoding text,
    manual_text      text,
    state            text NOT NULL DEFAULT 'pending',
    attempt          integer NOT NULL DEFAULT 1,
    task_id          text,
    batch_id         uuid,
    exc_type         text,
    exc_message      text,
    acked_at         timestamptz,
    acked_by         text,
    created_at       timestamptz NOT NULL DEFAULT now(),
    finished_at      timestamptz,
    CONSTRAINT fanin_saga_compensations_pkey PRIMARY KEY (saga_id, undo_of),
    CONSTRAINT fanin_saga_compensations_kind_check CHECK (kind IN ('child', 'step', 'manual')),
    CONSTRAINT fanin_saga_compensations_state_check CHECK (state IN ('pending', 'running', 'succeeded', 'failed',
        'manual_action_required', 'acknowledged')),
    CONSTRAINT fanin_saga_compensations_saga_id_fkey FOREIGN KEY (saga_id) REFERENCES fanin_sagas(id) ON DELETE CASCADE
);
CREATE INDEX fanin_saga_compensations_batch ON fanin_saga_compensations (batch_id) WHERE batch_id IS NOT NULL;
CREATE INDEX fanin_saga_compensations_stage ON fanin_saga_compensations (saga_id, stage);

-- Views

-- A batch as the operator commands and the dashboard show it (version 22): its counts in children with its
-- unfinished leaves' added (but for a `fail_up` leaf's failures, in its root's `failed` already), its current
-- successor's state, and a nested batch's outer child index. No aggregate outside the lateral join, so the
-- planner inlines it into each statement that reads it. It reads with its owner's rights: grants.sql grants it
-- only to the roles that may read the three tables.
CREATE VIEW fanin_nodes AS
SELECT b.id, b.step, b.state, b.planned,
       b.succeeded + coalesce(l.succeeded, 0) AS succeeded, b.failed + coalesce(l.failed, 0) AS failed,
       b.created_at, b.completed_at, b.deadline_at, b.successor_name, s.state AS successor_state, b.key,
       b.parent_id, b.parent_task_id, b.lineage, b.depth, b.round, b.retry_of, c.idx AS child_index, b.app_name
  FROM fanin_batches b
  LEFT JOIN LATERAL (
        SELECT sum(x.succeeded) AS succeeded, sum(x.failed) FILTER (WHERE NOT x.fail_up) AS failed
          FROM fanin_batches x
         WHERE x.parent_id = b.id AND x.state IN ('open', 'running')
  ) l ON true
  LEFT JOIN fanin_successors s ON s.batch_id = b.id AND s.step = b.step
  LEFT JOIN fanin_children c ON c.task_id = b.parent_task_id;

-- Functions

-- fanin_settle_v2(uuid,integer,integer,double precision)
CREATE FUNCTION fanin_settle_v2(p_batch uuid, p_succeeded integer, p_failed integer,
                                p_handoff double precision)
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
            RETURN QUERY SELECT b.remaining, fanin_fail_up_v2(b.parent_id, p_failed, p_handoff);
            RETURN;
        END IF;
        RETURN QUERY SELECT b.remaining, false;
        RETURN;
    END IF;
    -- This call finished the batch: a leaf hands its totals to its root; a root gets its one successor.
    IF b.parent_id IS NOT NULL THEN
        SELECT * INTO r FROM fanin_settle_v2(b.parent_id, b.succeeded,
                                             CASE WHEN b.fail_up THEN p_failed ELSE b.failed END,
                                             p_handoff);
        RETURN QUERY SELECT b.remaining, coalesce(r.successor_created, false);
        RETURN;
    END IF;
    RETURN QUERY SELECT b.remaining,
        fanin_create_successor_v2(b.id, b.step, b.successor_task_id,
                                  CASE WHEN b.state = 'failed_threshold' AND b.has_on_failure
                                       THEN 'on_failure' ELSE 'then' END, p_handoff);
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
    RETURN QUERY SELECT * FROM fanin_settle_v2(p_batch, 0, 0, NULL);
END
$$;

-- fanin_record_starts(text[],integer[],text[],timestamp with time zone[])
CREATE FUNCTION fanin_record_starts(p_task_ids text[], p_attempts integer[], p_workers text[],
                                    p_started_at timestamptz[])
RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    n integer;
BEGIN
    PERFORM set_config('synchronous_commit', 'off', true);
    -- Only an open child moves to `started`; a start written after the child's terminal report (a slow writer,
    -- a fast child) still counts the run and fills in when and where it started, and moves nothing else.
    UPDATE fanin_children c
       SET state = CASE WHEN c.state IN ('pending', 'started') THEN 'started' ELSE c.state END,
           started_at = CASE WHEN c.state IN ('pending', 'started') THEN s.started_at
                             ELSE coalesce(c.started_at, s.started_at) END,
           attempt = CASE WHEN c.state IN ('pending', 'started') THEN s.attempt ELSE greatest(c.attempt, s.attempt) END,
           worker = CASE WHEN c.state IN ('pending', 'started') THEN s.worker ELSE coalesce(c.worker, s.worker) END,
           starts = c.starts + 1
      FROM unnest(p_task_ids, p_attempts, p_workers, p_started_at) AS s(task_id, attempt, worker, started_at)
     WHERE c.task_id = s.task_id;
    GET DIAGNOSTICS n = ROW_COUNT;
    RETURN n;
END
$$;

-- fanin_record_terminal_v2(text,text,bytea,text,text,text,text,timestamp with time zone,integer,text)
CREATE FUNCTION fanin_record_terminal_v2(p_task_id text, p_state text, p_result bytea, p_rct text, p_rce text,
                                         p_exc_type text, p_exc_message text, p_started_at timestamptz,
                                         p_attempt integer, p_worker text)
RETURNS TABLE (counted boolean, late boolean, remaining integer, successor_created boolean)
LANGUAGE plpgsql AS $$
DECLARE
    c record;
BEGIN
    -- The child's own row is the claim (these columns never change), so the worker's statement decides.
    SELECT f.batch_id, f.idx, f.task_name INTO c FROM fanin_children f WHERE f.task_id = p_task_id;
    RETURN QUERY
    SELECT r.counted, r.late, r.remaining, r.successor_created
      FROM fanin_report_terminal_v2(p_task_id, c.batch_id, c.idx, c.task_name, p_state, p_result, p_rct,
                                    p_rce, p_exc_type, p_exc_message, p_started_at, p_attempt, p_worker,
                                    NULL) r;
END
$$;

-- The one place the relay is woken: a NOTIFY on its channel (protocol.OUTBOX_CHANNEL), delivered when the caller's
-- transaction commits. The payload says what became due (an outbox row's id, "batch:<id>" for a batch's children,
-- or nothing); the relay does not read it, it scans what is due (version 33).
-- fanin_notify_relay(text)
CREATE FUNCTION fanin_notify_relay(p_payload text)
RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('fanin_outbox', p_payload);
END
$$;

-- The batch's one successor and its outbox row, once per (batch, step). p_handoff says who publishes it: NULL, the
-- relay (woken by NOTIFY); a number, the worker whose report created it, after its commit (no NOTIFY: the relay's
-- scan is the fallback), and a completed batch's row is not due for the relay for that many seconds (version 32:
-- an argument, where it was a setting of the worker's session).
-- fanin_create_successor_v2(uuid,text,text,text,double precision)
CREATE FUNCTION fanin_create_successor_v2(p_batch uuid, p_step text, p_task_id text, p_kind text,
                                          p_handoff double precision)
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
    IF p_handoff > 0 AND p_kind = 'then'
       AND EXISTS (SELECT 1 FROM fanin_batches b WHERE b.id = p_batch AND b.state = 'complete') THEN
        -- Handed to the worker that reported: not due for the relay before the handoff has passed.
        INSERT INTO fanin_outbox (batch_id, step, available_at)
        VALUES (p_batch, p_step, now() + make_interval(secs => p_handoff)) RETURNING id INTO v_outbox;
    ELSE
        INSERT INTO fanin_outbox (batch_id, step) VALUES (p_batch, p_step) RETURNING id INTO v_outbox;
    END IF;
    -- The worker that reported publishes it after this commits: no need to wake the relay (its scan is the fallback).
    IF p_handoff IS NULL THEN
        PERFORM fanin_notify_relay(v_outbox::text);
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
    PERFORM fanin_notify_relay('');
    RETURN n;
END
$$;

-- A batch's successors handed to this session (unsent, not yet due for the relay), each with its batch's and
-- successor's columns, as one jsonb array. The worker's report statement calls it when its report created a
-- successor (VOLATILE: a new snapshot, so it sees what the report function inserted in the same statement).
CREATE FUNCTION fanin_handed_off(p_batch uuid)
RETURNS jsonb
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    RETURN (
        SELECT coalesce(jsonb_agg(to_jsonb(h) ORDER BY h.outbox_id), '[]'::jsonb)
          FROM (SELECT o.id AS outbox_id, o.batch_id AS outbox_batch_id, o.step AS outbox_step,
                       o.attempts AS outbox_attempts,
                       b.id, b.step, b.state, b.planned, b.remaining, b.succeeded, b.failed, b.published_upto,
                       b.successor_task_id, b.successor_name, b.successor_message, b.successor_content_type,
                       b.successor_content_encoding, b.created_at, b.completed_at, b.deadline_at, b.on_expire_message,
                       b.on_expire_content_type, b.on_expire_content_encoding, b.on_failure_message,
                       b.on_failure_content_type, b.on_failure_content_encoding,
                       extract(epoch FROM b.child_timeout) AS child_timeout_seconds, b.round, b.retry_of,
                       b.refused_reports,
                       s.task_id AS s_task_id, s.state AS s_state, s.runs AS s_runs, s.duplicates AS s_duplicates,
                       s.exc_type AS s_exc_type, s.exc_message AS s_exc_message, s.started_at AS s_started_at,
                       s.finished_at AS s_finished_at, s.kind AS s_kind
                  FROM fanin_outbox o
                  JOIN fanin_batches b ON b.id = o.batch_id
                  LEFT JOIN fanin_successors s ON s.batch_id = o.batch_id AND s.step = o.step
                 WHERE o.batch_id = p_batch AND o.sent_at IS NULL AND o.available_at > now()) h);
END
$$;

-- fanin_fail_up_v2(uuid,integer,double precision)
CREATE FUNCTION fanin_fail_up_v2(p_root uuid, p_failed integer, p_handoff double precision)
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
    RETURN fanin_create_successor_v2(b.id, b.step, b.successor_task_id,
                                     CASE WHEN b.has_on_failure THEN 'on_failure' ELSE 'then' END,
                                     p_handoff);
END
$$;

-- A worker's terminal report; p_handoff: see fanin_create_successor_v2 (NULL from every caller but a worker's
-- report statement).
-- fanin_report_terminal_v2(text,uuid,integer,text,text,bytea,text,text,text,text,timestamp with time zone,integer,text,double precision)
CREATE FUNCTION fanin_report_terminal_v2(p_task_id text, p_batch uuid, p_index integer, p_task_name text,
                                         p_state text, p_result bytea, p_rct text, p_rce text,
                                         p_exc_type text, p_exc_message text, p_started_at timestamptz,
                                         p_attempt integer, p_worker text, p_handoff double precision)
RETURNS TABLE (counted boolean, late boolean, remaining integer, successor_created boolean, refused boolean)
LANGUAGE plpgsql AS $$
DECLARE
    v_batch uuid;
    v_ok boolean := p_state = 'succeeded';
    v_start integer := CASE WHEN p_started_at IS NULL THEN 0 ELSE 1 END;
    r record;
BEGIN
    -- The conditional transition, now also on the message's batch, index and task name (same primary-key row).
    -- A tree's children are rows of its leaves while their messages name the root (and the index in the whole
    -- batch): a leaf of the named batch matches too; its row is read only when the child's batch is not the one
    -- named, so a flat batch's report reads nothing more.
    UPDATE fanin_children
       SET state = p_state, finished_at = now(), result = p_result, result_content_type = p_rct,
           result_content_encoding = p_rce, exc_type = p_exc_type, exc_message = p_exc_message,
           started_at = coalesce(p_started_at, started_at), starts = starts + v_start,
           attempt = coalesce(p_attempt, attempt), worker = coalesce(p_worker, worker)
     WHERE task_id = p_task_id AND state IN ('pending', 'started')
       AND (batch_id = p_batch OR EXISTS (SELECT 1 FROM fanin_batches l WHERE l.id = fanin_children.batch_id AND l.parent_id = p_batch))
       AND idx = p_index AND (p_task_name IS NULL OR task_name = p_task_name)
    RETURNING batch_id INTO v_batch;
    IF FOUND THEN
        SELECT * INTO r FROM fanin_settle_v2(v_batch, CASE WHEN v_ok THEN 1 ELSE 0 END,
                                             CASE WHEN v_ok THEN 0 ELSE 1 END, p_handoff);
        RETURN QUERY SELECT true, false, r.remaining, r.successor_created, false;
        RETURN;
    END IF;
    -- Already counted: record the report as late (a new statement sees a racing report's committed row).
    UPDATE fanin_children
       SET late_state = p_state, late_at = now(), late_reports = late_reports + 1, starts = starts + v_start
     WHERE task_id = p_task_id AND state NOT IN ('pending', 'started')
       AND (batch_id = p_batch OR EXISTS (SELECT 1 FROM fanin_batches l WHERE l.id = fanin_children.batch_id AND l.parent_id = p_batch))
       AND idx = p_index AND (p_task_name IS NULL OR task_name = p_task_name);
    IF FOUND THEN
        RETURN QUERY SELECT false, true, NULL::integer, false, false;
        RETURN;
    END IF;
    -- A child with this task id whose batch, index or task name differ from the message's: refused, and counted
    -- on the child's own batch (a tree's root, for a leaf's child). No such child at all: unknown, as before.
    UPDATE fanin_batches
       SET refused_reports = refused_reports + 1
     WHERE id = (SELECT coalesce(b.parent_id, b.id) FROM fanin_children c JOIN fanin_batches b ON b.id = c.batch_id
                  WHERE c.task_id = p_task_id);
    RETURN QUERY SELECT false, false, NULL::integer, false, FOUND;
END
$$;

-- The entry point of the workers of version 31 and before, kept so that a worker not yet restarted after this
-- migration goes on reporting: such a worker said once per session that it publishes the successors its reports
-- create (the two settings read here, which nothing else reads any more). A later migration drops it.
-- fanin_report_terminal(text,uuid,integer,text,text,bytea,text,text,text,text,timestamp with time zone,integer,text)
CREATE FUNCTION fanin_report_terminal(p_task_id text, p_batch uuid, p_index integer, p_task_name text,
                                      p_state text, p_result bytea, p_rct text, p_rce text, p_exc_type text,
                                      p_exc_message text, p_started_at timestamptz, p_attempt integer,
                                      p_worker text)
RETURNS TABLE (counted boolean, late boolean, remaining integer, successor_created boolean, refused boolean)
LANGUAGE plpgsql AS $$
BEGIN
    RETURN QUERY SELECT * FROM fanin_report_terminal_v2(
        p_task_id, p_batch, p_index, p_task_name, p_state, p_result, p_rct, p_rce, p_exc_type, p_exc_message,
        p_started_at, p_attempt, p_worker,
        CASE WHEN coalesce(current_setting('fanin.successor_publisher', true), '') = 'worker'
             THEN coalesce(nullif(current_setting('fanin.successor_handoff', true), ''), '0')::double precision END);
END
$$;

-- fanin_report_unrun_v2(text,uuid,integer,text,text,text,text,double precision)
CREATE FUNCTION fanin_report_unrun_v2(p_task_id text, p_batch uuid, p_index integer, p_task_name text,
                                      p_state text, p_exc_type text, p_exc_message text,
                                      p_handoff double precision)
RETURNS TABLE (counted boolean, late boolean, remaining integer, successor_created boolean, refused boolean)
LANGUAGE plpgsql AS $$
DECLARE
    v_state text;
BEGIN
    -- A copy that never ran ends its child only while no copy has started it: a started child is the running
    -- copy's to report. The row lock keeps a start from landing between this check and the report.
    SELECT c.state INTO v_state FROM fanin_children c
     WHERE c.task_id = p_task_id
       AND (c.batch_id = p_batch OR EXISTS (SELECT 1 FROM fanin_batches l WHERE l.id = c.batch_id AND l.parent_id = p_batch))
       AND c.idx = p_index AND (p_task_name IS NULL OR c.task_name = p_task_name)
       FOR UPDATE OF c;
    IF v_state = 'started' THEN
        UPDATE fanin_children SET duplicates = duplicates + 1 WHERE task_id = p_task_id;
        RETURN QUERY SELECT false, false, NULL::integer, false, false;
        RETURN;
    END IF;
    RETURN QUERY SELECT * FROM fanin_report_terminal_v2(p_task_id, p_batch, p_index, p_task_name, p_state,
                                                        NULL, NULL, NULL, p_exc_type, p_exc_message, NULL,
                                                        NULL, NULL, p_handoff);
END
$$;

-- The same for a worker of version 31 and before (see fanin_report_terminal).
-- fanin_report_unrun(text,uuid,integer,text,text,text,text)
CREATE FUNCTION fanin_report_unrun(p_task_id text, p_batch uuid, p_index integer, p_task_name text, p_state text,
                                   p_exc_type text, p_exc_message text)
RETURNS TABLE (counted boolean, late boolean, remaining integer, successor_created boolean, refused boolean)
LANGUAGE plpgsql AS $$
BEGIN
    RETURN QUERY SELECT * FROM fanin_report_unrun_v2(
        p_task_id, p_batch, p_index, p_task_name, p_state, p_exc_type, p_exc_message,
        CASE WHEN coalesce(current_setting('fanin.successor_publisher', true), '') = 'worker'
             THEN coalesce(nullif(current_setting('fanin.successor_handoff', true), ''), '0')::double precision END);
END
$$;

CREATE FUNCTION fanin_ensure_successor(p_batch uuid, p_kind text)
RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    b record;
BEGIN
    SELECT x.id, x.step, x.successor_task_id INTO b FROM fanin_batches x
     WHERE x.id = p_batch AND x.parent_id IS NULL
       AND ((p_kind = 'then' AND x.state IN ('complete', 'partial', 'failed_threshold'))
            OR (p_kind = 'on_failure' AND x.state = 'failed_threshold' AND x.on_failure_message IS NOT NULL)
            OR (p_kind = 'on_expire' AND x.state IN ('expired', 'cancelled') AND x.on_expire_message IS NOT NULL));
    IF NOT FOUND OR NOT fanin_create_successor_v2(b.id, b.step, b.successor_task_id, p_kind, NULL) THEN
        RETURN NULL;
    END IF;
    RETURN (SELECT o.id FROM fanin_outbox o WHERE o.batch_id = b.id AND o.step = b.step);
END
$$;

CREATE FUNCTION fanin_add_children(p_root uuid, p_leaves uuid[], p_counts integer[], p_total integer,
                                   p_direct integer, p_digest bytea)
RETURNS boolean
LANGUAGE plpgsql AS $$
BEGIN
    IF p_total < 0 OR p_direct < 0 OR EXISTS (SELECT 1 FROM unnest(p_counts) n WHERE n IS NULL OR n < 0) THEN
        RAISE EXCEPTION 'fanin_add_children: counts must not be negative' USING ERRCODE = '22023';
    END IF;
    IF cardinality(p_leaves) > 0 THEN
        PERFORM 1 FROM fanin_batches WHERE id = ANY(p_leaves) AND parent_id = p_root ORDER BY id FOR UPDATE;
        UPDATE fanin_batches b SET planned = b.planned + p.n, remaining = b.remaining + p.n
          FROM unnest(p_leaves, p_counts) AS p(id, n)
         WHERE b.id = p.id AND b.parent_id = p_root;
    END IF;
    UPDATE fanin_batches
       SET planned = planned + p_total, remaining = remaining + p_direct, digest = p_digest, producer_seen_at = now()
     WHERE id = p_root AND state = 'open';
    RETURN FOUND;
END
$$;

CREATE FUNCTION fanin_mark_published(p_batch uuid, p_upto integer)
RETURNS void
LANGUAGE sql AS $$
    UPDATE fanin_batches SET published_upto = coalesce(p_upto, planned)
     WHERE id = p_batch AND published_upto < coalesce(p_upto, planned)
$$;

CREATE FUNCTION fanin_expire_batch(p_batch uuid, p_reason text, p_proceed boolean)
RETURNS TABLE (on_deadline text, abandoned text[], successor_created boolean, state text)
LANGUAGE plpgsql AS $$
DECLARE
    h record;
    v_proceed boolean;
    v_exc_type text;
    v_exc_message text;
    v_abandoned text[];
    v_state text;
    v_created boolean := false;
BEGIN
    IF p_reason = 'deadline' THEN
        v_exc_type := 'DeadlineExceeded';
        v_exc_message := 'the batch deadline passed before this child finished';
    ELSIF p_reason = 'cancel' THEN
        v_exc_type := 'Cancelled';
        v_exc_message := 'the batch was cancelled before this child finished';
    ELSE
        RAISE EXCEPTION 'fanin_expire_batch: unknown reason %', p_reason USING ERRCODE = '22023';
    END IF;
    SELECT t.on_deadline, t.on_expire_message IS NOT NULL AS has_on_expire, t.parent_task_id INTO h
      FROM fanin_batches t
     WHERE t.id = p_batch AND t.state IN ('open', 'running') AND t.parent_id IS NULL
       AND (p_reason = 'cancel' OR t.deadline_at <= now());
    IF NOT FOUND THEN
        RETURN;
    END IF;
    v_proceed := coalesce(p_proceed, p_reason = 'deadline' AND h.on_deadline = 'proceed');
    -- The children are abandoned before the root is locked (the order every report takes), so a report that held
    -- one of them may have finished the batch meanwhile (its last child, or past its threshold): then the batch is
    -- no longer this call's to end, and the children abandoned go back as they were (the block's subtransaction).
    BEGIN
        WITH a AS (
            UPDATE fanin_children c
               SET state = 'abandoned', finished_at = now(), exc_type = v_exc_type, exc_message = v_exc_message
             WHERE c.batch_id IN (SELECT t.id FROM fanin_batches t WHERE t.id = p_batch OR t.parent_id = p_batch)
               AND c.state IN ('pending', 'started')
         RETURNING c.task_id
        )
        SELECT coalesce(array_agg(a.task_id), '{}') INTO v_abandoned FROM a;
        PERFORM 1 FROM fanin_batches t WHERE t.parent_id = p_batch ORDER BY t.id FOR UPDATE;
        PERFORM 1 FROM fanin_batches t WHERE t.id = p_batch AND t.state IN ('open', 'running') FOR UPDATE;
        IF NOT FOUND THEN
            RAISE EXCEPTION 'batch % finished meanwhile', p_batch USING ERRCODE = 'FNI01';
        END IF;
    EXCEPTION WHEN SQLSTATE 'FNI01' THEN
        RETURN;
    END;
    v_state := CASE WHEN v_proceed THEN 'partial' WHEN p_reason = 'cancel' THEN 'cancelled' ELSE 'expired' END;
    WITH totals AS (
        SELECT count(*) FILTER (WHERE c.state = 'succeeded') AS s,
               count(*) FILTER (WHERE c.state NOT IN ('pending', 'started', 'succeeded')) AS f
          FROM fanin_children c
         WHERE c.batch_id IN (SELECT t.id FROM fanin_batches t WHERE t.id = p_batch OR t.parent_id = p_batch)
    ), leaves AS (
        -- Each leaf counts its own children too, the abandoned ones included: a leaf's counters always agree
        -- with its child rows (status, reconciliation and the root's sums read them).
        UPDATE fanin_batches l
           SET state = v_state, remaining = 0, completed_at = now(),
               succeeded = (SELECT count(*) FROM fanin_children c WHERE c.batch_id = l.id AND c.state = 'succeeded'),
               failed = (SELECT count(*) FROM fanin_children c
                          WHERE c.batch_id = l.id AND c.state NOT IN ('pending', 'started', 'succeeded'))
         WHERE l.parent_id = p_batch AND l.state IN ('open', 'running')
    )
    UPDATE fanin_batches b
       SET state = v_state, remaining = 0, succeeded = totals.s, failed = totals.f, completed_at = now()
      FROM totals
     WHERE b.id = p_batch;
    IF v_proceed THEN
        v_created := fanin_ensure_successor(p_batch, 'then') IS NOT NULL;
    ELSIF h.has_on_expire THEN
        v_created := fanin_ensure_successor(p_batch, 'on_expire') IS NOT NULL;
    ELSIF h.parent_task_id IS NOT NULL THEN
        -- A nested batch abandoned with nothing to run: the outer child it stands for fails now.
        PERFORM fanin_record_terminal_v2(h.parent_task_id, 'failed', NULL, NULL, NULL, v_exc_type,
                                         format('nested batch %s was %s', p_batch,
                                                CASE WHEN p_reason = 'cancel' THEN 'cancelled'
                                                     ELSE 'abandoned at its deadline' END),
                                         NULL, NULL, NULL);
    END IF;
    RETURN QUERY SELECT CASE WHEN v_proceed THEN 'proceed' ELSE 'abandon' END, v_abandoned, v_created, v_state;
END
$$;

CREATE FUNCTION fanin_cancel_open(p_batch uuid)
RETURNS TABLE (on_deadline text, abandoned text[], successor_created boolean, state text)
LANGUAGE plpgsql AS $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM fanin_batches t WHERE t.id = p_batch AND t.state = 'open' AND t.parent_id IS NULL)
    THEN
        RETURN;
    END IF;
    RETURN QUERY SELECT * FROM fanin_expire_batch(p_batch, 'cancel', false);
END
$$;

CREATE FUNCTION fanin_reconcile_batch(p_batch uuid, OUT problems text[], OUT actions text[])
LANGUAGE plpgsql AS $$
DECLARE
    b record;
    c record;
    v_token integer;
    v_finish boolean;
    v_state text;
    v_kind text;
BEGIN
    SELECT t.id, t.step, t.state, t.planned, t.remaining, t.succeeded, t.failed, t.parent_id,
           t.on_failure_message IS NOT NULL AS has_on_failure
      INTO b FROM fanin_batches t WHERE t.id = p_batch FOR UPDATE;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    problems := '{}';
    actions := '{}';
    WITH direct AS (
        SELECT count(*) AS created,
               count(*) FILTER (WHERE x.state IN ('pending', 'started')) AS open,
               count(*) FILTER (WHERE x.state = 'succeeded') AS succeeded,
               count(*) FILTER (WHERE x.state NOT IN ('pending', 'started', 'succeeded')) AS failed
          FROM fanin_children x WHERE x.batch_id = p_batch
    ), leaves AS (
        -- a `fail_up` leaf has handed its failures to the root as they were counted, finished or not
        SELECT coalesce(sum(l.planned), 0) AS created,
               count(*) FILTER (WHERE l.state IN ('open', 'running')) AS open,
               coalesce(sum(l.succeeded) FILTER (WHERE l.state NOT IN ('open', 'running')), 0) AS succeeded,
               coalesce(sum(l.failed) FILTER (WHERE l.state NOT IN ('open', 'running') OR l.fail_up), 0) AS failed
          FROM fanin_batches l WHERE l.parent_id = p_batch
    )
    SELECT direct.created + leaves.created AS created, direct.open + leaves.open AS open,
           direct.succeeded + leaves.succeeded AS succeeded, direct.failed + leaves.failed AS failed
      INTO c FROM direct, leaves;
    IF c.created <> b.planned THEN
        problems := problems || format('planned %s children but %s rows exist', b.planned, c.created);
    END IF;
    -- An open batch (or leaf) holds its producer's token and never finishes here.
    v_token := CASE WHEN b.state = 'open' THEN 1 ELSE 0 END;
    IF b.state IN ('open', 'running') AND c.created = b.planned THEN
        IF (b.remaining, b.succeeded, b.failed) <> (c.open + v_token, c.succeeded, c.failed) THEN
            problems := problems || format(
                'counter says remaining=%s succeeded=%s failed=%s, children say remaining=%s succeeded=%s failed=%s',
                b.remaining, b.succeeded, b.failed, c.open + v_token, c.succeeded, c.failed);
            actions := actions || 'counters recomputed from child rows'::text;
        END IF;
        v_finish := c.open = 0 AND v_token = 0;
        IF v_finish THEN
            IF cardinality(problems) = 0 THEN
                problems := problems || 'all children are terminal but the batch was still running'::text;
            END IF;
            actions := actions || 'batch finished'::text;
        END IF;
        IF cardinality(problems) > 0 THEN
            -- Leave one unit for fanin_settle_v2 to take, so that finishing goes the way a last report's would.
            UPDATE fanin_batches t
               SET remaining = c.open + v_token + CASE WHEN v_finish THEN 1 ELSE 0 END,
                   succeeded = c.succeeded, failed = c.failed
             WHERE t.id = p_batch;
            IF v_finish THEN
                PERFORM fanin_settle_v2(p_batch, 0, 0, NULL);
            END IF;
        END IF;
    END IF;
    SELECT t.state INTO v_state FROM fanin_batches t WHERE t.id = p_batch;
    IF b.parent_id IS NULL AND v_state IN ('complete', 'partial', 'failed_threshold') THEN
        v_kind := CASE WHEN v_state = 'failed_threshold' AND b.has_on_failure THEN 'on_failure' ELSE 'then' END;
        IF fanin_ensure_successor(p_batch, v_kind) IS NOT NULL THEN
            IF NOT EXISTS (SELECT 1 FROM unnest(actions) a WHERE a LIKE '%successor%') THEN
                problems := problems || format('batch is %s but had no successor', v_state);
            END IF;
            actions := actions || 'successor and outbox row inserted'::text;
        ELSE
            INSERT INTO fanin_outbox (batch_id, step)
            SELECT s.batch_id, s.step FROM fanin_successors s
             WHERE s.batch_id = p_batch AND s.step = b.step AND s.state = 'pending'
               AND NOT EXISTS (SELECT 1 FROM fanin_outbox o WHERE o.batch_id = s.batch_id AND o.step = s.step)
            ON CONFLICT (batch_id, step) DO NOTHING;
            IF FOUND THEN
                problems := problems || 'successor had no outbox row'::text;
                actions := actions || 'outbox row inserted'::text;
            END IF;
        END IF;
    END IF;
END
$$;

CREATE FUNCTION fanin_abandon_after_threshold(p_batch uuid)
RETURNS text[]
LANGUAGE plpgsql AS $$
DECLARE
    v_abandoned text[];
    v_remaining integer;
BEGIN
    WITH a AS (
        UPDATE fanin_children c
           SET state = 'abandoned', finished_at = now(), exc_type = 'FailureThresholdPassed',
               exc_message = 'the batch passed max_failures before this child finished'
         WHERE c.batch_id IN (SELECT t.id FROM fanin_batches t WHERE t.id = p_batch OR t.parent_id = p_batch)
           AND c.state IN ('pending', 'started')
           AND EXISTS (SELECT 1 FROM fanin_batches r WHERE r.id = p_batch AND r.state = 'failed_threshold')
     RETURNING c.task_id
    )
    SELECT coalesce(array_agg(a.task_id), '{}') INTO v_abandoned FROM a;
    PERFORM 1 FROM fanin_batches t WHERE t.parent_id = p_batch ORDER BY t.id FOR UPDATE;
    SELECT t.remaining INTO v_remaining FROM fanin_batches t
     WHERE t.id = p_batch AND t.state = 'failed_threshold' FOR UPDATE;
    IF NOT FOUND OR (v_remaining = 0 AND cardinality(v_abandoned) = 0) THEN
        RETURN v_abandoned;
    END IF;
    WITH leaves AS (
        UPDATE fanin_batches l
           SET state = 'failed_threshold', remaining = 0, completed_at = now(),
               succeeded = (SELECT count(*) FROM fanin_children c WHERE c.batch_id = l.id AND c.state = 'succeeded'),
               failed = (SELECT count(*) FROM fanin_children c
                          WHERE c.batch_id = l.id AND c.state NOT IN ('pending', 'started', 'succeeded'))
         WHERE l.parent_id = p_batch AND l.state IN ('open', 'running')
    ), totals AS (
        SELECT count(*) FILTER (WHERE c.state = 'succeeded') AS s,
               count(*) FILTER (WHERE c.state NOT IN ('pending', 'started', 'succeeded')) AS f
          FROM fanin_children c
         WHERE c.batch_id IN (SELECT t.id FROM fanin_batches t WHERE t.id = p_batch OR t.parent_id = p_batch)
    )
    UPDATE fanin_batches b SET remaining = 0, succeeded = totals.s, failed = totals.f
      FROM totals
     WHERE b.id = p_batch;
    RETURN v_abandoned;
END
$$;

CREATE FUNCTION fanin_claim_redrive(p_task_id text, p_seen integer)
RETURNS boolean
LANGUAGE plpgsql AS $$
BEGIN
    UPDATE fanin_children c
       SET state = 'pending', started_at = NULL, redriven_at = now(), redrives = c.redrives + 1
      FROM fanin_batches b
     WHERE c.task_id = p_task_id AND c.state IN ('pending', 'started') AND c.redrives = p_seen
       AND b.id = c.batch_id AND b.state IN ('open', 'running') AND b.on_lost = 'redrive'
       AND c.redrives < b.max_redrives AND b.child_timeout IS NOT NULL
       AND greatest(b.created_at, c.started_at, c.redriven_at, c.eta_at) + b.child_timeout < now();
    RETURN FOUND;
END
$$;

CREATE FUNCTION fanin_fail_lost(p_task_id text)
RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    c record;
    r record;
BEGIN
    SELECT x.redrives, b.child_timeout::text AS timeout INTO c
      FROM fanin_children x JOIN fanin_batches b ON b.id = x.batch_id
     WHERE x.task_id = p_task_id AND x.state IN ('pending', 'started')
       AND b.state IN ('open', 'running') AND b.child_timeout IS NOT NULL
       AND (b.on_lost = 'fail' OR x.redrives >= b.max_redrives)
       AND greatest(b.created_at, x.started_at, x.redriven_at, x.eta_at) + b.child_timeout < now()
       AND NOT EXISTS (SELECT 1 FROM fanin_batches n
                        WHERE n.parent_task_id = x.task_id AND n.state IN ('open', 'running'))
       FOR UPDATE OF x;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    SELECT * INTO r FROM fanin_record_terminal_v2(
        p_task_id, 'lost', NULL, NULL, NULL, 'ChildLost',
        format('no terminal outcome within child_timeout (%s); redrives: %s', c.timeout, c.redrives), NULL, NULL, NULL);
    RETURN r.counted;
END
$$;

-- fanin_revoke_expired(text,double precision)
CREATE FUNCTION fanin_revoke_expired(p_task_id text, p_grace double precision)
RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    r record;
BEGIN
    PERFORM 1 FROM fanin_children
     WHERE task_id = p_task_id AND state = 'pending'
       AND expires_at + make_interval(secs => greatest(p_grace, 0)) < now()
       FOR UPDATE;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    SELECT * INTO r FROM fanin_record_terminal_v2(p_task_id, 'revoked', NULL, NULL, NULL, '_Revoked', 'expired',
                                                  NULL, NULL, NULL);
    RETURN r.counted;
END
$$;

CREATE FUNCTION fanin_renew_open_batches()
RETURNS void
LANGUAGE sql AS $$
    UPDATE fanin_batches b SET producer_seen_at = now()
     WHERE b.state = 'open' AND b.parent_id IS NULL
       AND EXISTS (
           SELECT 1 FROM pg_locks l
            WHERE l.granted AND l.locktype = 'advisory' AND l.objsubid = 2
              AND l.classid = CAST(CAST(CAST('x' || substr(replace(b.id::text, '-', ''), 1, 8) AS bit(32))
                                        AS integer) AS oid)
              AND l.objid = CAST(CAST(CAST('x' || substr(replace(b.id::text, '-', ''), 9, 8) AS bit(32))
                                      AS integer) AS oid)
              AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()))
$$;

-- fanin_seal_open(uuid,double precision)
CREATE FUNCTION fanin_seal_open(p_batch uuid, p_grace double precision)
RETURNS TABLE (planned integer, successor_created boolean)
LANGUAGE plpgsql AS $$
DECLARE
    v_leaves uuid[];
    v_planned integer;
    v_leaf uuid;
    r record;
BEGIN
    SELECT coalesce(array_agg(x.id), '{}') INTO v_leaves FROM (
        SELECT t.id FROM fanin_batches t WHERE t.parent_id = p_batch AND t.state = 'open' ORDER BY t.id FOR UPDATE
    ) x;
    SELECT t.planned INTO v_planned FROM fanin_batches t
     WHERE t.id = p_batch AND t.state = 'open' AND t.parent_id IS NULL
       AND (p_grace IS NULL OR t.producer_seen_at < now() - make_interval(secs => p_grace))
       FOR UPDATE;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    FOREACH v_leaf IN ARRAY v_leaves LOOP
        PERFORM fanin_seal(v_leaf);
    END LOOP;
    SELECT * INTO r FROM fanin_seal(p_batch);
    RETURN QUERY SELECT v_planned, coalesce(r.successor_created, false);
END
$$;

CREATE FUNCTION fanin_claim_outbox(p_limit integer, p_ids bigint[])
RETURNS TABLE (
    outbox_id bigint, outbox_batch_id uuid, outbox_step text, outbox_attempts integer,
    id uuid, step text, state text, planned integer, remaining integer, succeeded integer, failed integer,
    published_upto integer, successor_task_id text, successor_name text, successor_message bytea,
    successor_content_type text, successor_content_encoding text, created_at timestamptz,
    completed_at timestamptz, deadline_at timestamptz, on_expire_message bytea, on_expire_content_type text,
    on_expire_content_encoding text, on_failure_message bytea, on_failure_content_type text,
    on_failure_content_encoding text, child_timeout_seconds numeric, round integer, retry_of uuid,
    refused_reports integer,
    s_task_id text, s_state text, s_runs integer, s_duplicates integer, s_exc_type text, s_exc_message text,
    s_started_at timestamptz, s_finished_at timestamptz, s_kind text
)
LANGUAGE plpgsql AS $$
BEGIN
    RETURN QUERY
    SELECT o.id, o.batch_id, o.step, o.attempts,
           b.id, b.step, b.state, b.planned, b.remaining, b.succeeded, b.failed, b.published_upto,
           b.successor_task_id, b.successor_name, b.successor_message, b.successor_content_type,
           b.successor_content_encoding, b.created_at, b.completed_at, b.deadline_at, b.on_expire_message,
           b.on_expire_content_type, b.on_expire_content_encoding, b.on_failure_message, b.on_failure_content_type,
           b.on_failure_content_encoding, extract(epoch FROM b.child_timeout), b.round, b.retry_of,
           b.refused_reports,
           s.task_id, s.state, s.runs, s.duplicates, s.exc_type, s.exc_message, s.started_at, s.finished_at, s.kind
      FROM fanin_outbox o
      LEFT JOIN fanin_batches b ON b.id = o.batch_id
      LEFT JOIN fanin_successors s ON s.batch_id = o.batch_id AND s.step = o.step
     WHERE o.sent_at IS NULL AND o.available_at <= now()
       AND (p_ids IS NULL OR o.id = ANY(p_ids))
     ORDER BY o.available_at, o.id
     LIMIT p_limit
       FOR UPDATE OF o SKIP LOCKED;
END
$$;

CREATE FUNCTION fanin_outbox_sent(p_ids bigint[])
RETURNS void
LANGUAGE sql AS $$
    WITH sent AS (
        UPDATE fanin_outbox SET sent_at = now(), attempts = attempts + 1
         WHERE id = ANY(p_ids)
     RETURNING batch_id, step
    )
    UPDATE fanin_successors s SET state = 'sent', state_at = now()
      FROM sent
     WHERE s.batch_id = sent.batch_id AND s.step = sent.step AND s.state = 'pending'
$$;

-- fanin_outbox_failed(bigint,text,double precision)
CREATE FUNCTION fanin_outbox_failed(p_id bigint, p_error text, p_delay double precision)
RETURNS void
LANGUAGE sql AS $$
    UPDATE fanin_outbox
       SET attempts = attempts + 1, last_error = left(p_error, 2000),
           available_at = now() + make_interval(secs => greatest(p_delay, 0))
     WHERE id = p_id AND sent_at IS NULL
$$;

-- Predicates (version 34): each says once what the functions and the relay's queries ask of a successor row. Plain
-- SQL of their arguments alone, reading no table, so that the planner inlines them (the same plan as the expression
-- written out; tests/store/test_predicates.py checks it); they are therefore not definer functions (a pinned
-- search path or definer rights would stop the inlining: the block at the end leaves them out) and PUBLIC may call
-- them. Their bodies are SQL-standard (RETURN), bound when created: a caller's search path cannot change them.

-- A successor's final states: nothing moves it afterwards but an operator's rerun.
-- fanin_successor_final(text)
CREATE FUNCTION fanin_successor_final(p_state text)
RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE
RETURN p_state IN ('succeeded', 'failed', 'revoked', 'ignored');

-- Published or handed over (a retry, a requeue, a replacement) and held by no run: a delivery may be admitted.
-- fanin_successor_handed_over(text)
CREATE FUNCTION fanin_successor_handed_over(p_state text)
RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE
RETURN p_state IN ('sent', 'retrying', 'requeued', 'replaced');

-- Its run's lease (with none, its last move) ended over p_seconds ago: a running successor's run is dead, a handed
-- over one was never taken up.
-- fanin_successor_lapsed(timestamp with time zone,timestamp with time zone,double precision)
CREATE FUNCTION fanin_successor_lapsed(p_lease_until timestamptz, p_state_at timestamptz, p_seconds double precision)
RETURNS boolean
LANGUAGE sql STABLE PARALLEL SAFE
RETURN coalesce(p_lease_until, p_state_at) < now() - make_interval(secs => greatest(p_seconds, 0));

-- Stalled, for the relay to publish again: handed over and not taken up p_timeout seconds after, or running with
-- a run dead for p_grace seconds. Never a replaced one's carrier's: Celery, not the relay, publishes that.
-- fanin_successor_stalled(text,text,timestamp with time zone,timestamp with time zone,double precision,double precision)
CREATE FUNCTION fanin_successor_stalled(p_state text, p_carrier text, p_lease_until timestamptz,
                                        p_state_at timestamptz, p_timeout double precision, p_grace double precision)
RETURNS boolean
LANGUAGE sql STABLE PARALLEL SAFE
RETURN p_carrier IS NULL
       AND ((fanin_successor_handed_over(p_state) AND fanin_successor_lapsed(p_lease_until, p_state_at, p_timeout))
            OR (p_state = 'running' AND fanin_successor_lapsed(p_lease_until, p_state_at, p_grace)));

-- fanin_republish_successor(uuid,text,double precision,double precision)
CREATE FUNCTION fanin_republish_successor(p_batch uuid, p_step text, p_timeout double precision,
                                          p_grace double precision)
RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    v_outbox bigint;
BEGIN
    WITH s AS (
        UPDATE fanin_successors s
           SET state = CASE WHEN s.state = 'running' THEN 'sent' ELSE s.state END,
               lease_until = NULL, state_at = now()
         WHERE s.batch_id = p_batch AND s.step = p_step
           AND fanin_successor_stalled(s.state, s.carrier, s.lease_until, s.state_at, p_timeout, p_grace)
     RETURNING s.batch_id, s.step
    )
    UPDATE fanin_outbox o SET sent_at = NULL, available_at = now(), last_error = 'republished: stalled'
      FROM s WHERE o.batch_id = s.batch_id AND o.step = s.step
 RETURNING o.id INTO v_outbox;
    IF v_outbox IS NULL THEN
        RETURN false;
    END IF;
    PERFORM fanin_notify_relay(v_outbox::text);
    RETURN true;
END
$$;

-- fanin_fail_lost_replacement(uuid,text,double precision,text)
CREATE FUNCTION fanin_fail_lost_replacement(p_batch uuid, p_step text, p_timeout double precision, p_message text)
RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    v_parent_task_id text;
BEGIN
    -- A live carrier run renews its lease, so only a carrier that never came or whose run died (its lease lapsed)
    -- is past the bound; the row's lock orders this against the carrier's own admission and end.
    UPDATE fanin_successors s
       SET state = 'failed', exc_type = 'ReplacementLost', exc_message = left(p_message, 2000), state_at = now(),
           finished_at = now(), lease_until = NULL
      FROM fanin_batches b
     WHERE s.batch_id = p_batch AND s.step = p_step AND b.id = s.batch_id
       AND s.carrier IS NOT NULL AND s.state IN ('replaced', 'running')
       AND fanin_successor_lapsed(s.lease_until, s.state_at, p_timeout)
 RETURNING b.parent_task_id INTO v_parent_task_id;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    IF v_parent_task_id IS NOT NULL THEN
        PERFORM fanin_record_terminal_v2(v_parent_task_id, 'failed', NULL, NULL, NULL, 'ReplacementLost',
                                         left(p_message, 2000), NULL, NULL, NULL);
    END IF;
    RETURN true;
END
$$;

-- fanin_claim_run_v2(uuid,text,text,integer,double precision,double precision,text,text,text,text)
CREATE FUNCTION fanin_claim_run_v2(p_batch uuid, p_step text, p_task_id text, p_retries integer,
                                   p_lease double precision, p_grace double precision, p_owner text,
                                   p_owner_key text, p_carrier text, p_dead_owner text)
RETURNS TABLE (run integer, attempt integer, state text, run_owner text)
LANGUAGE plpgsql AS $$
DECLARE
    v_run integer;
    v_attempt integer;
    v_key text := encode(sha256(convert_to(coalesce(p_owner_key, ''), 'UTF8')), 'hex');
BEGIN
    -- Admitted: a successor no run holds, or whose run is dead: its lease lapsed over p_grace seconds ago, or the
    -- caller holds the key of the worker whose run it was and saw that run's process gone. Once replaced, only the
    -- replacement's carrier is admitted, never a copy of the message it replaced.
    UPDATE fanin_successors s
       SET state = 'running', runs = s.runs + 1, attempt = greatest(s.attempt, p_retries),
           lease_until = now() + make_interval(secs => p_lease),
           run_owner = p_owner, run_owner_key = v_key, started_at = coalesce(s.started_at, now()),
           state_at = now()
     WHERE s.batch_id = p_batch AND s.step = p_step AND s.task_id = p_task_id
       AND (s.carrier IS NULL OR s.carrier = p_carrier)
       AND ((s.state = 'pending' OR fanin_successor_handed_over(s.state))
            OR (s.state = 'running'
                AND (fanin_successor_lapsed(s.lease_until, s.state_at, p_grace)
                     OR (p_owner_key IS NOT NULL AND s.run_owner = p_dead_owner AND s.run_owner_key = v_key))))
 RETURNING s.runs, s.attempt INTO v_run, v_attempt;
    -- A refusal names the holder only to its own worker (which may then see that the holder's process is gone).
    RETURN QUERY SELECT v_run, v_attempt, s.state,
                        CASE WHEN p_owner_key IS NOT NULL AND s.run_owner_key = v_key THEN s.run_owner END
      FROM (SELECT 1) AS one
      LEFT JOIN fanin_successors s ON s.batch_id = p_batch AND s.step = p_step AND s.task_id = p_task_id;
END
$$;

CREATE FUNCTION fanin_count_duplicate(p_batch uuid, p_step text)
RETURNS void
LANGUAGE sql AS $$
    UPDATE fanin_successors SET duplicates = duplicates + 1 WHERE batch_id = p_batch AND step = p_step
$$;

-- fanin_hand_over_v2(uuid,text,integer,text,timestamp with time zone,text)
CREATE FUNCTION fanin_hand_over_v2(p_batch uuid, p_step text, p_run integer, p_state text, p_due timestamptz,
                                   p_carrier text)
RETURNS boolean
LANGUAGE plpgsql AS $$
BEGIN
    IF p_state NOT IN ('retrying', 'requeued', 'replaced') THEN
        RAISE EXCEPTION 'fanin_hand_over_v2: not a hand-over state: %', p_state USING ERRCODE = '22023';
    END IF;
    IF p_state = 'replaced' AND p_carrier IS NULL THEN
        RAISE EXCEPTION 'fanin_hand_over_v2: a replacement needs its carrier''s token' USING ERRCODE = '22023';
    END IF;
    UPDATE fanin_successors
       SET state = p_state, lease_until = p_due, state_at = now(),
           attempt = CASE p_state WHEN 'retrying' THEN attempt + 1 WHEN 'replaced' THEN 0 ELSE attempt END,
           carrier = CASE WHEN p_state = 'replaced' THEN p_carrier ELSE carrier END
     WHERE batch_id = p_batch AND step = p_step AND runs = p_run AND state = 'running';
    RETURN FOUND;
END
$$;

-- fanin_take_back_v2(uuid,text,integer,double precision,text)
CREATE FUNCTION fanin_take_back_v2(p_batch uuid, p_step text, p_run integer, p_lease double precision,
                                   p_carrier text)
RETURNS boolean
LANGUAGE plpgsql AS $$
BEGIN
    -- `p_carrier`: the token the run's own delivery came with, the one to admit again once it hands over.
    UPDATE fanin_successors
       SET state = 'running', lease_until = now() + make_interval(secs => p_lease), state_at = now(),
           attempt = CASE state WHEN 'retrying' THEN greatest(attempt - 1, 0) ELSE attempt END,
           carrier = CASE state WHEN 'replaced' THEN p_carrier ELSE carrier END
     WHERE batch_id = p_batch AND step = p_step AND runs = p_run AND state IN ('retrying', 'replaced');
    RETURN FOUND;
END
$$;

-- fanin_renew_leases(uuid[],text[],integer[],double precision)
CREATE FUNCTION fanin_renew_leases(p_batches uuid[], p_steps text[], p_runs integer[], p_lease double precision)
RETURNS TABLE (batch_id uuid, step text, runs integer)
LANGUAGE plpgsql AS $$
BEGIN
    RETURN QUERY
    WITH held AS (
        UPDATE fanin_successors s
           SET lease_until = now() + make_interval(secs => p_lease)
          FROM unnest(p_batches, p_steps, p_runs) AS l(id, step, run)
         WHERE s.batch_id = l.id AND s.step = l.step AND s.runs = l.run AND s.state = 'running'
     RETURNING s.batch_id, s.step, s.runs
    )
    SELECT h.batch_id, h.step, h.runs FROM held h;
END
$$;

-- fanin_finish_successor_v2(uuid,text,text,integer,text,bytea,text,text,text,text,text,integer,text,text)
CREATE FUNCTION fanin_finish_successor_v2(p_batch uuid, p_step text, p_task_id text, p_run integer, p_state text,
                                          p_result bytea, p_rct text, p_rce text, p_exc_type text,
                                          p_exc_message text, p_carrier text, p_retries integer, p_ran_in text,
                                          p_owner_key text)
RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    v_parent_task_id text;
BEGIN
    IF NOT fanin_successor_final(p_state) THEN
        RAISE EXCEPTION 'fanin_finish_successor_v2: not a final successor state: %', p_state USING ERRCODE = '22023';
    END IF;
    -- Three callers: the run itself (p_run); a worker's main process about a copy that ran in its pool process
    -- p_ran_in ('host:machine:pid:', a hard time limit, a lost or terminated process): only that process's run, of
    -- that worker; or about a copy that never ran (expired, revoked unstarted, unknown, undecodable): only a
    -- successor no run holds, that this copy could still have started (its carrier, its retry).
    UPDATE fanin_successors s
       SET state = p_state, exc_type = p_exc_type, exc_message = p_exc_message, state_at = now(),
           result = p_result, result_content_type = p_rct, result_content_encoding = p_rce,
           finished_at = now(), lease_until = NULL
      FROM fanin_batches b
     WHERE s.batch_id = p_batch AND s.step = p_step AND b.id = s.batch_id
       AND NOT fanin_successor_final(s.state)
       AND CASE WHEN p_run IS NOT NULL THEN s.runs = p_run AND s.state = 'running'
                WHEN p_ran_in IS NOT NULL THEN
                    s.task_id = p_task_id AND s.state = 'running' AND left(s.run_owner, length(p_ran_in)) = p_ran_in
                    AND s.run_owner_key = encode(sha256(convert_to(coalesce(p_owner_key, ''), 'UTF8')), 'hex')
                ELSE s.task_id = p_task_id AND (s.state = 'pending' OR fanin_successor_handed_over(s.state))
                     AND (s.carrier IS NULL OR s.carrier = p_carrier)
                     AND (s.state <> 'retrying' OR coalesce(p_retries, 0) >= s.attempt) END
 RETURNING b.parent_task_id INTO v_parent_task_id;
    IF NOT FOUND THEN
        IF p_run IS NULL THEN
            UPDATE fanin_successors SET duplicates = duplicates + 1
             WHERE batch_id = p_batch AND step = p_step AND task_id = p_task_id;
        END IF;
        RETURN false;
    END IF;
    IF v_parent_task_id IS NOT NULL THEN
        -- Ignore() ended the body without an error and without a value: the outer child succeeded.
        PERFORM fanin_record_terminal_v2(v_parent_task_id,
                                         CASE WHEN p_state = 'ignored' THEN 'succeeded' ELSE p_state END,
                                         p_result, p_rct, p_rce, p_exc_type, p_exc_message, NULL, NULL, NULL);
    END IF;
    RETURN true;
END
$$;

-- A failed child's and a failed successor's traceback, written once after the report that counted the failure,
-- bounded here whatever the caller sent (its last 16,000 characters: a traceback ends with the error).
-- fanin_note_traceback(text,text)
CREATE FUNCTION fanin_note_traceback(p_task_id text, p_traceback text)
RETURNS boolean
LANGUAGE plpgsql AS $$
BEGIN
    -- Only a child counted as not succeeded, and only the first traceback (the counted run's, as its report was).
    UPDATE fanin_children SET traceback = right(p_traceback, 16000)
     WHERE task_id = p_task_id AND state NOT IN ('pending', 'started', 'succeeded') AND traceback IS NULL;
    RETURN FOUND;
END
$$;

-- The same, written only onto the failure it belongs to (version 35): a resent report that came back late (its
-- first copy was counted, its answer lost) writes its traceback when the counted failure has its error's type and
-- text. fanin_note_traceback stays for workers not yet restarted.
-- fanin_note_traceback_v2(text,text,text,text)
CREATE FUNCTION fanin_note_traceback_v2(p_task_id text, p_traceback text, p_exc_type text, p_exc_message text)
RETURNS boolean
LANGUAGE plpgsql AS $$
BEGIN
    -- Only a child counted as not succeeded, only the first traceback, and only onto the failure it belongs to.
    UPDATE fanin_children SET traceback = right(p_traceback, 16000)
     WHERE task_id = p_task_id AND state NOT IN ('pending', 'started', 'succeeded') AND traceback IS NULL
       AND exc_type IS NOT DISTINCT FROM p_exc_type AND exc_message IS NOT DISTINCT FROM p_exc_message;
    RETURN FOUND;
END
$$;

-- fanin_note_successor_traceback(uuid,text,text)
CREATE FUNCTION fanin_note_successor_traceback(p_batch uuid, p_step text, p_traceback text)
RETURNS boolean
LANGUAGE plpgsql AS $$
BEGIN
    UPDATE fanin_successors SET traceback = right(p_traceback, 16000)
     WHERE batch_id = p_batch AND step = p_step AND state = 'failed' AND traceback IS NULL;
    RETURN FOUND;
END
$$;

-- An operator's rerun of a failed or revoked successor, under a new task id (version 29).
-- fanin_rerun_successor(uuid,text,text,text)
CREATE FUNCTION fanin_rerun_successor(p_batch uuid, p_step text, p_task_id text, p_by text)
RETURNS TABLE (rerun integer, state text, previous_task_id text, previous_state text)
LANGUAGE plpgsql AS $$
DECLARE
    v_old fanin_successors%ROWTYPE;
    v_rerun integer;
    v_outbox bigint;
BEGIN
    SELECT * INTO v_old FROM fanin_successors s WHERE s.batch_id = p_batch AND s.step = p_step FOR UPDATE;
    IF NOT FOUND THEN
        RETURN;  -- no such successor: the caller says so
    END IF;
    IF v_old.state NOT IN ('failed', 'revoked') THEN
        RETURN QUERY SELECT NULL::integer, v_old.state, v_old.task_id, v_old.state;  -- refused: not failed or revoked
        RETURN;
    END IF;
    -- A round retried since (`retry-failed`): its successor ran again there; rerunning this one would run it twice.
    IF EXISTS (SELECT 1 FROM fanin_batches b, fanin_batches later
                WHERE b.id = p_batch AND later.parent_id IS NULL AND later.round > b.round
                  AND coalesce(later.retry_of, later.id) = coalesce(b.retry_of, b.id)) THEN
        RETURN QUERY SELECT NULL::integer, 'superseded'::text, v_old.task_id, v_old.state;
        RETURN;
    END IF;
    IF p_task_id IS NULL OR p_task_id = '' OR p_task_id = v_old.task_id
       OR EXISTS (SELECT 1 FROM fanin_successor_reruns r
                   WHERE r.batch_id = p_batch AND r.step = p_step AND r.previous_task_id = p_task_id) THEN
        RAISE EXCEPTION 'fanin_rerun_successor: a rerun needs a task id of its own' USING ERRCODE = '22023';
    END IF;
    SELECT coalesce(max(r.rerun), 0) + 1 INTO v_rerun
      FROM fanin_successor_reruns r WHERE r.batch_id = p_batch AND r.step = p_step;
    INSERT INTO fanin_successor_reruns (batch_id, step, rerun, task_id, previous_task_id, previous_state,
                                        previous_exc_type, previous_exc_message, previous_runs, requested_by)
    VALUES (p_batch, p_step, v_rerun, p_task_id, v_old.task_id, v_old.state, v_old.exc_type, v_old.exc_message,
            v_old.runs, left(coalesce(p_by, ''), 200));
    -- `runs` goes on (the next admitted run is runs + 1); everything of the last run's end is cleared.
    UPDATE fanin_successors s
       SET task_id = p_task_id, state = 'pending', state_at = now(), exc_type = NULL, exc_message = NULL,
           result = NULL, result_content_type = NULL, result_content_encoding = NULL, traceback = NULL,
           finished_at = NULL, lease_until = NULL, attempt = 0, run_owner = NULL, run_owner_key = NULL,
           carrier = NULL
     WHERE s.batch_id = p_batch AND s.step = p_step;
    UPDATE fanin_outbox o SET sent_at = NULL, available_at = now(), attempts = 0, last_error = 'rerun'
     WHERE o.batch_id = p_batch AND o.step = p_step
 RETURNING o.id INTO v_outbox;
    IF v_outbox IS NULL THEN  -- pruned rows are gone with their batch; a hand-deleted outbox row is made again
        INSERT INTO fanin_outbox (batch_id, step, last_error) VALUES (p_batch, p_step, 'rerun')
        RETURNING id INTO v_outbox;
    END IF;
    PERFORM fanin_notify_relay(v_outbox::text);
    RETURN QUERY SELECT v_rerun, 'pending'::text, v_old.task_id, v_old.state;
END
$$;

-- An operator's action from the dashboard, recorded (version 30).
-- fanin_record_action(text,text,uuid,text,text)
CREATE FUNCTION fanin_record_action(p_actor text, p_action text, p_batch uuid, p_outcome text, p_detail text)
RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    v_id bigint;
BEGIN
    INSERT INTO fanin_operator_actions (actor, action, batch_id, outcome, detail)
    VALUES (left(p_actor, 200), p_action, p_batch, p_outcome, left(p_detail, 2000))
    RETURNING id INTO v_id;
    RETURN v_id;
END
$$;

-- A part of a replaced successor's replacement (a task before its carrier: a chain's earlier task, a chord's header
-- task) failed or was revoked, so Celery will not publish the carrier: the successor ends with it (version 31).
-- Only while it waits for that carrier (state `replaced`, this carrier token): never a run the carrier holds, nor a
-- successor that a later replacement took over, nor one final already. A nested batch's outer child ends with it.
-- fanin_end_replacement(uuid,text,text,text,text,text,text)
CREATE FUNCTION fanin_end_replacement(p_batch uuid, p_step text, p_task_id text, p_carrier text, p_state text,
                                      p_exc_type text, p_exc_message text)
RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    v_parent_task_id text;
BEGIN
    IF p_state NOT IN ('failed', 'revoked') THEN
        RAISE EXCEPTION 'fanin_end_replacement: not a state a part ends it with: %', p_state USING ERRCODE = '22023';
    END IF;
    UPDATE fanin_successors s
       SET state = p_state, exc_type = p_exc_type, exc_message = p_exc_message, state_at = now(),
           finished_at = now(), lease_until = NULL
      FROM fanin_batches b
     WHERE s.batch_id = p_batch AND s.step = p_step AND b.id = s.batch_id
       AND s.state = 'replaced' AND s.task_id = p_task_id AND s.carrier = p_carrier
 RETURNING b.parent_task_id INTO v_parent_task_id;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    IF v_parent_task_id IS NOT NULL THEN
        PERFORM fanin_record_terminal_v2(v_parent_task_id, p_state, NULL, NULL, NULL, p_exc_type, p_exc_message,
                                         NULL, NULL, NULL);
    END IF;
    RETURN true;
END
$$;

-- Every function runs with the rights of the schema owner (who ran this file) and a search path pinned to this
-- schema, then pg_temp; PUBLIC's default EXECUTE is revoked: docs/how-to/grants.sql grants each role its own. The
-- predicates (fanin_successor_final and the rest) are left as they are, to be inlined.
DO $$
DECLARE
    f regprocedure;
BEGIN
    FOR f IN SELECT p.oid FROM pg_proc p WHERE p.pronamespace = current_schema()::regnamespace
                                         AND p.proname LIKE 'fanin\_%'
                                         AND p.proname NOT IN ('fanin_successor_final', 'fanin_successor_handed_over',
                                                               'fanin_successor_lapsed', 'fanin_successor_stalled') LOOP
        EXECUTE format('ALTER FUNCTION %s SECURITY DEFINER SET search_path = pg_catalog, %I, pg_temp', f,
                       current_schema());
        EXECUTE format('REVOKE EXECUTE ON FUNCTION %s FROM PUBLIC', f);
    END LOOP;
END
$$;
