"""The worker whose report created a successor publishes it itself, right after that commit
(`fanin_worker_publishes_successors`, default on); the relay is the fallback for a worker that dies in between.

Real prefork workers, PostgreSQL, and Redis or RabbitMQ. Without a relay, a batch's successor still runs (every kind:
`then`, `on_failure`, a tree's, one whose outcome lists failures) and its outbox row is sent; with the setting off,
nothing publishes it until a relay starts; a pool process killed between the commit and the publish leaves the row
to the relay, and the successor runs once; with workers and a relay side by side, every successor is published
once and runs once.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

import pytest

from celery_fanin import fan_in_group
from tests import app as tasks
from tests.e2e.brokers import BROKERS, broker_env, worker_on
from tests.sql import env_rows
from tests.sql import successor as successor_row
from tests.workers import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

Runs = Callable[[str], list[dict[str, Any]]]
__all__ = ["broker_env"]  # the `e2e_env` fixture, on the broker each test is parametrized with


@pytest.fixture(autouse=True)
def _published(e2e_env: dict[str, str]) -> None:
    """These tests are about publishing: with `fanin_successor_inline` (the default) the worker that completed a
    batch runs its successor with no message (tests/e2e/test_inline_successor.py), so it is turned off here."""
    e2e_env["FANIN_TEST_SUCCESSOR_INLINE"] = "0"


def _outbox(env: dict[str, str], batch_id: str) -> list[tuple[Any, ...]]:
    """The batch's outbox rows: (sent, attempts)."""
    return env_rows(env, "SELECT sent_at IS NOT NULL, attempts FROM fanin_outbox WHERE batch_id = %s", batch_id)


def _state_runs_kind(env: dict[str, str], batch_id: str) -> tuple[Any, ...] | None:
    found = successor_row(env, batch_id, "state", "runs", "kind")
    return tuple(found.values()) if found is not None else None


def _published_by(worker: Any) -> list[str]:
    """The batches whose successor this worker published (its log's line for each)."""
    return re.findall(r"published successor batch_id=([0-9a-f-]{36})", worker.output())


def _stays(condition: Callable[[], bool], seconds: float, message: str) -> None:
    """`condition` holds throughout `seconds` (checked every 50 ms): what the relay's absence must leave as it is."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert condition(), message
        time.sleep(0.05)


@BROKERS
def test_without_a_relay_the_worker_publishes_every_kind_of_successor(
    e2e_env: dict[str, str], processes: Any, successor_runs: Runs
) -> None:
    worker = worker_on(processes, e2e_env, concurrency=2)  # and no relay
    plain = fan_in_group([tasks.ok.s(i) for i in range(3)], then=tasks.record_run.s("plain", True)).apply_async()
    # a tree: the last leaf's completion settles its root, which creates the successor
    tree = fan_in_group([tasks.ok.s(i) for i in range(5)], then=tasks.record_run.s("tree"), max_width=2).apply_async()
    failures = fan_in_group([tasks.ok.s(0), tasks.fail.s(1)], then=tasks.record_run.s("failures")).apply_async()
    threshold = fan_in_group(
        [tasks.fail.s(0), tasks.sleepy.s(30)],
        then=tasks.record_run.s("then"),
        on_failure=tasks.record_run.s("on-failure"),
        max_failures=0,
    ).apply_async()

    for handle, label in ((plain, "plain"), (tree, "tree"), (failures, "failures"), (threshold, "on-failure")):
        status = handle.wait_batch(timeout=60)
        assert (status.successor_state, status.successor_runs, status.successor_duplicates) == ("succeeded", 1, 0)
        [run] = successor_runs(handle.batch_id)
        assert run["label"] == label
        assert _outbox(e2e_env, handle.batch_id) == [(True, 1)], "published once, by the worker, and marked sent"
    assert successor_runs(plain.batch_id)[0]["values"] == [0, 10, 20], "the outcome was built from the child rows"
    outcome = successor_runs(failures.batch_id)[0]["outcome"]
    assert (outcome["succeeded"], outcome["failed"], [f["index"] for f in outcome["failures"]]) == (1, 1, [1])
    assert threshold.batch_status().state == "failed_threshold"
    assert _state_runs_kind(e2e_env, threshold.batch_id) == ("succeeded", 1, "on_failure")
    # The child still running when the threshold passed was abandoned by the worker's publish, as the relay does.
    assert env_rows(
        e2e_env, "SELECT state FROM fanin_children WHERE batch_id = %s AND idx = 1", threshold.batch_id
    ) == [("abandoned",)]
    published = _published_by(worker)
    assert sorted(published) == sorted(h.batch_id for h in (plain, tree, failures, threshold))


@BROKERS
def test_with_the_setting_off_the_successor_waits_for_a_relay(
    e2e_env: dict[str, str], processes: Any, successor_runs: Runs
) -> None:
    worker = worker_on(processes, e2e_env, extra_env={"FANIN_TEST_WORKER_PUBLISHES": "0"})
    handle = fan_in_group([tasks.ok.s(i) for i in range(2)], then=tasks.record_run.s("relayed")).apply_async()
    wait_for(lambda: _state_runs_kind(e2e_env, handle.batch_id), 30, message="the last report to create the successor")
    # Nothing publishes it without the relay: the worker that would have (test above) within milliseconds does not.
    _stays(
        lambda: (
            _state_runs_kind(e2e_env, handle.batch_id) == ("pending", 0, "then")
            and _outbox(e2e_env, handle.batch_id) == [(False, 0)]
        ),
        2.0,
        "published with fanin_worker_publishes_successors off and no relay",
    )
    assert successor_runs(handle.batch_id) == []
    processes.relay()
    status = handle.wait_batch(timeout=30)
    assert (status.successor_state, status.successor_runs) == ("succeeded", 1)
    assert len(successor_runs(handle.batch_id)) == 1
    assert _outbox(e2e_env, handle.batch_id) == [(True, 1)]
    assert _published_by(worker) == []


@BROKERS
def test_a_worker_killed_between_commit_and_publish_leaves_the_successor_to_the_relay(
    e2e_env: dict[str, str], processes: Any, successor_runs: Runs
) -> None:
    # The pool process that ran the last child is SIGKILLed where it would publish (tests/app.py's hook): after the
    # report that created the successor committed, before any claim of its outbox row.
    worker = worker_on(processes, e2e_env, extra_env={"FANIN_TEST_DIE_BEFORE_SUCCESSOR_PUBLISH": "1"}, concurrency=1)
    handle = fan_in_group([tasks.ok.s(0)], then=tasks.record_run.s("after-kill")).apply_async()
    wait_for(
        lambda: re.search(r"signal 9|SIGKILL|WorkerLostError", worker.output()),
        30,
        message="the pool process to be killed",
    )
    assert handle.batch_status().state == "complete", "the report committed before the kill"
    assert _state_runs_kind(e2e_env, handle.batch_id) == ("pending", 0, "then")
    assert _outbox(e2e_env, handle.batch_id) == [(False, 0)], "nothing published it, nothing claims it"
    assert successor_runs(handle.batch_id) == []

    processes.relay()  # its scan finds the unsent row (no NOTIFY was sent for it)
    status = handle.wait_batch(timeout=30)
    assert (status.successor_state, status.successor_runs, status.successor_duplicates) == ("succeeded", 1, 0)
    assert len(successor_runs(handle.batch_id)) == 1
    assert _outbox(e2e_env, handle.batch_id) == [(True, 1)]


@BROKERS
def test_a_worker_slower_than_the_handoff_and_the_relay_both_publish_and_the_successor_runs_once(
    e2e_env: dict[str, str], processes: Any, successor_runs: Runs
) -> None:
    # The handoff is 1 s, and the pool process that reads its handed-off successor waits 4 s before publishing it
    # (tests/app.py's hook): the relay publishes it meanwhile, the worker's copy follows, and the guard refuses it.
    worker = worker_on(
        processes,
        e2e_env,
        extra_env={"FANIN_TEST_SUCCESSOR_HANDOFF": "1", "FANIN_TEST_SLOW_SUCCESSOR_PUBLISH": "4"},
        concurrency=2,
    )
    relay = processes.relay()
    handle = fan_in_group([tasks.ok.s(0)], then=tasks.record_run.s("slow-publisher")).apply_async()
    wait_for(lambda: relay.relay.stats.successors_published == 1, 30, message="the relay to publish past the handoff")
    wait_for(lambda: _published_by(worker) == [handle.batch_id], 30, message="the slow worker to publish its copy")
    wait_for(
        lambda: handle.batch_status().successor_duplicates == 1, 30, message="the second copy refused by the guard"
    )
    status = handle.batch_status()
    assert (status.successor_state, status.successor_runs) == ("succeeded", 1)
    assert len(successor_runs(handle.batch_id)) == 1, "the body ran once"
    assert _outbox(e2e_env, handle.batch_id)[0][0], "marked sent"


@BROKERS
def test_workers_and_a_relay_side_by_side_publish_and_run_each_successor_once(
    e2e_env: dict[str, str], processes: Any, successor_runs: Runs
) -> None:
    workers = [worker_on(processes, e2e_env, concurrency=4) for _ in range(2)]
    relay = processes.relay()
    n = 40
    handles = [
        fan_in_group([tasks.ok.s(i), tasks.ok.s(i + 1)], then=tasks.record_run.s(f"many-{b}")).apply_async()
        for b, i in enumerate(range(n))
    ]
    for handle in handles:
        status = handle.wait_batch(timeout=60)
        assert (status.successor_state, status.successor_runs, status.successor_duplicates) == ("succeeded", 1, 0)
        assert len(successor_runs(handle.batch_id)) == 1, handle.batch_id
        assert _outbox(e2e_env, handle.batch_id) == [(True, 1)], handle.batch_id
    by_workers = [b for w in workers for b in _published_by(w)]
    assert len(by_workers) == len(set(by_workers)), "no successor published by two workers"
    by_relay = relay.relay.stats.successors_published
    assert len(by_workers) + by_relay == n, "each successor published once, by a worker or the relay"
    assert len(by_workers) > 0, "the workers published (the relay is the fallback)"
