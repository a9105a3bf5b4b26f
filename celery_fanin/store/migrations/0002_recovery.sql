-- celery-fanin schema, version 2: what recovery needs.
-- Children record their starts (so "never started" and "started, never finished" can be told apart), lost-child
-- redrives and late reports; batches carry their child timeout, deadline and failure threshold; a successor row
-- says which signature it runs (the `then` successor, or `on_expire` / `on_failure` instead of it).

ALTER TABLE fanin_children
    ADD COLUMN started_at   timestamptz,
    ADD COLUMN attempt      integer NOT NULL DEFAULT 0,   -- Celery retry number of the latest start
    ADD COLUMN starts       integer NOT NULL DEFAULT 0,   -- starts seen, redeliveries and retries included
    ADD COLUMN worker       text,                         -- hostname of the latest start
    ADD COLUMN redrives     integer NOT NULL DEFAULT 0,   -- times the relay re-published it after child_timeout
    ADD COLUMN redriven_at  timestamptz,
    ADD COLUMN late_state   text,                         -- the latest report that came after it was counted
    ADD COLUMN late_at      timestamptz,
    ADD COLUMN late_reports integer NOT NULL DEFAULT 0;

-- Unfinished children only: the reaper and reconciliation read a set that shrinks as the batch progresses.
CREATE INDEX fanin_children_open ON fanin_children (batch_id) WHERE state IN ('pending', 'started');

ALTER TABLE fanin_batches
    ADD COLUMN child_timeout  interval,
    ADD COLUMN on_lost        text    NOT NULL DEFAULT 'fail' CHECK (on_lost IN ('fail', 'redrive')),
    ADD COLUMN max_redrives   integer NOT NULL DEFAULT 3,
    ADD COLUMN deadline_at    timestamptz,
    ADD COLUMN on_deadline    text    NOT NULL DEFAULT 'proceed' CHECK (on_deadline IN ('proceed', 'abandon')),
    ADD COLUMN max_failures   integer,                    -- finish early once `failed` exceeds this
    ADD COLUMN on_expire_message          bytea,
    ADD COLUMN on_expire_content_type     text,
    ADD COLUMN on_expire_content_encoding text,
    ADD COLUMN on_failure_message          bytea,
    ADD COLUMN on_failure_content_type     text,
    ADD COLUMN on_failure_content_encoding text;

CREATE INDEX fanin_batches_running ON fanin_batches (created_at) WHERE state = 'running';

ALTER TABLE fanin_successors
    ADD COLUMN kind text NOT NULL DEFAULT 'then' CHECK (kind IN ('then', 'on_expire', 'on_failure'));

-- When the successor last changed state: a successor `sent` or `retrying` for too long (its message lost with a
-- broker restart), or `running` with no live process holding its run lock, is published again.
ALTER TABLE fanin_successors
    ADD COLUMN state_at timestamptz NOT NULL DEFAULT now();
