"""Children with Celery's own options, end to end on Redis and RabbitMQ with real workers and a relay.

- `link` / `link_error` callbacks run and are not counted; the child is counted with its own outcome.
- `countdown` / `eta`: the child runs when due, and child_timeout is measured from when it may run.
- A `chain(...)` child is counted when the chain's last task ends, with that task's outcome; a failure in any of
  its tasks counts the child as failed with that error (as a chord counts a chain in its header).
- A child whose `expires` passed before any worker took it is counted `revoked` (expired) within a bounded time,
  also on RabbitMQ, where the broker drops the message unconsumed and no worker ever sees it.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from celery import Celery, chain
from kombu import Connection

from celery_fanin import FanIn, fan_in_group
from celery_fanin.exceptions import InvalidFanIn
from tests.app import NOTES_TABLE_DDL
from tests.e2e.helpers import sig
from tests.sql import children as child_rows
from tests.sql import notes, row_count
from tests.workers import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

RABBITMQ_URL = "amqp://guest:guest@127.0.0.1:5672//"


@pytest.fixture(params=["redis", "rabbitmq"])
def broker_env(request: pytest.FixtureRequest, e2e_env: dict[str, str]) -> Iterator[dict[str, str]]:
    """The workers' and relay's environment on one broker, with a queue of this test's own."""
    queue = f"fanin-children-{uuid.uuid4().hex[:10]}"
    env = {**e2e_env, "FANIN_TEST_QUEUE": queue}
    if request.param == "rabbitmq":
        env["FANIN_TEST_BROKER"] = RABBITMQ_URL
    with psycopg.connect(env["FANIN_DATABASE_URL"], autocommit=True) as conn:
        conn.execute(NOTES_TABLE_DDL)
        conn.execute("TRUNCATE e2e_notes")
    yield env
    if request.param == "rabbitmq":
        with Connection(RABBITMQ_URL) as conn, contextlib.suppress(Exception):  # never declared: nothing to clean
            conn.default_channel.queue_delete(queue)


@pytest.fixture
def app(broker_env: dict[str, str]) -> Iterator[Celery]:
    """A producer app of the test's own on the test's broker and queue (tasks are named, not imported)."""
    application = Celery("tests.app", broker=broker_env["FANIN_TEST_BROKER"], set_as_current=False)
    application.conf.update(
        fanin_database_url=broker_env["FANIN_DATABASE_URL"],
        task_default_queue=broker_env["FANIN_TEST_QUEUE"],
        broker_connection_retry_on_startup=False,
    )
    FanIn(application)
    yield application
    FanIn.of(application).dispose()


def _all_expired(env: dict[str, str], batch_id: str) -> bool:
    """Every expiring child's `expires` has passed, by the database's clock (as the relay reads it)."""
    with psycopg.connect(env["FANIN_DATABASE_URL"], autocommit=True) as conn:
        row = conn.execute(
            "SELECT bool_and(expires_at < now()) FROM fanin_children WHERE batch_id = %s AND expires_at IS NOT NULL",
            (uuid.UUID(batch_id),),
        ).fetchone()
    return bool(row and row[0])


def test_link_countdown_and_chain_children_are_counted_once_with_the_right_outcome(
    app: Celery, broker_env: dict[str, str], processes: Any, successor_runs: Any
) -> None:
    processes.worker(broker_env)
    processes.relay(broker_env)
    ok, fail = (lambda *a: sig(app, "ok", *a)), (lambda *a: sig(app, "fail", *a))
    children = [
        chain(ok(1), ok(), ok()),  # 0: 1 -> 10 -> 100 -> 1000
        chain(ok(1), fail(), ok()),  # 1: the middle task fails; the last never runs
        chain(ok(2), fail()),  # 2: the last task fails
        ok(3).set(link=sig(app, "note", label="link")),  # 3: its callback runs with its value, uncounted
        fail(4).set(link_error=sig(app, "note", label="errback")),  # 4: its errback runs with its task id
        ok(5).set(countdown=2),  # 5: runs once due
        ok(6).set(countdown=9),  # 6: due after child_timeout would have passed since the batch's creation
        chain(ok(7), ok()).set(countdown=1),  # 7: the chain's options go to its first task
    ]
    started = time.time()
    handle = fan_in_group(
        children, then=sig(app, "record_run", "children", with_values=True), app=app, child_timeout=6
    ).apply_async()
    status = handle.wait_batch(timeout=60)
    assert status.successor_state == "succeeded", status
    assert (status.planned, status.succeeded, status.failed) == (8, 5, 3), status
    runs = successor_runs(handle.batch_id)
    assert len(runs) == 1
    outcome, values = runs[0]["outcome"], runs[0]["values"]
    failures = {f["index"]: f for f in outcome["failures"]}
    assert sorted(failures) == [1, 2, 4], outcome["failures"]
    assert (failures[1]["state"], failures[1]["exc_type"]) == ("failed", "ValueError")
    assert failures[1]["exc_message"] == "child 10 failed on purpose"  # the middle task's error
    assert failures[2]["exc_message"] == "child 20 failed on purpose"
    assert failures[4]["exc_message"] == "child 4 failed on purpose"
    assert values == [1000, 30, 50, 60, 700]  # children 0, 3, 5, 6, 7: the chains' last tasks' values
    rows = child_rows(broker_env, handle.batch_id, "idx", "state", "exc_type", "exc_message", "late_reports")
    assert [r["late_reports"] for r in rows] == [0] * 8, rows  # each reported once: earlier tasks report nothing
    assert time.time() - started >= 9  # child 6 ran when due, and was not counted lost before
    noted = wait_for(lambda: len(notes(broker_env)) >= 2 and notes(broker_env), 20, message="both callbacks")
    labels = dict(noted)
    assert labels["link"] == 30
    with psycopg.connect(broker_env["FANIN_DATABASE_URL"], autocommit=True) as conn:
        failed_id = conn.execute(
            "SELECT task_id FROM fanin_children WHERE batch_id = %s AND idx = 4", (uuid.UUID(handle.batch_id),)
        ).fetchone()
    assert failed_id is not None and labels["errback"] == failed_id[0]  # the errback got the failed child's id
    assert len(noted) == 2


def test_a_child_expired_before_any_worker_took_it_is_counted_revoked(
    app: Celery, broker_env: dict[str, str], processes: Any, successor_runs: Any
) -> None:
    """RabbitMQ drops the expired message unconsumed (no task_revoked); Redis delivers it and the worker revokes
    it. Either way the child is counted `revoked` (expired) once, within the grace plus a reaper interval."""
    # The sweep waits fanin_expires_grace + fanin_report_timeout past `expires` (a start may be retried that long).
    processes.relay({**broker_env, "FANIN_TEST_EXPIRES_GRACE": "1", "FANIN_TEST_REPORT_TIMEOUT": "1"})
    handle = fan_in_group(
        [
            sig(app, "ok", 1).set(expires=1),
            sig(app, "ok", 2),
            chain(sig(app, "ok", 3), sig(app, "ok")).set(expires=1),
        ],
        then=sig(app, "record_run", "expired"),
        app=app,
        child_timeout=None,
    ).apply_async()
    wait_for(lambda: _all_expired(broker_env, handle.batch_id), 10, message="the children's expiry")
    processes.worker(broker_env)  # only now: the expiring messages were never taken by a worker in time
    status = handle.wait_batch(timeout=30)
    assert status.successor_state == "succeeded", status
    rows = child_rows(broker_env, handle.batch_id, "idx", "state", "exc_type", "exc_message", "late_reports")
    assert [r["state"] for r in rows] == ["revoked", "succeeded", "revoked"], rows
    assert rows[0]["exc_message"] == rows[2]["exc_message"] == "expired"
    assert len(successor_runs(handle.batch_id)) == 1


def test_a_chain_child_holding_a_group_is_refused_before_anything_is_written(app: Celery) -> None:
    from celery import group

    bad = [
        chain(sig(app, "ok", 1), group(sig(app, "ok"), sig(app, "ok"))),
        chain(),
    ]
    for child in bad:
        with pytest.raises(InvalidFanIn, match="chain"):
            fan_in_group([sig(app, "ok", 0), child], then=sig(app, "record_run", "x"), app=app).apply_async()
    with pytest.raises(InvalidFanIn, match="expires"):
        fan_in_group([sig(app, "ok", 0).set(expires="soon")], then=sig(app, "record_run", "x"), app=app).apply_async()
    assert row_count(app, "fanin_batches") == 0
