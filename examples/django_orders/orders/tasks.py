"""Found by `app.autodiscover_tasks()`, in the worker and in the relay alike."""

from __future__ import annotations

from typing import Any

from celery import shared_task


@shared_task(name="orders.pick_item")
def pick_item(order_id: int, item: int) -> int:
    return item


@shared_task(name="orders.ship")
def ship(outcome: dict[str, Any], order_id: int) -> str:
    return f"order {order_id}: {outcome['succeeded']} items picked"
