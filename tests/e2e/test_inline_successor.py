"""A completed batch's successor run in the pool process whose report completed it (`fanin_successor_inline`,
celery_fanin/dispatch/inline.py), and every case where it must go through the broker instead.

Real `celery worker` subprocesses (prefork, and threads for a revoke), Redis and PostgreSQL. Whether a successor
went through the broker is read from the worker's own log: Celery's main process logs "Task <name>[<id>]
received" for every message it takes, and an inline successor is no message. (On by default: the tests that are
about publishing turn it off, tests/e2e/test_successor_publish.py.)
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

from celery_fanin import fan_in_group
from tests import app as tasks
from tests.e2e.helpers import finished
from tests.sql import attempts, open_gate, rows
from tests.workers import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

Runs = Callable[[str], list[dict[str, Any]]]
INLINE = {"FANIN_TEST_SUCCESSOR_INLINE": "1"}


def _received(worker: Any, name: str, task_id: str) -> bool:
    return f"Task tests.app.{name}[{task_id}] received" in worker.output()


def _ran_in(run: dict[str, Any]) -> int:
    return int(run["label"].rpartition("@")[2])


def _sent(producer: Any, batch_id: str) -> bool:
    found = rows(producer, "SELECT sent_at FROM fanin_outbox WHERE batch_id = :b", b=batch_id)
    return len(found) == 1 and found[0].sent_at is not None


def test_the_successor_runs_in_the_process_that_reported_the_last_child(
    producer: Any, processes: Any, successor_runs: Runs
) -> None:
    worker = processes.worker(INLINE, concurrency=2)
    processes.relay()
    handle = fan_in_group([tasks.pid_of.s(0)], then=tasks.pid_successor.s("here")).apply_async()
    run = finished(handle, successor_runs, timeout=30)
    assert [_ran_in(run)] == run["values"], "the successor ran in the child's own pool process"
    assert not _received(worker, "pid_successor", handle.successor_task_id), "it was never a message"
    status = handle.batch_status()
    assert (status.successor_runs, status.successor_duplicates) == (1, 0)
    assert handle.result == _ran_in(run), "its return value is the successor's result, as for a delivered one"
    # Marked sent by the run guard's thread once admitted: the relay never publishes a copy of it.
    wait_for(lambda: _sent(producer, handle.batch_id), 10, message="its outbox row marked sent")


def test_many_batches_each_run_their_successor_once_where_they_completed(
    producer: Any, processes: Any, successor_runs: Runs
) -> None:
    worker = processes.worker(INLINE, concurrency=4)
    processes.relay()
    handles = [
        fan_in_group([tasks.pid_of.s(i) for i in range(5)] + [tasks.fail.s(5)], then=tasks.pid_successor.s(f"b{n}"))
        .apply_async()
        for n in range(8)
    ]  # fmt: skip
    for handle in handles:
        status = handle.wait_batch(timeout=60)
        assert (status.succeeded, status.failed, status.successor_state) == (5, 1, "succeeded")
        assert (status.successor_runs, status.successor_duplicates) == (1, 0)
        runs = successor_runs(handle.batch_id)
        assert len(runs) == 1 and runs[0]["outcome"]["failed"] == 1  # the outcome with its failure, read here
        assert not _received(worker, "pid_successor", handle.successor_task_id)


@pytest.mark.parametrize(
    "case",
    ["setting off", "successor time limit", "child soft time limit", "successor acks_late", "countdown", "rate limit"],
)
def test_a_successor_that_cannot_run_where_its_batch_completed_is_published(
    producer: Any, processes: Any, successor_runs: Runs, case: str
) -> None:
    env = {"FANIN_TEST_SUCCESSOR_INLINE": "0"} if case == "setting off" else INLINE
    worker = processes.worker(env, concurrency=2)
    processes.relay()
    child, then, name = tasks.pid_of.s(0), tasks.pid_successor.s(case), "pid_successor"
    if case == "successor time limit":
        then = then.set(time_limit=30)
    elif case == "child soft time limit":
        child = child.set(soft_time_limit=30)
    elif case == "successor acks_late":
        then, name = tasks.pid_successor_acks_late.s(case), "pid_successor_acks_late"
    elif case == "countdown":
        then = then.set(countdown=0.2)
    elif case == "rate limit":  # ran inline, a rate-limited successor skipped the worker's token bucket
        then, name = tasks.pid_successor_rate_limited.s(case), "pid_successor_rate_limited"
    handle = fan_in_group([child], then=then).apply_async()
    finished(handle, successor_runs, timeout=30)
    assert _received(worker, name, handle.successor_task_id), "published, and delivered as a message"
    status = handle.batch_status()
    assert (status.successor_runs, status.successor_duplicates) == (1, 0)


def test_a_successor_whose_expires_passed_while_its_batch_ran_is_discarded_as_a_message_would_be(
    producer: Any, processes: Any, successor_runs: Runs
) -> None:
    """Its `expires` passed before the last child reported: published, and the worker discards the message and
    records the successor revoked, instead of the completing process running it."""
    worker = processes.worker(INLINE, concurrency=2)
    processes.relay()
    then = tasks.pid_successor.s("expired").set(expires=datetime.now(timezone.utc) + timedelta(seconds=1))
    handle = fan_in_group([tasks.sleepy.s(2)], then=then).apply_async()
    status = handle.wait_batch(timeout=30)
    assert (status.successor_state, status.successor_runs) == ("revoked", 0)
    assert successor_runs(handle.batch_id) == []
    assert _received(worker, "pid_successor", handle.successor_task_id), "published, and discarded as a message"


def test_a_successor_routed_to_another_workers_queue_runs_there(
    producer: Any, processes: Any, successor_runs: Runs
) -> None:
    here = processes.worker(INLINE, concurrency=2)
    other = processes.worker(INLINE, concurrency=1, extra=["-Q", "inline-other"])
    processes.relay()
    then = tasks.pid_successor.s("routed").set(queue="inline-other")
    handle = fan_in_group([tasks.pid_of.s(0)], then=then).apply_async()
    run = finished(handle, successor_runs, timeout=30)
    assert _received(other, "pid_successor", handle.successor_task_id)
    assert not _received(here, "pid_successor", handle.successor_task_id)
    assert [_ran_in(run)] != run["values"]


def test_a_successor_killed_in_its_body_here_runs_again_once_its_lease_lapsed(
    producer: Any, processes: Any, successor_runs: Runs
) -> None:
    """No message to redeliver: the killed run's lease lapses, the relay's stalled-successor scan publishes the
    successor again, and its guard admits that delivery as run 2, which runs the body to its end once."""
    lease = {"FANIN_TEST_SUCCESSOR_LEASE": "1", "FANIN_TEST_SUCCESSOR_LEASE_GRACE": "1"}
    worker = processes.worker({**INLINE, **lease}, concurrency=2)
    processes.relay(lease)
    handle = fan_in_group([tasks.ok.s(1)], then=tasks.successor_dies_once.s("phoenix")).apply_async()
    status = handle.wait_batch(timeout=60)
    assert (status.successor_state, status.successor_runs) == ("succeeded", 2)
    assert len(successor_runs(handle.batch_id)) == 1
    # The first run was the inline one (no message); the second, the relay's copy, was delivered.
    assert worker.output().count(f"successor_dies_once[{handle.successor_task_id}] received") == 1


@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_a_successor_revoked_before_its_batch_completed_is_not_run_where_it_completed(
    producer: Any, processes: Any, successor_runs: Runs, pool: str
) -> None:
    """The successor's task id revoked while its batch runs: it is published instead, and its worker discards the
    message and records it revoked, as with the setting off (tests/e2e/test_rerun.py). A prefork pool process reads
    the revoked ids its main process shares (`SharedRevoked`: the revoke came after the fork); a threads pool runs
    in the main process and reads the worker's own set."""
    worker = processes.worker(INLINE, pool=pool, concurrency=2)
    processes.relay()
    rows(producer, tasks.ATTEMPTS_DDL)
    key = f"inline-revoked-{uuid.uuid4().hex[:8]}"
    handle = fan_in_group([tasks.gated.s(key)], then=tasks.pid_successor.s("revoked")).apply_async()
    wait_for(lambda: attempts(producer, key) == 1, 30, message="the gated child to start")
    handle.revoke()  # the successor's task id
    open_gate(producer, key)
    wait_for(lambda: handle.batch_status().successor_state == "revoked", 30, message="the successor revoked")
    assert successor_runs(handle.batch_id) == []
    assert _received(worker, "pid_successor", handle.successor_task_id), "published, then discarded"


def test_a_worker_time_limit_given_on_its_command_line_publishes_the_successor(
    producer: Any, processes: Any, successor_runs: Runs
) -> None:
    """`celery worker --soft-time-limit 4` is not in `app.conf` (Celery keeps it on the WorkController and gives it
    to the pool per job): the child's job has it, and a successor run inside that job got what was left of the
    child's 4 s, failing with SoftTimeLimitExceeded 1.5 s into its body. Published, it gets its own 4 s."""
    worker = processes.worker(INLINE, concurrency=2, extra=["--soft-time-limit", "4"])
    processes.relay()
    handle = fan_in_group([tasks.sleepy.s(2.5)], then=tasks.slow_successor.s("cli-limit", 3)).apply_async()
    status = handle.wait_batch(timeout=60)
    assert (status.successor_state, status.successor_runs) == ("succeeded", 1)
    assert len(successor_runs(handle.batch_id)) == 1
    assert _received(worker, "slow_successor", handle.successor_task_id), "published, and delivered as a message"


def test_a_successor_routed_to_a_queue_its_worker_stopped_consuming_is_published(
    producer: Any, processes: Any, successor_runs: Runs
) -> None:
    """`cancel_consumer` changes the queues of the worker's main process only: a prefork pool process still held
    the set it was forked with and ran there a successor routed to the cancelled queue."""
    here = processes.worker(INLINE, concurrency=2, extra=["-Q", "celery,inline-cancelled"])
    replies = producer.control.cancel_consumer("inline-cancelled", destination=[here.name], reply=True, timeout=5)
    assert replies, "the worker stopped consuming the queue"
    other = processes.worker(INLINE, concurrency=1, extra=["-Q", "inline-cancelled"])
    processes.relay()
    then = tasks.pid_successor.s("cancelled").set(queue="inline-cancelled")
    handle = fan_in_group([tasks.pid_of.s(0)], then=then).apply_async()
    run = finished(handle, successor_runs, timeout=30)
    assert [_ran_in(run)] != run["values"], "not in the child's pool process"
    assert _received(other, "pid_successor", handle.successor_task_id), "run by the worker consuming its queue"


def test_a_rate_limit_set_at_runtime_by_control_command_publishes_the_successor(
    producer: Any, processes: Any, successor_runs: Runs
) -> None:
    """`celery control rate_limit` changes the task in the worker's main process only (its token bucket): a prefork
    pool process forked before it still held the task unlimited, and would run the successor where its batch
    completed, past the worker's bucket. Published, the main process throttles it."""
    worker = processes.worker(INLINE, concurrency=2)
    processes.relay()
    replies = producer.control.rate_limit(
        "tests.app.pid_successor", "600/m", destination=[worker.name], reply=True, timeout=5
    )
    assert replies and "ok" in next(iter(replies[0].values())), replies
    handle = fan_in_group([tasks.pid_of.s(0)], then=tasks.pid_successor.s("runtime rate limit")).apply_async()
    finished(handle, successor_runs, timeout=30)
    assert _received(worker, "pid_successor", handle.successor_task_id), "published, and delivered as a message"
    status = handle.batch_status()
    assert (status.successor_runs, status.successor_duplicates) == (1, 0)
