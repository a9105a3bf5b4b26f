"""Moving committed rows onto the broker, run by whoever committed them: the producer, a worker, eager mode, the
relay (`successors`: the successors' outbox; `children`: children not yet published)."""
