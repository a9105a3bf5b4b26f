-- celery-fanin schema, version 4: sagas.
--
-- A saga is an ordered list of steps; each step runs as a fan-in batch (key `saga:<id>:step:<n>`) whose successor
-- advances the saga. When a step fails for good, the compensations of the completed work are written here once,
-- in reverse order (`stage` 0 runs first), each under the identity of what it undoes (`undo_of`: the original
-- child's or successor's task id), and run stage by stage, each stage as a fan-in batch of its own.
-- Batch ids are not foreign keys: retention may prune batches of sagas it should keep; the saga rows still say
-- what ran.

CREATE TABLE fanin_sagas (
    id                  uuid        PRIMARY KEY,
    app_name            text        NOT NULL,
    key                 text,                            -- idempotency key, unique per app
    -- running | succeeded | compensating | compensated | compensation_failed | manual_action_required
    state               text        NOT NULL DEFAULT 'running',
    steps               integer     NOT NULL CHECK (steps > 0),
    current_step        integer     NOT NULL DEFAULT 1,  -- running: the step under way (1-based)
    failed_step         integer,                         -- the step whose failure started the rollback
    exc_type            text,                            -- why it failed
    exc_message         text,
    current_stage       integer     NOT NULL DEFAULT 0,  -- compensating: the stage under way
    resumes             integer     NOT NULL DEFAULT 0,  -- times `saga resume` restarted a stopped rollback
    failed_compensation text,                            -- compensation_failed: which one stopped it, and why
    compensation_timeout interval,                       -- a compensation not finished after this is published again
    compensation_redrives integer   NOT NULL DEFAULT 3,
    created_at          timestamptz NOT NULL DEFAULT now(),
    state_at            timestamptz NOT NULL DEFAULT now(),
    finished_at         timestamptz
);

CREATE UNIQUE INDEX fanin_sagas_key ON fanin_sagas (app_name, key) WHERE key IS NOT NULL;
CREATE INDEX fanin_sagas_open ON fanin_sagas (state_at) WHERE state IN ('running', 'compensating');

CREATE TABLE fanin_saga_steps (
    saga_id             uuid        NOT NULL REFERENCES fanin_sagas (id) ON DELETE CASCADE,
    position            integer     NOT NULL,            -- 1-based
    kind                text        NOT NULL CHECK (kind IN ('task', 'group')),
    name                text        NOT NULL,            -- the task's name, or the group's successor's
    manual_text         text,                            -- a manual step: what an operator must do to undo it
    definition          bytea       NOT NULL,            -- the step (signature or group spec), encoded
    content_type        text        NOT NULL,
    content_encoding    text        NOT NULL,
    undo_message        bytea,                           -- compensated(group, undo): the undo of the whole group
    undo_content_type   text,
    undo_content_encoding text,
    -- pending | running | succeeded | failed | skipped | compensating | compensated | compensation_failed
    -- | nothing_to_undo | manual_action_required | acknowledged
    state               text        NOT NULL DEFAULT 'pending',
    batch_id            uuid,                            -- the step's batch, once created
    exc_type            text,
    exc_message         text,
    started_at          timestamptz,
    finished_at         timestamptz,
    PRIMARY KEY (saga_id, position)
);

CREATE TABLE fanin_saga_compensations (
    saga_id             uuid        NOT NULL REFERENCES fanin_sagas (id) ON DELETE CASCADE,
    -- What this undoes: the original child's (or group successor's) task id, or `manual:<step>`. The primary key
    -- makes generating a saga's compensations twice create them once.
    undo_of             text        NOT NULL,
    position            integer     NOT NULL,            -- the saga step it belongs to
    stage               integer     NOT NULL,            -- rollback order: stage 0 first; one fan-in per stage
    ordinal             integer     NOT NULL,            -- order within the stage
    kind                text        NOT NULL CHECK (kind IN ('child', 'step', 'manual')),
    unit                text,                            -- the compensation batch's key is compensate:<unit>:<attempt>
    task_name           text,
    message             bytea,                           -- the undo signature, encoded
    content_type        text,
    content_encoding    text,
    manual_text         text,
    -- pending | running | succeeded | failed | manual_action_required | acknowledged
    state               text        NOT NULL DEFAULT 'pending',
    attempt             integer     NOT NULL DEFAULT 1,  -- raised by `saga resume`; each attempt has its own task id
    task_id             text,
    batch_id            uuid,                            -- the compensation batch of the latest attempt
    exc_type            text,
    exc_message         text,
    acked_at            timestamptz,
    acked_by            text,
    created_at          timestamptz NOT NULL DEFAULT now(),
    finished_at         timestamptz,
    PRIMARY KEY (saga_id, undo_of)
);

CREATE INDEX fanin_saga_compensations_stage ON fanin_saga_compensations (saga_id, stage);
CREATE INDEX fanin_saga_compensations_batch ON fanin_saga_compensations (batch_id) WHERE batch_id IS NOT NULL;
