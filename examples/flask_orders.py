"""docs/how-to/flask.md: an order and its fan-in written in one Flask-SQLAlchemy transaction.

`place_order` adds the order row and creates the fan-in with `transaction=db.session`: the batch and its children
are written in the session's transaction, so a rollback leaves neither the order nor the batch, and the children
are published only after `db.session.commit()` (by this process, or by the relay if it dies in between).
"""

from __future__ import annotations

import os
from typing import Any

from celery import Celery
from flask import Flask, abort, jsonify, request
from flask_sqlalchemy import SQLAlchemy
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from celery_fanin import FanIn, fan_in_group


class Base(DeclarativeBase):
    pass


db = SQLAlchemy(model_class=Base)


class Order(db.Model):  # type: ignore[name-defined,misc]
    id: Mapped[int] = mapped_column(primary_key=True)
    items: Mapped[int]
    batch_id: Mapped[str | None]


DATABASE_URL = os.environ.get("FANIN_DATABASE_URL", "postgresql+psycopg://root@127.0.0.1/test")

celery = Celery("examples.flask_orders", broker=os.environ.get("FANIN_BROKER_URL", "redis://127.0.0.1:6379/0"))
celery.conf.fanin_database_url = DATABASE_URL  # the same PostgreSQL database as the app's own tables
celery.conf.task_default_queue = os.environ.get("FANIN_EXAMPLE_QUEUE", "celery")
FanIn(celery)


@celery.task(name="examples.flask_orders.pick_item")
def pick_item(order_id: int, item: int) -> int:
    return item


@celery.task(name="examples.flask_orders.ship")
def ship(outcome: dict[str, Any], order_id: int) -> str:
    return f"order {order_id}: {outcome['succeeded']} items picked"


def place_order(items: int) -> Order:
    """One transaction: the order row, then the batch and its children; the caller commits."""
    order = Order(items=items)
    db.session.add(order)
    db.session.flush()  # the order's id, for the children's arguments
    handle = fan_in_group(
        [pick_item.s(order.id, i) for i in range(items)], then=ship.s(order.id), app=celery
    ).apply_async(transaction=db.session)
    order.batch_id = handle.batch_id
    return order


def create_app(database_url: str = DATABASE_URL) -> Flask:
    app = Flask(__name__)
    app.config["SQLALCHEMY_DATABASE_URI"] = database_url
    db.init_app(app)

    @app.post("/orders")
    def new_order() -> Any:
        items = int((request.get_json(silent=True) or {}).get("items", 0))
        if items < 1:
            abort(400, "an order needs at least one item")
        order = place_order(items)
        if request.args.get("fail_after_write"):  # the request fails after the fan-in was created: nothing stays
            db.session.rollback()
            abort(500, "the order could not be saved")
        db.session.commit()  # the order, the batch and its children together; then the children are published
        return jsonify({"order": order.id, "batch_id": order.batch_id}), 201

    return app
