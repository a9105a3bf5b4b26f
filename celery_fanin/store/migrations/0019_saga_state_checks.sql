-- The states of a saga's steps and compensations as CHECK constraints, as 0015 did for the other tables: the lists
-- of celery_fanin.protocol's SagaStepState and CompensationState (tests/store/test_states.py compares them).
ALTER TABLE fanin_saga_steps ADD CONSTRAINT fanin_saga_steps_state_check
    CHECK (state IN ('pending', 'running', 'succeeded', 'failed', 'skipped', 'nothing_to_undo', 'compensating',
                     'compensated', 'compensation_failed', 'manual_action_required', 'acknowledged'));
ALTER TABLE fanin_saga_compensations ADD CONSTRAINT fanin_saga_compensations_state_check
    CHECK (state IN ('pending', 'running', 'succeeded', 'failed', 'manual_action_required', 'acknowledged'));
