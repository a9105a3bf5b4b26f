"""A successor routed by its own task options: a worker that autodiscovers this module sends it to its queue, and
so must the relay (tests/e2e/test_relay_app.py)."""

from __future__ import annotations

from typing import Any

from celery import shared_task

ROUTED_QUEUE = "fanin-routed"


@shared_task(name="tests.routed.where", queue=ROUTED_QUEUE, bind=True)
def where(self: Any, outcome: dict[str, Any]) -> str | None:
    """Returns the queue its message was routed to."""
    return (self.request.delivery_info or {}).get("routing_key")  # type: ignore[no-any-return]
