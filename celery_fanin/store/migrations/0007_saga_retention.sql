-- celery-fanin schema, version 7: retention keeps the batches a saga may still need.
--
-- A saga that is still running, compensating, or stopped with a failed compensation (which `saga resume` runs
-- again) reads its steps' and compensations' batches to know which children succeeded and must be undone, so
-- `fanin prune` skips those batches (store/admin.py, _PRUNABLE). This index lets it find a step's saga by the
-- step's batch; fanin_saga_compensations has one on batch_id already (0004). Saga tables are small next to
-- fanin_batches, so the index is built inside the migration's transaction.

CREATE INDEX fanin_saga_steps_batch ON fanin_saga_steps (batch_id) WHERE batch_id IS NOT NULL;
