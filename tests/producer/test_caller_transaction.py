"""`apply_async(transaction=...)` with a SQLAlchemy Connection: the batch commits or rolls back with the caller's
transaction, nothing is published before the commit, and the relay publishes it after (a bare Connection has no
after-commit hook). Bad uses are refused before anything is written."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis
from celery import Celery
from sqlalchemy import Connection, Engine, text

from celery_fanin import FanIn, InvalidFanIn, fan_in_group
from celery_fanin.relay import Relay
from tests.store.helpers import Tasks, make_engine


@pytest.fixture
def caller(clean_db: str) -> Iterator[Connection]:
    """The application's own connection to the same database, in a transaction of its own."""
    engine = make_engine(clean_db)
    with engine.connect() as conn:
        conn.begin()
        yield conn
    engine.dispose()


def _counts(engine: Engine) -> tuple[int, int, int]:
    with engine.connect() as conn:
        row = conn.execute(
            text(
                "SELECT (SELECT count(*) FROM fanin_batches), (SELECT count(*) FROM fanin_children),"
                " coalesce((SELECT sum(published_upto) FROM fanin_batches), 0)"
            )
        ).one()
    return int(row[0]), int(row[1]), int(row[2])


def test_committed_with_the_caller_and_published_by_the_relay(
    app: Celery, tasks: Tasks, store_engine: Engine, broker: redis.Redis, caller: Connection
) -> None:
    handle = fan_in_group([tasks.add.s(i, i) for i in range(3)], then=tasks.collect.s()).apply_async(transaction=caller)
    assert _counts(store_engine) == (0, 0, 0) and broker.llen("celery") == 0  # not committed: invisible
    caller.commit()
    assert _counts(store_engine) == (1, 3, 0) and broker.llen("celery") == 0  # nobody said it committed
    Relay(FanIn.of(app)).run_once()
    assert _counts(store_engine) == (1, 3, 3) and broker.llen("celery") == 3
    assert handle.batch_status().planned == 3


def test_rolled_back_with_the_caller(
    app: Celery, tasks: Tasks, store_engine: Engine, broker: redis.Redis, caller: Connection
) -> None:
    first = fan_in_group([tasks.add.s(1, 1)], then=tasks.collect.s(), key="once").apply_async(transaction=caller)
    again = fan_in_group([tasks.add.s(1, 1)], then=tasks.collect.s(), key="once").apply_async(transaction=caller)
    assert (again.batch_id, again.id) == (first.batch_id, first.id)  # the same key: the batch written first
    caller.rollback()
    Relay(FanIn.of(app)).run_once()
    assert _counts(store_engine) == (0, 0, 0) and broker.llen("celery") == 0


def test_bad_uses_are_refused_before_anything_is_written(
    app: Celery, tasks: Tasks, store_engine: Engine, caller: Connection, database_url: str
) -> None:
    plan = fan_in_group([tasks.add.s(1, 1)], then=tasks.collect.s())
    with pytest.raises(InvalidFanIn, match="must be a SQLAlchemy Session or Connection"):
        plan.apply_async(transaction="the session")
    with pytest.raises(InvalidFanIn, match="needs a list of children"):
        fan_in_group((s for s in [tasks.add.s(1, 1)]), then=tasks.collect.s()).apply_async(transaction=caller)
    other = make_engine(database_url.rsplit("/", 1)[0] + "/postgres")
    try:
        with other.connect() as elsewhere, pytest.raises(InvalidFanIn, match="but fanin_database_url names"):
            plan.apply_async(transaction=elsewhere)
    finally:
        other.dispose()
    app.conf.task_always_eager = True
    try:
        with pytest.raises(InvalidFanIn, match="task_always_eager"):
            plan.apply_async(transaction=caller)
    finally:
        app.conf.task_always_eager = False
    caller.commit()
    assert _counts(store_engine) == (0, 0, 0)
