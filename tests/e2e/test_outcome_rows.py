"""The outcome-table rows of README.md and docs/concepts/terminal-outcomes.md that need a message or a signal the
tasks of test_outcomes.py cannot produce: an undecodable message, `Ignore` and `Reject(requeue=True)`, the hard
time limit's double report, and `revoke(terminate=True)` on a child that is known to be running.

Real prefork workers, the relay and Postgres; where the broker's handling differs (decoding, requeueing), on Redis
and on RabbitMQ.
"""

from __future__ import annotations

import pickle
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from kombu import Connection, Exchange, Producer, Queue

from celery_fanin import fan_in_group
from celery_fanin.protocol import HEADER_INDEX
from tests import app as tasks
from tests.e2e.brokers import BROKERS, broker_env, worker_on
from tests.e2e.helpers import finished
from tests.sql import env_rows
from tests.workers import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

Runs = Callable[[str], list[dict[str, Any]]]


__all__ = ["broker_env"]  # the `e2e_env` fixture, on the broker each test is parametrized with
_worker = worker_on


def _attempts(env: dict[str, str], key: str) -> int:
    rows = env_rows(env, "SELECT n FROM e2e_attempts WHERE key = %s", key)
    return int(rows[0][0]) if rows else 0


def _child(env: dict[str, str], batch_id: str, index: int) -> dict[str, Any]:
    rows = env_rows(
        env,
        "SELECT state, late_state, late_reports, exc_type, exc_message FROM fanin_children "
        "WHERE batch_id = %s AND idx = %s",
        batch_id,
        index,
    )
    state, late_state, late_reports, exc_type, exc_message = rows[0]
    return {
        "state": state,
        "late_state": late_state,
        "late_reports": late_reports,
        "exc_type": exc_type,
        "exc_message": exc_message,
    }


# --- a message the worker cannot decode ----------------------------------------------------------------------------


def _take_held(env: dict[str, str], queue: str, count: int) -> list[Any]:
    """Take `count` messages off `queue` (which no worker consumes), as the producer published them."""
    taken: list[Any] = []
    with Connection(env["FANIN_TEST_BROKER"]) as conn:
        channel = conn.default_channel

        def more() -> bool:
            message = channel.basic_get(queue=queue, no_ack=True)
            if message is not None:
                taken.append(message)
            return len(taken) == count

        wait_for(more, 20, message=f"{count} messages on {queue}")
    return sorted(taken, key=lambda m: int(m.headers[HEADER_INDEX]))


def _republish(env: dict[str, str], message: Any, body: bytes, content_type: str, content_encoding: str) -> None:
    """Publish `message`'s headers and properties (the child's task id and fan-in headers) with another body, on
    the queue the worker consumes."""
    queue = env["FANIN_TEST_QUEUE"]
    exchange = Exchange(queue, "direct")
    with Connection(env["FANIN_TEST_BROKER"]) as conn:
        Producer(conn.default_channel).publish(
            body,
            exchange=exchange,
            routing_key=queue,
            declare=[Queue(queue, exchange, routing_key=queue)],
            headers=dict(message.headers),
            content_type=content_type,
            content_encoding=content_encoding,
            correlation_id=message.properties.get("correlation_id"),
        )


@BROKERS
def test_undecodable_children_are_counted_rejected(
    e2e_env: dict[str, str], producer: Any, processes: Any, successor_runs: Runs
) -> None:
    """A body in a serializer the worker does not accept, and a corrupt body: headers readable, both `rejected`."""
    hold = f"{e2e_env['FANIN_TEST_QUEUE']}-hold"
    _worker(processes, e2e_env)
    processes.relay()
    children = [tasks.ok.s(0).set(queue=hold), tasks.ok.s(1).set(queue=hold), tasks.ok.s(2)]
    handle = fan_in_group(children, then=tasks.record_run.s("undecodable")).apply_async()
    disallowed, corrupt = _take_held(e2e_env, hold, 2)
    _republish(e2e_env, disallowed, pickle.dumps(((0,), {}, {})), "application/x-python-serialize", "binary")
    _republish(e2e_env, corrupt, b'{"not": json', "application/json", "utf-8")

    outcome = finished(handle, successor_runs)["outcome"]
    assert (outcome["planned"], outcome["succeeded"], outcome["failed"]) == (3, 1, 2)
    failures = {f["index"]: (f["state"], f["exc_type"]) for f in outcome["failures"]}
    assert failures == {0: ("rejected", "ContentDisallowed"), 1: ("rejected", "DecodeError")}
    for index in (0, 1):
        assert _child(e2e_env, handle.batch_id, index)["late_reports"] == 0


# --- Ignore and Reject(requeue=True): not terminal ----------------------------------------------------------------


@BROKERS
def test_ignore_and_reject_requeue_without_acks_late_are_not_counted(
    e2e_env: dict[str, str], producer: Any, processes: Any, successor_runs: Runs
) -> None:
    """Both end the attempt without a terminal outcome; without acks_late nothing redelivers, so the batch waits."""
    _worker(processes, e2e_env, concurrency=1)
    processes.relay()
    ignored, requeued = f"ignore-{uuid.uuid4().hex[:8]}", f"requeue-{uuid.uuid4().hex[:8]}"
    children = [tasks.ignore_child.s(ignored), tasks.reject_requeue.s(requeued), tasks.ok.s(2)]
    handle = fan_in_group(children, then=tasks.record_run.s("not-terminal")).apply_async()
    wait_for(
        lambda: _attempts(e2e_env, ignored) == 1 and _attempts(e2e_env, requeued) == 1, 30, message="both bodies to run"
    )
    # One pool process: a batch sent now runs after both, so their task_postrun hooks have run when it is done.
    after = fan_in_group([tasks.ok.s(3)], then=tasks.record_run.s("after")).apply_async()
    finished(after, successor_runs)

    status = handle.batch_status()
    assert (status.planned, status.succeeded, status.failed, status.remaining) == (3, 1, 0, 2)
    assert status.successor_state is None
    for index in (0, 1):
        child = _child(e2e_env, handle.batch_id, index)
        assert child["state"] in ("pending", "started"), child
        assert child["late_reports"] == 0
    assert (_attempts(e2e_env, ignored), _attempts(e2e_env, requeued)) == (1, 1)  # and nothing ran them again
    assert successor_runs(handle.batch_id) == []


@BROKERS
def test_reject_requeue_with_acks_late_counts_the_redelivered_success_once(
    e2e_env: dict[str, str], producer: Any, processes: Any, successor_runs: Runs
) -> None:
    _worker(processes, e2e_env, extra_env={"FANIN_TEST_ACKS_LATE": "1"})
    processes.relay()
    key = f"requeue-once-{uuid.uuid4().hex[:8]}"
    children = [tasks.reject_requeue_once.s(key), tasks.ok.s(1)]
    handle = fan_in_group(children, then=tasks.record_run.s("requeued-once")).apply_async()
    outcome = finished(handle, successor_runs)["outcome"]
    assert (outcome["planned"], outcome["succeeded"], outcome["failed"]) == (2, 2, 0)
    assert _attempts(e2e_env, key) == 2  # the rejected run and the redelivered one
    child = _child(e2e_env, handle.batch_id, 0)
    assert (child["state"], child["late_reports"]) == ("succeeded", 0)


# --- the hard time limit's double report ---------------------------------------------------------------------------


def test_hard_time_limit_double_report_is_counted_once_and_the_second_recorded_late(
    e2e_env: dict[str, str], producer: Any, processes: Any, successor_runs: Runs
) -> None:
    """Celery 5.7 fires task_failure twice for a hard time limit (the second without a request)."""
    processes.worker()
    processes.relay()
    children = [tasks.sleepy.s(30).set(time_limit=1), tasks.ok.s(1)]
    handle = fan_in_group(children, then=tasks.record_run.s("hard-limit")).apply_async()
    outcome = finished(handle, successor_runs)["outcome"]
    assert (outcome["planned"], outcome["succeeded"], outcome["failed"]) == (2, 1, 1)
    child = wait_for(
        lambda: (c := _child(e2e_env, handle.batch_id, 0))["late_reports"] >= 1 and c,
        10,
        message="the second report",
    )
    assert (child["state"], child["exc_type"], child["late_state"], child["late_reports"]) == (
        "time_limit",
        "TimeLimitExceeded",
        "time_limit",
        1,
    )


# --- revoke(terminate=True) on a running child ---------------------------------------------------------------------


def test_revoke_terminate_of_a_started_child_counts_it_revoked_terminated(
    e2e_env: dict[str, str], producer: Any, processes: Any, successor_runs: Runs
) -> None:
    processes.worker()
    processes.relay()
    key = f"terminate-{uuid.uuid4().hex[:8]}"
    children = [tasks.mark_then_sleep.s(key, 60), tasks.ok.s(1)]
    handle = fan_in_group(children, then=tasks.record_run.s("terminated")).apply_async()
    wait_for(lambda: _attempts(e2e_env, key) == 1, 30, message="the child's body to begin")
    task_id = env_rows(e2e_env, "SELECT task_id FROM fanin_children WHERE batch_id = %s AND idx = 0", handle.batch_id)[
        0
    ][0]
    producer.control.revoke(task_id, terminate=True)  # SIGTERM to the pool process running it
    outcome = finished(handle, successor_runs)["outcome"]
    assert (outcome["planned"], outcome["succeeded"], outcome["failed"]) == (2, 1, 1)
    assert [(f["index"], f["state"], f["exc_message"]) for f in outcome["failures"]] == [(0, "revoked", "terminated")]
    assert _attempts(e2e_env, key) == 1
    child = _child(e2e_env, handle.batch_id, 0)
    assert (child["state"], child["exc_message"], child["late_reports"]) == ("revoked", "terminated", 0)
