"""Publishing to the broker: children and successors as Celery task messages, in bulk where the transport allows."""
