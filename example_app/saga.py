"""An order as a saga: reserve stock, charge the card, email the confirmation, ship.

If shipping fails for good (the simulated carrier refuses orders whose id ends in ``-nocarrier``, after three
retries), the saga compensates what was done, latest first: an operator is asked to email the customer (an email
cannot be unsent: a `manual` step), the card is refunded, the stock released. Each effect is one row in
`example_order_ledger`, unique per (action, key): a step's key is its own task id, an undo's is the task id of what
it undoes (``task.request.fanin_undo_of``), so an undo that runs twice (a redelivery, a worker killed after the
refund went out) refunds once.

    celery -A example_app worker          # plus `celery -A example_app fanin relay`
    python -m example_app.saga_demo order-1              # ships: the saga succeeds
    python -m example_app.saga_demo order-2-nocarrier    # rolls back, then waits for an operator:
    celery -A example_app fanin saga ack SAGA_ID 3 --by alice
"""

from __future__ import annotations

from typing import Any

from celery import Task

from celery_fanin import FanIn, SagaResult, builtin_tasks, compensated, manual, saga

from . import db
from .celeryapp import app

builtin_tasks.register(app)  # the saga's internal tasks; harmless once FanIn(app) registers them itself


class CarrierUnavailable(Exception):
    """The carrier refused the shipment; retried, then the step fails for good."""


def _record(order_id: str, action: str, key: str | None, **detail: Any) -> bool:
    if not key:
        raise RuntimeError(f"{action} of {order_id}: no idempotency key")
    with db.connect(FanIn.of(app).database_url) as conn:
        return db.record_order_effect(conn, order_id, action, key, detail)


@app.task(bind=True)
def reserve_stock(self: Task, order_id: str, sku: str, quantity: int) -> str:
    _record(order_id, "reserve", self.request.id, sku=sku, quantity=quantity)
    return f"reserved {quantity} x {sku}"


@app.task(bind=True)
def release_stock(self: Task, order_id: str, sku: str, quantity: int) -> None:
    _record(order_id, "release", self.request.fanin_undo_of, sku=sku, quantity=quantity)


@app.task(bind=True)
def charge_card(self: Task, order_id: str, amount_cents: int) -> str:
    _record(order_id, "charge", self.request.id, amount_cents=amount_cents)
    return f"charged {amount_cents}"


@app.task(bind=True, autoretry_for=(ConnectionError,), retry_backoff=True, max_retries=5)
def refund_card(self: Task, order_id: str, amount_cents: int) -> None:
    """Keyed by the charge it reverses: the payment provider would get the same idempotency key."""
    _record(order_id, "refund", self.request.fanin_undo_of, amount_cents=amount_cents)


@app.task(bind=True)
def email_confirmation(self: Task, order_id: str) -> None:
    _record(order_id, "email", self.request.id)


@app.task(bind=True, autoretry_for=(CarrierUnavailable,), retry_backoff=True, retry_backoff_max=2, max_retries=3)
def ship_order(self: Task, order_id: str) -> str:
    if order_id.endswith("-nocarrier"):
        raise CarrierUnavailable(f"no carrier accepts order {order_id}")
    _record(order_id, "ship", self.request.id)
    return f"shipped {order_id}"


def place_order(order_id: str, sku: str = "SKU-1", quantity: int = 1, amount_cents: int = 1999) -> SagaResult:
    """Start the order's saga (once per order id: the key)."""
    return saga(
        compensated(reserve_stock.s(order_id, sku, quantity), release_stock.s(order_id, sku, quantity)),
        compensated(charge_card.s(order_id, amount_cents), refund_card.s(order_id, amount_cents)),
        manual(email_confirmation.s(order_id), f"Email the customer that order {order_id} is cancelled"),
        ship_order.s(order_id),
        key=f"order:{order_id}",
    ).apply_async()
