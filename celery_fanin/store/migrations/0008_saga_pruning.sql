-- celery-fanin schema, version 8: retention deletes finished sagas.
--
-- `fanin prune` deletes sagas that finished for good (succeeded, or compensated) before its cut-off, oldest
-- first, a chunk per transaction (store/admin.py, _PRUNABLE_SAGAS); their steps and compensations go with them.
-- This index is what it walks. Saga tables are small next to fanin_batches, so it is built inside the
-- migration's transaction.

CREATE INDEX fanin_sagas_finished ON fanin_sagas (finished_at) WHERE state IN ('succeeded', 'compensated');
