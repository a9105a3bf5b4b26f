"""A scheduled fan-in stored by django-celery-beat's DatabaseScheduler (issue 40, item 8): `fan_in_schedule`'s entry
is plain JSON, so it is a `PeriodicTask` row like any other; two ticks of it in one slot (two beats, or one
restarted) make one batch, as with Celery's own beat."""

from __future__ import annotations

import base64
import json
import os
from datetime import timedelta
from typing import Any

import pytest
import redis

from celery_fanin import FanIn, fan_in_group, fan_in_schedule

pytestmark = pytest.mark.django_db(transaction=True)


def _sent(queue: str) -> list[dict[str, Any]]:
    """The run_canvas messages on the example's queue (kombu's Redis transport: JSON with a base64 body)."""
    found = []
    for raw in redis.Redis.from_url(os.environ["FANIN_BROKER_URL"]).lrange(queue, 0, -1):
        message = json.loads(raw)
        if message["headers"].get("task") == "celery_fanin.run_canvas":
            _args, kwargs, _embed = json.loads(base64.b64decode(message["body"]))
            found.append(kwargs)
    return found


def test_a_scheduled_fan_in_is_a_periodic_task_row_and_makes_one_batch_per_slot() -> None:
    from django_celery_beat.models import IntervalSchedule, PeriodicTask
    from django_celery_beat.schedulers import DatabaseScheduler

    from examples.django_orders import celery_app

    plan = fan_in_group(
        [celery_app.signature("orders.pick_item", args=(7, i)) for i in range(2)],
        then=celery_app.signature("orders.ship", args=(7,)),
    )
    entry = fan_in_schedule("orders-hourly", plan, timedelta(hours=1))
    every_hour, _ = IntervalSchedule.objects.get_or_create(every=1, period=IntervalSchedule.HOURS)
    queue = os.environ["FANIN_EXAMPLE_QUEUE"]
    PeriodicTask.objects.create(
        name="orders-hourly",
        task=entry["task"],
        interval=every_hour,
        kwargs=json.dumps(entry["kwargs"]),  # plain JSON: what the DatabaseScheduler stores
        queue=queue,
    )
    scheduler = DatabaseScheduler(app=celery_app)
    stored = scheduler.schedule["orders-hourly"]
    assert stored.task == "celery_fanin.run_canvas" and stored.kwargs == json.loads(json.dumps(entry["kwargs"]))
    before = len(_sent(queue))
    for _ in range(2):  # two ticks of one slot: two beats, or a beat restarted within the hour
        scheduler.apply_async(stored, advance=False)
    sent = _sent(queue)[before:]
    assert len(sent) == 2 and all("sent_at" in k["slot"] for k in sent), "the publisher stamped each send time"
    # What a worker does with each message: the same slot, so the same key, so one batch.
    run_canvas = celery_app.tasks["celery_fanin.run_canvas"]
    made = {run_canvas.apply(kwargs=k, throw=True).get()["batch_id"] for k in sent}
    assert len(made) == 1
    with FanIn.of(celery_app).engine.connect() as conn:
        key = conn.exec_driver_sql(
            "SELECT key FROM fanin_batches WHERE id = %(id)s", {"id": next(iter(made))}
        ).scalar_one()
    assert key.startswith("beat:orders-hourly:") and key.endswith(":00:00+00:00"), key
