"""docs/how-to/flask.md's example (examples/flask_orders.py), run: an order and its fan-in in one
Flask-SQLAlchemy transaction, the children on the broker only after the commit, nothing after a rollback, and the
relay publishing them when the process dies between the commit and its own publishing."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import redis

from celery_fanin import FanIn
from celery_fanin.relay import Relay

ROOT = Path(__file__).resolve().parents[2]


def _sqlalchemy_url(url: str) -> str:
    return url.replace("postgresql://", "postgresql+psycopg://", 1)


@pytest.fixture
def example(e2e_env: dict[str, str]) -> Iterator[Any]:
    """The example module, its Celery app pointed at the session's database and a queue of the test's own."""
    from examples import flask_orders

    queue = f"flask-orders-{uuid.uuid4().hex[:8]}"
    conf = flask_orders.celery.conf
    before = {k: conf[k] for k in ("fanin_database_url", "broker_url", "task_default_queue")}
    conf.update(
        fanin_database_url=_sqlalchemy_url(e2e_env["FANIN_DATABASE_URL"]),
        broker_url=e2e_env["FANIN_TEST_BROKER"],
        task_default_queue=queue,
    )
    app = flask_orders.create_app(_sqlalchemy_url(e2e_env["FANIN_DATABASE_URL"]))
    with app.app_context():
        flask_orders.db.drop_all()
        flask_orders.db.create_all()
    flask_orders.queue = queue  # type: ignore[attr-defined]
    flask_orders.app = app  # type: ignore[attr-defined]
    yield flask_orders
    with app.app_context():
        flask_orders.db.engine.dispose()
    FanIn.of(flask_orders.celery).dispose()
    conf.update(before)
    flask_orders.celery._pool = None


def _queued(env: dict[str, str], queue: str) -> int:
    return int(redis.Redis.from_url(env["FANIN_TEST_BROKER"]).llen(queue))


def _rows(env: dict[str, str]) -> tuple[int, int, int]:
    """Orders, batches and children as another session sees them (committed rows only)."""
    with psycopg.connect(env["FANIN_DATABASE_URL"], autocommit=True) as conn:
        row = conn.execute(
            'SELECT (SELECT count(*) FROM "order"), (SELECT count(*) FROM fanin_batches),'
            " (SELECT count(*) FROM fanin_children)"
        ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1]), int(row[2])


def test_the_fan_in_commits_with_the_order_and_is_published_after_it(e2e_env: dict[str, str], example: Any) -> None:
    with example.app.test_request_context():
        order = example.place_order(3)
        # Written in the session's transaction: invisible to any other session, and nothing on the broker yet.
        assert _rows(e2e_env) == (0, 0, 0) and _queued(e2e_env, example.queue) == 0
        example.db.session.commit()
        assert _rows(e2e_env) == (1, 1, 3)
        assert _queued(e2e_env, example.queue) == 3  # published by the session's after_commit
        assert order.batch_id is not None
    response = example.app.test_client().post("/orders", json={"items": 2})
    assert response.status_code == 201 and _rows(e2e_env) == (2, 2, 5) and _queued(e2e_env, example.queue) == 5


def test_a_rolled_back_request_leaves_no_order_no_batch_and_publishes_nothing(
    e2e_env: dict[str, str], example: Any
) -> None:
    response = example.app.test_client().post("/orders?fail_after_write=1", json={"items": 3})
    assert response.status_code == 500
    Relay(FanIn.of(example.celery)).run_once(maintenance=True)  # the relay finds nothing to publish either
    assert _rows(e2e_env) == (0, 0, 0) and _queued(e2e_env, example.queue) == 0


def test_the_relay_publishes_when_the_process_dies_between_commit_and_publishing(
    e2e_env: dict[str, str], example: Any
) -> None:
    """A listener registered before the fan-in's runs first and kills the process: the commit happened, the
    producer's publishing never did. The relay publishes the children, once."""
    script = textwrap.dedent(
        f"""
        import os
        from sqlalchemy import event
        from examples import flask_orders
        conf = flask_orders.celery.conf
        conf.fanin_database_url = {_sqlalchemy_url(e2e_env["FANIN_DATABASE_URL"])!r}
        conf.broker_url = {e2e_env["FANIN_TEST_BROKER"]!r}
        conf.task_default_queue = {example.queue!r}
        app = flask_orders.create_app(conf.fanin_database_url)
        with app.app_context():
            event.listen(flask_orders.db.session(), "after_commit", lambda session: os._exit(0))
            flask_orders.place_order(4)
            flask_orders.db.session.commit()
        raise SystemExit("the after_commit listener did not run")
        """
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert _rows(e2e_env) == (1, 1, 4) and _queued(e2e_env, example.queue) == 0
    Relay(FanIn.of(example.celery)).run_once()
    assert _queued(e2e_env, example.queue) == 4
    Relay(FanIn.of(example.celery)).run_once()
    assert _queued(e2e_env, example.queue) == 4  # once
