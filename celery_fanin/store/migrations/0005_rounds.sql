-- celery-fanin schema, version 5: numbered retry rounds (`celery -A proj fanin retry-failed BATCH_ID`).
--
-- A retry round is an ordinary batch: the failed children of a finished batch, published again under new task
-- ids, with the same step and successor. `retry_of` links every round to the batch of round 1 (no foreign key:
-- retention may delete round 1 before a later round), and `round` numbers them: 1 for every batch created any
-- other way. Both are written when the round is created, with the batch row, so the outcome its successor
-- receives can say which round it is. Neither is touched by the counting path.
-- Adding columns with constant defaults rewrites nothing; the partial index covers retry rounds only.

ALTER TABLE fanin_batches
    ADD COLUMN round    integer NOT NULL DEFAULT 1,
    ADD COLUMN retry_of uuid;

CREATE INDEX fanin_batches_retry_of ON fanin_batches (retry_of, round) WHERE retry_of IS NOT NULL;
