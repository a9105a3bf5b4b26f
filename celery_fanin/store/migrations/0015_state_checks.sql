-- The states a row may be in, as CHECK constraints: the lists of celery_fanin.protocol's ChildState, BatchState,
-- SuccessorState and SagaState (tests/store/test_states.py compares the two). Adding one reads the table once under
-- its lock; retention keeps these tables to the batches still wanted, and every row already holds one of these.
ALTER TABLE fanin_children ADD CONSTRAINT fanin_children_state_check
    CHECK (state IN ('pending', 'started', 'succeeded', 'failed', 'time_limit', 'worker_lost', 'revoked', 'rejected',
                     'unknown', 'lost', 'abandoned'));
ALTER TABLE fanin_batches ADD CONSTRAINT fanin_batches_state_check
    CHECK (state IN ('open', 'running', 'complete', 'partial', 'failed_threshold', 'expired', 'cancelled'));
ALTER TABLE fanin_successors ADD CONSTRAINT fanin_successors_state_check
    CHECK (state IN ('pending', 'sent', 'running', 'retrying', 'requeued', 'replaced', 'succeeded', 'failed',
                     'revoked', 'ignored'));
ALTER TABLE fanin_sagas ADD CONSTRAINT fanin_sagas_state_check
    CHECK (state IN ('running', 'compensating', 'succeeded', 'compensated', 'compensation_failed',
                     'manual_action_required'));
