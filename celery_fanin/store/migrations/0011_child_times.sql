-- celery-fanin schema, version 11: when a child's message expires, and when it may run at the earliest.
--
-- `expires_at`: a child published with `expires` that no worker took in time is dropped by RabbitMQ unconsumed
-- (Celery gives the message a TTL), so no worker ever reports it; the relay counts a pending child whose
-- expires_at has passed (plus `fanin_expires_grace`) as revoked, with the same conditional transition a worker's
-- report takes (a later real report is late, counted once).
-- `eta_at`: a child published with `countdown` or `eta` is not overdue before it may run: child_timeout is
-- measured from it when it is later than the batch's creation.

ALTER TABLE fanin_children ADD COLUMN expires_at timestamptz;
ALTER TABLE fanin_children ADD COLUMN eta_at timestamptz;

CREATE INDEX fanin_children_expiring ON fanin_children (expires_at) WHERE expires_at IS NOT NULL AND state = 'pending';
