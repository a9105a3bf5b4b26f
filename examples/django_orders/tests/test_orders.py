"""The how-to's claims, with pytest-django as it comes (no `django_db_setup` of our own): its test database gets the
fan-in schema from `migrate` (`celery_fanin.django`), celery-fanin follows Django to it, and the fan-in commits or
rolls back with the order (transaction=True: Django's `on_commit` runs only when a transaction really commits)."""

from __future__ import annotations

import os

import psycopg
import pytest
import redis
from django.db import connection, transaction
from sqlalchemy.engine import make_url

from celery_fanin import FanIn
from celery_fanin.store.migrate import available
from examples.django_orders.orders.models import Order
from examples.django_orders.orders.services import place_order

pytestmark = pytest.mark.django_db(transaction=True)


def _other_session() -> psycopg.Connection:
    """A session of its own on the database Django uses now (pytest-django's test database)."""
    conf = connection.settings_dict
    return psycopg.connect(
        dbname=conf["NAME"], user=conf["USER"], host=conf["HOST"], port=conf["PORT"], autocommit=True
    )


def _committed() -> tuple[int, int]:
    """Batches and children another session sees."""
    with _other_session() as conn:
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


def test_celery_fanin_follows_django_to_its_test_database_migrated_by_migrate() -> None:
    from examples.django_orders import celery_app

    url = make_url(FanIn.of(celery_app).database_url)  # CELERY_FANIN_DJANGO_DATABASE, through the CELERY_ namespace
    assert url.database == connection.settings_dict["NAME"] and url.database.startswith("test_")
    with _other_session() as conn:
        row = conn.execute("SELECT max(version) FROM fanin_migrations").fetchone()
    assert row is not None and row[0] == available()[-1].version
    assert "orders.ship" in celery_app.tasks  # autodiscovered


def test_a_django_database_that_does_not_exist_is_a_clear_error() -> None:
    from celery import Celery

    from celery_fanin.exceptions import FanInNotConfigured

    app = Celery("misnamed", set_as_current=False)
    app.conf.fanin_django_database = "replica"
    with pytest.raises(FanInNotConfigured, match="Django has no database 'replica'"):
        FanIn(app).database_url  # noqa: B018 - the property is what raises
