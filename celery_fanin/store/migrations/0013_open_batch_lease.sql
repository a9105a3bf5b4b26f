-- celery-fanin schema, version 13: an open (streaming) batch's producer lease.
--
-- A streaming batch is `open` while its producer writes children, and holds a token in its counter so that it
-- cannot finish early. If the producer dies (or its input raises) and nobody resumes it, the token must still be
-- released. `producer_seen_at` is the last time the batch's producer was known alive: the producer writes it with
-- every chunk, and the relay's periodic duty writes it for every open batch whose publish lock (the session
-- advisory lock its producer holds from the batch's insert to its seal) is held. The relay seals an open root
-- batch whose lock is free and whose producer was last seen longer than `fanin_open_batch_grace` ago.
-- Existing rows get the migration's time, so an open batch left before the upgrade gets one full grace period.

ALTER TABLE fanin_batches ADD COLUMN producer_seen_at timestamptz NOT NULL DEFAULT now();
