"""Every terminal path of a child, end to end: real prefork workers, the relay, Redis and Postgres.

Each test asserts what the successor body itself recorded: it ran exactly once, with the right counts and the
right failure list.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from celery_fanin import fan_in_group
from tests import app as tasks
from tests.e2e.helpers import finished
from tests.workers import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

Runs = Callable[[str], list[dict[str, Any]]]


def test_all_succeed_with_results_in_child_order(producer: Any, processes: Any, successor_runs: Runs) -> None:
    processes.worker()
    processes.relay()
    handle = fan_in_group(
        [tasks.ok.s(i) for i in range(50)], then=tasks.record_run.s("all", with_values=True), step="assemble"
    ).apply_async()
    run = finished(handle, successor_runs)
    assert run["outcome"]["step"] == "assemble"
    assert (run["outcome"]["planned"], run["outcome"]["succeeded"], run["outcome"]["failed"]) == (50, 50, 0)
    assert run["outcome"]["failures"] == []
    assert run["values"] == [i * 10 for i in range(50)]


def test_mix_of_failures_lists_each_failed_child(producer: Any, processes: Any, successor_runs: Runs) -> None:
    processes.worker()
    processes.relay()
    children = [tasks.fail.s(i) if i % 4 == 0 else tasks.ok.s(i) for i in range(20)]
    handle = fan_in_group(children, then=tasks.record_run.s("mix")).apply_async()
    outcome = finished(handle, successor_runs)["outcome"]
    assert (outcome["succeeded"], outcome["failed"]) == (15, 5)
    assert [f["index"] for f in outcome["failures"]] == [0, 4, 8, 12, 16]
    first = outcome["failures"][0]
    assert first["state"] == "failed"
    assert first["exc_type"] == "ValueError"
    assert first["exc_message"] == "child 0 failed on purpose"
    assert first["task_name"] == "tests.app.fail"
    assert first["task_id"]


def test_retries_then_success_count_once(producer: Any, processes: Any, successor_runs: Runs) -> None:
    processes.worker()
    processes.relay()
    handle = fan_in_group([tasks.flaky.s(i, 2) for i in range(6)], then=tasks.record_run.s("flaky")).apply_async()
    outcome = finished(handle, successor_runs)["outcome"]
    assert (outcome["succeeded"], outcome["failed"]) == (6, 0)


def test_retries_exhausted_count_as_failure(producer: Any, processes: Any, successor_runs: Runs) -> None:
    processes.worker()
    processes.relay()
    children = [tasks.flaky.s(0, 10), tasks.always_retry.s(1), tasks.ok.s(2)]
    handle = fan_in_group(children, then=tasks.record_run.s("exhausted")).apply_async()
    outcome = finished(handle, successor_runs)["outcome"]
    assert (outcome["succeeded"], outcome["failed"]) == (1, 2)
    by_index = {f["index"]: f for f in outcome["failures"]}
    assert by_index[0]["exc_type"] == "ConnectionError"  # autoretry re-raises the original error at the end
    assert by_index[1]["exc_type"] == "MaxRetriesExceededError"


def test_hard_time_limit_and_soft_time_limit(producer: Any, processes: Any, successor_runs: Runs) -> None:
    processes.worker()
    processes.relay()
    children = [
        tasks.sleepy.s(30).set(time_limit=1),
        tasks.sleepy.s(30).set(soft_time_limit=1),
        tasks.ok.s(2),
    ]
    handle = fan_in_group(children, then=tasks.record_run.s("timelimit")).apply_async()
    outcome = finished(handle, successor_runs)["outcome"]
    assert (outcome["succeeded"], outcome["failed"]) == (1, 2)
    by_index = {f["index"]: f for f in outcome["failures"]}
    assert by_index[0]["state"] == "time_limit" and by_index[0]["exc_type"] == "TimeLimitExceeded"
    assert by_index[1]["state"] == "time_limit" and by_index[1]["exc_type"] == "SoftTimeLimitExceeded"


def test_pool_process_killed_counts_as_worker_lost(producer: Any, processes: Any, successor_runs: Runs) -> None:
    processes.worker()
    processes.relay()
    handle = fan_in_group([tasks.die.s(0), tasks.ok.s(1)], then=tasks.record_run.s("killed")).apply_async()
    outcome = finished(handle, successor_runs)["outcome"]
    assert (outcome["succeeded"], outcome["failed"]) == (1, 1)
    assert outcome["failures"][0]["state"] == "worker_lost"
    assert outcome["failures"][0]["exc_type"] == "WorkerLostError"


def test_main_process_forgets_each_child_once_celery_lets_its_request_go(
    producer: Any, processes: Any, successor_runs: Runs
) -> None:
    """The main process keeps a child's headers only for a main-process failure: a child that succeeded leaves none."""
    processes.worker()
    processes.relay()
    handle = fan_in_group([tasks.ok.s(i) for i in range(200)], then=tasks.record_run.s("forget")).apply_async()
    finished(handle, successor_runs)

    def markers() -> int:
        replies = producer.control.broadcast("fanin_received_markers", reply=True, timeout=5)
        assert len(replies) == 1, replies
        return int(next(iter(replies[0].values()))["markers"])

    # 201 while the children and the successor were in flight; none once Celery released their requests.
    wait_for(lambda: markers() == 0, timeout=30, interval=0.5, message="the worker to forget its finished requests")


def test_pool_process_killed_with_acks_late_is_requeued_not_counted(
    producer: Any, processes: Any, successor_runs: Runs
) -> None:
    processes.worker(extra_env={"FANIN_TEST_ACKS_LATE": "1"})
    processes.relay()
    handle = fan_in_group([tasks.die_once.s(7), tasks.ok.s(1)], then=tasks.record_run.s("requeued")).apply_async()
    outcome = finished(handle, successor_runs)["outcome"]
    assert (outcome["succeeded"], outcome["failed"]) == (2, 0)


def test_revoked_expired_and_terminated(producer: Any, processes: Any, successor_runs: Runs) -> None:
    processes.worker()
    processes.relay()
    children = [
        tasks.ok.s(0).set(expires=1),  # expires before the worker gets to it: see the countdown below
        tasks.sleepy.s(60),
        tasks.ok.s(2),
    ]
    children[0] = children[0].set(countdown=2)
    handle = fan_in_group(children, then=tasks.record_run.s("revoked")).apply_async()

    def running_child() -> str | None:
        from sqlalchemy import text

        from celery_fanin import FanIn

        with FanIn.of(producer).engine.connect() as conn:
            return conn.execute(
                text("SELECT task_id FROM fanin_children WHERE batch_id = :b AND idx = 1"), {"b": handle.batch_id}
            ).scalar_one()

    task_id = wait_for(running_child, 10, message="child 1 row")
    # give the worker the time to start it; terminate works on a running task and revoke on a queued one alike
    wait_for(lambda: handle.batch_status().remaining <= 2, 20, message="the quick child to finish")
    producer.control.revoke(task_id, terminate=True, signal="SIGKILL")
    outcome = finished(handle, successor_runs)["outcome"]
    assert (outcome["succeeded"], outcome["failed"]) == (1, 2)
    states = {f["index"]: f["state"] for f in outcome["failures"]}
    assert states == {0: "revoked", 1: "revoked"}


def test_rejected_without_requeue(producer: Any, processes: Any, successor_runs: Runs) -> None:
    processes.worker()
    processes.relay()
    handle = fan_in_group([tasks.reject.s(0), tasks.ok.s(1)], then=tasks.record_run.s("reject")).apply_async()
    outcome = finished(handle, successor_runs)["outcome"]
    assert (outcome["succeeded"], outcome["failed"]) == (1, 1)
    assert outcome["failures"][0]["state"] == "rejected"


def test_unregistered_task_name(producer: Any, processes: Any, successor_runs: Runs) -> None:
    processes.worker()
    processes.relay()
    children = [producer.signature("tests.app.no_such_task", args=(1,)), tasks.ok.s(1)]
    handle = fan_in_group(children, then=tasks.record_run.s("unknown")).apply_async()
    outcome = finished(handle, successor_runs)["outcome"]
    assert (outcome["succeeded"], outcome["failed"]) == (1, 1)
    assert outcome["failures"][0]["state"] == "unknown"
    assert outcome["failures"][0]["task_name"] == "tests.app.no_such_task"


def test_empty_group_dispatches_successor_at_once(producer: Any, processes: Any, successor_runs: Runs) -> None:
    processes.worker()
    handle = fan_in_group([], then=tasks.record_run.s("empty")).apply_async()  # no relay: the producer sends it
    outcome = finished(handle, successor_runs, timeout=30)["outcome"]
    assert (outcome["planned"], outcome["succeeded"], outcome["failed"]) == (0, 0, 0)


def test_unknown_successor_ends_visibly_failed(producer: Any, processes: Any) -> None:
    processes.worker()
    processes.relay()
    handle = fan_in_group([tasks.ok.s(1)], then=producer.signature("tests.app.no_such_successor")).apply_async()
    status = handle.wait_batch(timeout=30)
    assert status.successor_state == "failed"


def test_failing_successor_is_recorded_failed(producer: Any, processes: Any, successor_runs: Runs) -> None:
    processes.worker()
    processes.relay()
    handle = fan_in_group([tasks.ok.s(1)], then=tasks.failing_successor.s("boom")).apply_async()
    status = handle.wait_batch(timeout=30)
    assert status.successor_state == "failed"
    assert len(successor_runs(handle.batch_id)) == 1
    assert status.successor_runs == 1
