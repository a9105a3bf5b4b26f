"""The handle is an AsyncResult (issue 40): every chord idiom on a `FanInResult`, answered from PostgreSQL by real
workers with no result backend configured (tests/app.py sets none): `get`/`wait`, `result`/`info`,
`state`/`status`, `ready`/`successful`/`failed`, `traceback`, `date_done`, `name`, `forget`, and `parent`, the
children's view (`completed_count`, `revoke`)."""

from __future__ import annotations

import datetime
from typing import Any

import pytest
from celery import states
from celery.backends.base import DisabledBackend
from celery.exceptions import TaskRevokedError

from celery_fanin import FanInResult, fan_in_group
from tests import app as tasks
from tests.sql import attempts, open_gate, rows
from tests.workers import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


@pytest.fixture(autouse=True)
def _attempts_table(producer: Any) -> None:
    rows(producer, tasks.ATTEMPTS_DDL)  # where `gated` counts its runs and waits for its gate


def test_a_successful_fan_in_answers_as_a_chord_result_does(producer: Any, processes: Any) -> None:
    assert isinstance(producer.backend, DisabledBackend), "the point is answering without a result backend"
    processes.worker(concurrency=2)
    processes.relay()
    before = datetime.datetime.now(datetime.timezone.utc)
    handle = fan_in_group(
        [tasks.ok.s(i) for i in range(3)] + [tasks.fail.s(9)], then=tasks.sum_values.s()
    ).apply_async()
    assert handle.result is None and handle.info is None and handle.date_done is None  # nothing waits
    assert handle.wait(timeout=60) == 0 + 10 + 20  # Celery's alias of get (`ok` returns ten times its argument)
    assert handle.get(timeout=5) == 30 and handle.result == 30 and handle.info == 30
    assert handle.state == states.SUCCESS and handle.status == states.SUCCESS
    assert handle.ready() and handle.successful() and not handle.failed()
    assert handle.traceback is None
    assert handle.name == "tests.app.sum_values"
    done = handle.date_done
    assert done is not None and before <= done <= datetime.datetime.now(datetime.timezone.utc)
    children = handle.parent
    assert (len(children), children.completed_count(), children.finished_count()) == (4, 3, 4)
    assert children.ready() and not children.waiting() and children.failed() and not children.successful()
    status = handle.wait_batch(timeout=5)
    assert (status.succeeded, status.failed, status.successor_state) == (3, 1, "succeeded")
    with pytest.warns(DeprecationWarning, match="batch_status"):
        assert handle.status().succeeded == 3  # the batch's status before 0.1, still there for a while
    handle.forget()  # no result backend: nothing to forget, and no error
    assert FanInResult.restore(handle.batch_id, producer).get(timeout=5) == 30


def test_a_failed_successor_gives_its_error_and_traceback(producer: Any, processes: Any) -> None:
    processes.worker()
    processes.relay()
    handle = fan_in_group([tasks.ok.s(1)], then=tasks.failing_successor.s("handle")).apply_async()
    with pytest.raises(RuntimeError, match="failed on purpose"):
        handle.get(timeout=60)
    err = handle.get(timeout=5, propagate=False)
    assert isinstance(err, RuntimeError) and handle.result.args == err.args
    assert handle.state == states.FAILURE and handle.failed() and not handle.successful()
    trace = handle.traceback  # as its run raised it (tests/e2e/test_tracebacks.py: where else it shows)
    assert trace is not None and trace.rstrip().endswith("RuntimeError: the successor failed on purpose")
    assert handle.date_done is not None


def test_parent_revoke_revokes_the_unfinished_children_and_the_batch_goes_on(
    producer: Any, processes: Any, successor_runs: Any
) -> None:
    processes.worker(concurrency=1)  # the gated child holds the only pool process: the other two stay queued
    processes.relay()
    key = f"handle-{producer.conf.task_default_queue}"
    handle = fan_in_group(
        [tasks.gated.s(key), tasks.ok.s(1), tasks.ok.s(2)], then=tasks.record_run.s("after-revoke")
    ).apply_async()
    wait_for(lambda: attempts(producer, key) == 1, 60, message="the gated child to start")
    assert handle.state == states.PENDING and not handle.ready()
    revoked = handle.parent.revoke()
    assert len(revoked) == 3  # every unfinished child, the running one included
    open_gate(producer, key)  # the running one ends
    status = handle.wait_batch(timeout=60)
    assert (status.succeeded, status.failed, status.successor_state) == (1, 2, "succeeded")
    states_ = [
        r.state
        for r in rows(producer, "SELECT state FROM fanin_children WHERE batch_id = :b ORDER BY idx", b=handle.batch_id)
    ]
    assert states_ == ["succeeded", "revoked", "revoked"]
    assert [r["label"] for r in successor_runs(handle.batch_id)] == ["after-revoke"]


def test_a_batch_cancelled_before_its_successor_reads_as_a_revoked_task(
    producer: Any, processes: Any, successor_runs: Any
) -> None:
    processes.worker(concurrency=1)
    key = f"cancel-{producer.conf.task_default_queue}"
    handle = fan_in_group([tasks.gated.s(key)], then=tasks.record_run.s("never")).apply_async()
    wait_for(lambda: attempts(producer, key) == 1, 60, message="the gated child to start")
    handle.cancel()
    open_gate(producer, key)
    with pytest.raises(TaskRevokedError, match="cancelled"):
        handle.get(timeout=30)
    assert handle.state == states.REVOKED and handle.ready()
    assert isinstance(handle.result, TaskRevokedError) and handle.traceback is None
    assert handle.date_done is not None  # when the batch ended
