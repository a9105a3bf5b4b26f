"""A successor's lifecycle across Celery's surface, end to end: retry, autoretry with backoff, retries exhausted,
Ignore, Task.replace (a task or a chain), Reject(requeue=True), and a child that replaces itself. Real prefork
workers, the relay, Redis and PostgreSQL.

Each test asserts what the successor's body itself recorded (it ran to its end exactly once) and the state the
store ended in, and that the relay's stall detector finds nothing to run again afterwards.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import redis

from celery_fanin import FanIn, fan_in_group
from celery_fanin.relay.maintenance import restart_stalled_successors
from tests import app as tasks

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(150)]

Runs = Callable[[str], list[dict[str, Any]]]


def _attempts(producer: Any, kind: str, batch_id: str) -> int:
    return int(redis.Redis.from_url(producer.conf.broker_url).get(f"e2e:{kind}:{batch_id}") or 0)


def _nothing_to_rerun(producer: Any) -> None:
    """Even with no timeout at all, the stall detector finds no successor of a finished batch to run again."""
    fanin = FanIn.of(producer)
    saved = {k: producer.conf.get(k) for k in ("fanin_successor_timeout", "fanin_successor_lease_grace")}
    producer.conf.update(dict.fromkeys(saved, 0))
    try:
        assert restart_stalled_successors(fanin) == []
    finally:
        producer.conf.update(saved)


def test_a_successor_that_retries_at_once_finishes(producer: Any, processes: Any, successor_runs: Runs) -> None:
    """Celery publishes the retry before the attempt's task_postrun; the retry must be admitted, not refused."""
    processes.worker(concurrency=2)
    processes.relay()
    handle = fan_in_group([tasks.ok.s(1)], then=tasks.retrying_successor.s("retry", 3)).apply_async()
    status = handle.wait_batch(timeout=60)
    assert status.successor_state == "succeeded"
    assert (status.successor_runs, status.successor_duplicates) == (4, 0)
    assert _attempts(producer, "retrying_successor", handle.batch_id) == 4
    assert [r["label"] for r in successor_runs(handle.batch_id)] == ["retry"]
    assert handle.result == 3, "the last attempt ran as Celery's retry number 3"
    _nothing_to_rerun(producer)


def test_autoretry_with_backoff_finishes_and_exhausted_retries_fail_for_good(
    producer: Any, processes: Any, successor_runs: Runs
) -> None:
    processes.worker(concurrency=2)
    processes.relay()
    recovers = fan_in_group([tasks.ok.s(1)], then=tasks.autoretry_successor.s("recovers", 2)).apply_async()
    gives_up = fan_in_group([tasks.ok.s(2)], then=tasks.autoretry_successor.s("gives-up", 10)).apply_async()

    status = recovers.wait_batch(timeout=60)
    assert (status.successor_state, status.successor_runs) == ("succeeded", 3)
    assert recovers.result == 2
    assert len(successor_runs(recovers.batch_id)) == 1

    status = gives_up.wait_batch(timeout=60)
    assert (status.successor_state, status.successor_runs) == ("failed", 4)  # max_retries=3: four attempts
    assert _attempts(producer, "autoretry_successor", gives_up.batch_id) == 4
    assert successor_runs(gives_up.batch_id) == []
    _nothing_to_rerun(producer)


def test_a_successor_that_raises_ignore_is_final_and_never_rerun(
    producer: Any, processes: Any, successor_runs: Runs
) -> None:
    processes.worker()
    processes.relay()
    handle = fan_in_group([tasks.ok.s(1)], then=tasks.ignoring_successor.s("ignored")).apply_async()
    status = handle.wait_batch(timeout=60)
    assert (status.successor_state, status.successor_runs) == ("ignored", 1)
    _nothing_to_rerun(producer)
    assert len(successor_runs(handle.batch_id)) == 1


@pytest.mark.parametrize("as_chain", [False, True], ids=["task", "chain"])
def test_a_replaced_successor_ends_with_its_replacement(
    producer: Any, processes: Any, successor_runs: Runs, as_chain: bool
) -> None:
    processes.worker(concurrency=2)
    processes.relay()
    handle = fan_in_group([tasks.ok.s(1)], then=tasks.replacing_successor.s("swap", as_chain)).apply_async()
    status = handle.wait_batch(timeout=60)
    assert status.successor_state == "succeeded"
    assert status.successor_runs == 2 and status.successor_duplicates == 0  # the original, then its replacement
    assert _attempts(producer, "replacing_successor", handle.batch_id) == 1, "the original ran once"
    assert [r["label"] for r in successor_runs(handle.batch_id)] == ["swap-replacement"]
    assert handle.result == {"label": "swap-replacement", "succeeded": 1, "failed": 0}
    _nothing_to_rerun(producer)


def test_a_successor_rejected_with_requeue_runs_on_its_redelivery(
    producer: Any, processes: Any, successor_runs: Runs
) -> None:
    processes.worker(concurrency=2)
    processes.relay()
    handle = fan_in_group([tasks.ok.s(1)], then=tasks.requeueing_successor.s("requeued")).apply_async()
    status = handle.wait_batch(timeout=60)
    assert (status.successor_state, status.successor_runs) == ("succeeded", 2)
    assert [r["label"] for r in successor_runs(handle.batch_id)] == ["requeued"]
    _nothing_to_rerun(producer)


def test_children_that_replace_themselves_are_counted_with_their_replacements_outcome(
    producer: Any, processes: Any, successor_runs: Runs
) -> None:
    processes.worker(concurrency=2)
    processes.relay()
    handle = fan_in_group(
        [tasks.replacing_child.s(i) for i in range(4)], then=tasks.record_run.s("replaced", with_values=True)
    ).apply_async()
    status = handle.wait_batch(timeout=60)
    assert (status.succeeded, status.failed, status.remaining) == (4, 0, 0)
    runs = successor_runs(handle.batch_id)
    assert len(runs) == 1
    assert runs[0]["values"] == [0, 10, 20, 30]
