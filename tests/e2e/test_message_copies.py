"""Copies of a message against a live run, end to end (issue 38, holes 1 and 3): real prefork workers, the relay,
Redis and PostgreSQL.

- A successor replaced by a canvas (`then=chain(...)`, `self.replace(...)`) hands its run to the replacement's
  carrier: neither the stall scan (past `fanin_successor_timeout`) nor a copy of the original message (the relay's
  copy, a redelivery) runs the successor's body or its canvas again.
- A replaced successor whose replacement is lost (its first task's queue has no consumer) is recorded failed
  (`ReplacementLost`) once `fanin_replaced_timeout` passed, and its carrier, arriving after that, is refused.
- An expired copy of a running successor's or child's message, seen by a worker's main process (`task_revoked`
  with `expired=True`), ends nothing: the live run's result is the one kept, and the copy counts as a duplicate.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from celery import chain

from celery_fanin import fan_in_group
from celery_fanin.protocol import HEADER_BATCH, HEADER_INDEX, HEADER_STEP, HEADER_SUCCESSOR, HEADER_TASK
from tests import app as tasks
from tests.e2e.brokers import broker_env  # noqa: F401 - the fixture, on Redis: RabbitMQ drops an expired copy unseen
from tests.sql import attempts, open_gate, rows
from tests.sql import successor as successor_row
from tests.workers import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(150)]

# A successor's row as these tests read it.
COPIES = ("state", "runs", "duplicates", "task_id", "step", "carrier")


def test_a_successor_replaced_by_a_slow_chain_runs_once_past_the_stall_timeout(
    producer: Any, processes: Any, e2e_env: dict[str, str], successor_runs: Any
) -> None:
    """The issue's reproduction: `then=chain(slow, record)` whose first task takes 8 s, with a stall timeout of 3 s
    standing for the default 600 s. Before, the stall scan republished the original message every 3 s: the
    successor ran 3 times and launched 3 chains."""
    processes.worker(concurrency=3)
    processes.relay({**e2e_env, "FANIN_TEST_SUCCESSOR_TIMEOUT": "3"})
    key = f"slow-{producer.conf.task_default_queue}"
    canvas = chain(tasks.slow_step.s(key, 8), tasks.record_run.s("after-slow"))
    handle = fan_in_group([tasks.ok.s(1)], then=canvas).apply_async()
    wait_for(lambda: successor_runs(handle.batch_id), 60, message="the chain's last task")
    status = handle.wait_batch(timeout=30)
    assert status.successor_state == "succeeded"
    assert attempts(producer, key) == 1, "the replaced successor launched its chain again"
    assert [r["label"] for r in successor_runs(handle.batch_id)] == ["after-slow"]
    # The original, then the carrier: no third run, and no copy at all (nothing was republished).
    assert (status.successor_runs, status.successor_duplicates) == (2, 0)


def test_a_copy_of_a_replaced_successors_message_is_refused(producer: Any, processes: Any, successor_runs: Any) -> None:
    """While the replacement's chain runs (its first task holds; the successor is `replaced`), the relay publishes
    the original message again (as after a handoff, or as a broker redelivers it). Before, the copy was admitted,
    ran the successor's body again and launched its chain a second time; now it is refused and counted."""
    processes.worker(concurrency=3)
    processes.relay()
    key = f"gate-{producer.conf.task_default_queue}"
    canvas = chain(tasks.gated_step.s(key), tasks.record_run.s("carried"))
    handle = fan_in_group([tasks.ok.s(1)], then=canvas).apply_async()
    wait_for(lambda: attempts(producer, key) == 1, 60, message="the replacement's first task to start")
    row = successor_row(producer, handle.batch_id, *COPIES)
    assert (row["state"], row["carrier"] is not None) == ("replaced", True)
    # The relay's copy: its outbox row made unsent and due (the relay is woken by its scan).
    rows(
        producer,
        "UPDATE fanin_outbox SET sent_at = NULL, available_at = now() WHERE batch_id = :b",
        b=handle.batch_id,
    )
    wait_for(
        lambda: successor_row(producer, handle.batch_id, *COPIES)["duplicates"] == 1,
        30,
        message="the copy to be refused",
    )
    open_gate(producer, key)
    status = handle.wait_batch(timeout=30)
    assert status.successor_state == "succeeded"
    assert (status.successor_runs, status.successor_duplicates) == (2, 1)
    assert attempts(producer, key) == 1, "the original message ran the successor's canvas again"
    assert [r["label"] for r in successor_runs(handle.batch_id)] == ["carried"]


def test_a_lost_replacement_ends_its_successor_after_the_replaced_timeout(
    producer: Any, processes: Any, e2e_env: dict[str, str], successor_runs: Any
) -> None:
    """`then=chain(first, record)` whose first task goes to a queue no worker consumes: the carrier never comes.
    With `fanin_replaced_timeout` = 2 s the relay records the successor failed (ReplacementLost) and the batch ends.
    A worker for that queue, started afterwards, runs the first task; the carrier it publishes is refused."""
    processes.worker(concurrency=2)
    processes.relay({**e2e_env, "FANIN_TEST_REPLACED_TIMEOUT": "2"})
    key = f"lost-{producer.conf.task_default_queue}"
    elsewhere = f"{producer.conf.task_default_queue}-elsewhere"
    canvas = chain(tasks.gated_step.s(key).set(queue=elsewhere), tasks.record_run.s("carried-late"))
    handle = fan_in_group([tasks.ok.s(1)], then=canvas).apply_async()
    wait_for(
        lambda: (
            [
                r.state
                for r in rows(producer, "SELECT state FROM fanin_successors WHERE batch_id = :b", b=handle.batch_id)
            ]
            == ["failed"]
        ),
        60,
        message="the bound to end the successor",
    )
    row = successor_row(producer, handle.batch_id, "exc_type", "exc_message", "runs", "duplicates")
    assert row is not None and row["exc_type"] == "ReplacementLost"
    assert "fanin_replaced_timeout" in row["exc_message"]
    assert (row["runs"], row["duplicates"]) == (1, 0)
    status = handle.wait_batch(timeout=10)
    assert status.successor_state == "failed"
    # The lost replacement turns up: its first task runs, its carrier is refused, its body never runs.
    open_gate(producer, key)
    processes.worker(extra=["-Q", elsewhere])
    wait_for(lambda: attempts(producer, key) == 1, 60, message="the late replacement's first task")
    wait_for(
        lambda: successor_row(producer, handle.batch_id, *COPIES)["duplicates"] == 1,
        60,
        message="the late carrier refused",
    )
    assert successor_runs(handle.batch_id) == [], "a carrier after the bound ran"
    assert successor_row(producer, handle.batch_id, *COPIES)["state"] == "failed"


def _expired_copy(producer: Any, name: str, task_id: str, headers: dict[str, Any], args: list[Any]) -> None:
    """Publish a copy of a message under its task id, already past its `expires` (a stall republish behind a
    backlog, the relay's copy arriving late): the worker's main process revokes it as expired."""
    producer.send_task(
        name,
        args=args,
        task_id=task_id,
        headers=headers,
        expires=datetime.now(timezone.utc) - timedelta(minutes=1),
    )


def test_an_expired_copy_does_not_end_a_running_successor(producer: Any, processes: Any, successor_runs: Any) -> None:
    """Before, the copy's `task_revoked` recorded the successor `revoked` while its run went on; the run's real
    result was discarded (its finish was fenced off)."""
    processes.worker(concurrency=2)
    processes.relay()
    key = f"succ-{producer.conf.task_default_queue}"
    handle = fan_in_group([tasks.ok.s(1)], then=tasks.gated_successor.s("live", key)).apply_async()
    wait_for(lambda: attempts(producer, key) == 1, 60, message="the successor to start")
    row = successor_row(producer, handle.batch_id, *COPIES)
    _expired_copy(
        producer,
        tasks.gated_successor.name,
        row["task_id"],
        {HEADER_SUCCESSOR: handle.batch_id, HEADER_STEP: row["step"]},
        [{}, "copy", key],
    )
    wait_for(
        lambda: successor_row(producer, handle.batch_id, *COPIES)["duplicates"] == 1,
        30,
        message="the copy to be counted",
    )
    assert successor_row(producer, handle.batch_id, *COPIES)["state"] == "running"
    open_gate(producer, key)
    status = handle.wait_batch(timeout=30)
    assert (status.successor_state, status.successor_runs) == ("succeeded", 1)
    assert handle.result == {"label": "live", "succeeded": 1, "failed": 0}, "the live run's result was kept"


def test_an_expired_copy_does_not_end_a_started_child(producer: Any, processes: Any, successor_runs: Any) -> None:
    """A child running on one worker; an expired copy of its message reaches a worker's main process. Before, the
    copy counted the child `revoked` and its success arrived as a late report."""
    processes.worker(concurrency=2)
    processes.relay()
    key = f"child-{producer.conf.task_default_queue}"
    handle = fan_in_group([tasks.gated.s(key)], then=tasks.record_run.s("after-child")).apply_async()
    wait_for(lambda: attempts(producer, key) == 1, 60, message="the child to start")
    wait_for(
        lambda: (
            rows(producer, "SELECT state FROM fanin_children WHERE batch_id = :b", b=handle.batch_id)[0].state
            == "started"
        ),
        10,
        message="the child's start record",
    )
    [child] = rows(producer, "SELECT task_id, task_name FROM fanin_children WHERE batch_id = :b", b=handle.batch_id)
    _expired_copy(
        producer,
        child.task_name,
        child.task_id,
        {HEADER_BATCH: handle.batch_id, HEADER_INDEX: 0, HEADER_TASK: child.task_name},
        [key],
    )
    wait_for(
        lambda: (
            rows(producer, "SELECT duplicates FROM fanin_children WHERE batch_id = :b", b=handle.batch_id)[0].duplicates
            == 1
        ),
        30,
        message="the copy to be counted as a duplicate",
    )
    open_gate(producer, key)
    status = handle.wait_batch(timeout=30)
    assert (status.succeeded, status.failed) == (1, 0), status
    [after] = rows(producer, "SELECT state, late_reports FROM fanin_children WHERE batch_id = :b", b=handle.batch_id)
    assert (after.state, after.late_reports) == ("succeeded", 0)
    assert [r["label"] for r in successor_runs(handle.batch_id)] == ["after-child"]
