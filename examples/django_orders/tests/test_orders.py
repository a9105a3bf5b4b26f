"""The how-to's claims, with pytest-django: the fan-in commits or rolls back with the order (transaction=True:
Django's `on_commit` runs only when a transaction really commits)."""

from __future__ import annotations

import os

import psycopg
import pytest
import redis
from django.db import transaction

from examples.django_orders.orders.models import Order
from examples.django_orders.orders.services import place_order

pytestmark = pytest.mark.django_db(transaction=True)


def _committed() -> tuple[int, int]:
    """Batches and children another session sees."""
    with psycopg.connect(os.environ["FANIN_DATABASE_URL"], autocommit=True) as conn:
        row = conn.execute("SELECT (SELECT count(*) FROM fanin_batches), (SELECT count(*) FROM fanin_children)")
        counts = row.fetchone()
    assert counts is not None
    return int(counts[0]), int(counts[1])


def _queued() -> int:
    return int(redis.Redis.from_url(os.environ["FANIN_BROKER_URL"]).llen(os.environ["FANIN_EXAMPLE_QUEUE"]))


def test_the_fan_in_commits_with_the_order_and_is_published_on_commit() -> None:
    (batches, children), queued = _committed(), _queued()
    with transaction.atomic():  # an outer block: nothing commits until it ends
        order = place_order(3)
        assert _committed() == (batches, children) and _queued() == queued
    assert _committed() == (batches + 1, children + 3) and _queued() == queued + 3
    assert Order.objects.get(pk=order.pk).batch_id == order.batch_id


def test_a_rollback_takes_the_batch_with_it() -> None:
    before, queued = _committed(), _queued()
    with pytest.raises(RuntimeError), transaction.atomic():
        place_order(2)
        raise RuntimeError("the order could not be saved")
    assert Order.objects.count() == 0 and _committed() == before and _queued() == queued


def test_the_settings_reach_celery_fanin_through_the_celery_namespace() -> None:
    from django.conf import settings

    from examples.django_orders import celery_app

    assert celery_app.conf.fanin_database_url == settings.CELERY_FANIN_DATABASE_URL
    assert "orders.ship" in celery_app.tasks  # autodiscovered
