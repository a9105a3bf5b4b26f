"""Placing an order: the order row and its fan-in in one `transaction.atomic()` block."""

from __future__ import annotations

from django.db import connection, transaction

from celery_fanin import fan_in_group

from .models import Order
from .tasks import pick_item, ship


def place_order(items: int) -> Order:
    """The batch and its children are written in the block's transaction (`transaction=connection`): if the block
    rolls back, neither the order nor the batch exists, and the children are published only once it commits
    (`on_commit`; by the relay if the process dies first)."""
    with transaction.atomic():
        order = Order.objects.create(items=items)
        handle = fan_in_group([pick_item.s(order.id, i) for i in range(items)], then=ship.s(order.id)).apply_async(
            transaction=connection
        )
        order.batch_id = handle.batch_id
        order.save(update_fields=["batch_id"])
    return order
