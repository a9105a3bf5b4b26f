-- celery-fanin schema, version 16: what the dashboard (celery_fanin.web) reads, by index.
--
-- The batches page lists root batches newest first, one keyset page at a time (`(created_at, id) < cursor`), and
-- filters them by state, step, app or key prefix; each filter walks an index of its own in the page's order, so
-- a page reads about as many rows as it shows however large the store is (bench/dashboard.py, BENCHMARKS.md).
-- Every index is partial on roots (a tree's leaves are never listed, and skip them), and none holds a counter
-- column: a child's settle still updates its batch in place (HOT). The state index is new work only when a batch
-- changes state, and that update already touches the `fanin_batches_running` index.
-- The key index is in the "C" collation, so that a prefix is a range of it whatever the database's collation.
--
-- `fanin_children_failures`: the children that ended in any state but succeeded, per batch in child order. The
-- batch page counts and lists them (and `celery -A proj fanin failures` reads the same set) without reading the
-- batch's succeeded children; a child that succeeds is never in it, so the common terminal report costs nothing
-- more.
--
-- Plain CREATE INDEX, in the migration's transaction: each blocks writes to its table for one scan of it
-- (fanin_children is the largest; see docs/reference/commands.md).

CREATE INDEX fanin_batches_roots ON fanin_batches (created_at, id) WHERE parent_id IS NULL;
CREATE INDEX fanin_batches_roots_state ON fanin_batches (state, created_at, id) WHERE parent_id IS NULL;
CREATE INDEX fanin_batches_roots_step ON fanin_batches (step, created_at, id) WHERE parent_id IS NULL;
CREATE INDEX fanin_batches_roots_app ON fanin_batches (app_name, created_at, id) WHERE parent_id IS NULL;
CREATE INDEX fanin_batches_roots_key ON fanin_batches (key COLLATE "C")
    WHERE parent_id IS NULL AND key IS NOT NULL;

CREATE INDEX fanin_children_failures ON fanin_children (batch_id, idx)
    WHERE state NOT IN ('pending', 'started', 'succeeded');

-- The sagas page, newest first (saga tables are small next to fanin_batches).
CREATE INDEX fanin_sagas_created ON fanin_sagas (created_at, id);
