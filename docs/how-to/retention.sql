-- Delete up to 1,000 finished batches older than 30 days, with their children, successors and outbox rows
-- (ON DELETE CASCADE). Repeat until it deletes nothing: each run is one short transaction that locks only the
-- rows it deletes, so it runs beside live traffic. (`fanin prune` does the same in smaller transactions.)
DELETE FROM fanin_batches
 WHERE id IN (
       SELECT b.id FROM fanin_batches b
        WHERE b.parent_id IS NULL                        -- roots only: a tree's leaves go with their root
          AND b.state IN ('complete', 'partial', 'failed_threshold', 'expired', 'cancelled')
          AND b.created_at < now() - interval '30 days'  -- implied by the next line; lets the index help
          AND coalesce(b.completed_at, b.created_at) < now() - interval '30 days'
          AND NOT EXISTS (SELECT 1 FROM fanin_successors s  -- its successor, if any, has finished
                           WHERE s.batch_id = b.id AND s.state NOT IN ('succeeded', 'failed', 'revoked'))
          AND NOT EXISTS (SELECT 1 FROM fanin_batches r     -- and no retry round of it is still running
                           WHERE r.retry_of = b.id AND r.state IN ('open', 'running'))
          AND NOT EXISTS (SELECT 1 FROM fanin_saga_steps st -- nor a saga that may still roll it back
                            JOIN fanin_sagas g ON g.id = st.saga_id
                           WHERE st.batch_id = b.id AND g.state IN ('running', 'compensating', 'compensation_failed'))
          AND NOT EXISTS (SELECT 1 FROM fanin_saga_compensations c
                            JOIN fanin_sagas g ON g.id = c.saga_id
                           WHERE c.batch_id = b.id AND g.state IN ('running', 'compensating', 'compensation_failed'))
        ORDER BY b.created_at
        LIMIT 1000);
