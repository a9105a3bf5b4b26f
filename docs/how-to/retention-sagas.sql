-- Delete up to 1,000 sagas that finished for good more than 30 days ago, with their steps and compensations
-- (ON DELETE CASCADE). Their batches are batches like any other (retention.sql). Repeat until it deletes nothing.
DELETE FROM fanin_sagas
 WHERE id IN (
       SELECT id FROM fanin_sagas
        WHERE state IN ('succeeded', 'compensated')       -- not one that is running or waits for an operator
          AND finished_at < now() - interval '30 days'
        ORDER BY finished_at
        LIMIT 1000)
   AND state IN ('succeeded', 'compensated');             -- checked again if it changed meanwhile
