-- celery-fanin schema, version 1.
-- Hot-path notes: `remaining`, `succeeded` and `failed` are in no index so that the decrement is a HOT update;
-- the batch table keeps free space on its pages (fillfactor) for those updates.

CREATE TABLE fanin_batches (
    id                  uuid        PRIMARY KEY,
    step                text        NOT NULL,
    state               text        NOT NULL,            -- running | complete
    planned             integer     NOT NULL CHECK (planned >= 0),
    remaining           integer     NOT NULL CHECK (remaining >= 0),
    succeeded           integer     NOT NULL DEFAULT 0,
    failed              integer     NOT NULL DEFAULT 0,
    -- children with idx < published_upto are known to be on the broker; the relay publishes the rest
    published_upto      integer     NOT NULL DEFAULT 0,
    successor_task_id   text        NOT NULL,
    successor_name      text        NOT NULL,
    successor_message   bytea       NOT NULL,            -- the `then` signature, encoded with its serializer
    successor_content_type text     NOT NULL,
    successor_content_encoding text NOT NULL,
    created_at          timestamptz NOT NULL DEFAULT now(),
    completed_at        timestamptz
) WITH (fillfactor = 70);

CREATE INDEX fanin_batches_unpublished ON fanin_batches (created_at) WHERE published_upto < planned;
CREATE INDEX fanin_batches_created ON fanin_batches (created_at);

CREATE TABLE fanin_children (
    task_id             text        PRIMARY KEY,
    batch_id            uuid        NOT NULL REFERENCES fanin_batches (id) ON DELETE CASCADE,
    idx                 integer     NOT NULL,
    task_name           text        NOT NULL,
    -- pending (not yet terminal) | succeeded | failed | revoked | rejected | unknown | time_limit | lost
    state               text        NOT NULL DEFAULT 'pending',
    message             bytea       NOT NULL,            -- the child's signature, for re-publishing
    content_type        text        NOT NULL,
    content_encoding    text        NOT NULL,
    result              bytea,                           -- return value, encoded with the app's result serializer
    result_content_type text,
    result_content_encoding text,
    exc_type            text,
    exc_message         text,
    finished_at         timestamptz,
    UNIQUE (batch_id, idx)
);

CREATE TABLE fanin_successors (
    batch_id            uuid        NOT NULL REFERENCES fanin_batches (id) ON DELETE CASCADE,
    step                text        NOT NULL,
    task_id             text        NOT NULL,
    -- pending (in the outbox) | sent | running | retrying | succeeded | failed | revoked
    state               text        NOT NULL DEFAULT 'pending',
    runs                integer     NOT NULL DEFAULT 0,  -- times the body was started (retries included)
    duplicates          integer     NOT NULL DEFAULT 0,  -- deliveries refused because a run was under way or done
    exc_type            text,
    exc_message         text,
    created_at          timestamptz NOT NULL DEFAULT now(),
    started_at          timestamptz,
    finished_at         timestamptz,
    PRIMARY KEY (batch_id, step)
);

CREATE TABLE fanin_outbox (
    id                  bigserial   PRIMARY KEY,
    batch_id            uuid        NOT NULL REFERENCES fanin_batches (id) ON DELETE CASCADE,
    step                text        NOT NULL,
    created_at          timestamptz NOT NULL DEFAULT now(),
    available_at        timestamptz NOT NULL DEFAULT now(),
    sent_at             timestamptz,
    attempts            integer     NOT NULL DEFAULT 0,
    last_error          text,
    UNIQUE (batch_id, step)
);

CREATE INDEX fanin_outbox_pending ON fanin_outbox (available_at, id) WHERE sent_at IS NULL;
