"""Recovery end to end: a successor delivered twice or killed, children that never report, deadlines,
failure thresholds and reconciliation, with real workers and the relay."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest

from celery_fanin import FanIn, fan_in_group
from celery_fanin.relay import Relay
from tests import app as tasks
from tests.e2e import clock
from tests.sql import drop_outbox, open_gate, rows, unsend_outbox
from tests.workers import RELAY_PUBLISHES, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(150)]

Runs = Callable[[str], list[dict[str, Any]]]


def test_duplicate_delivery_while_successor_runs_is_refused(
    producer: Any, processes: Any, successor_runs: Runs
) -> None:
    processes.worker(RELAY_PUBLISHES, concurrency=2)  # this test's relay rounds publish it
    handle = fan_in_group([tasks.ok.s(1)], then=tasks.slow_successor.s("slow", 3)).apply_async()
    relay = Relay(FanIn.of(producer))
    wait_for(lambda: relay.run_once() == 1, 20, message="the successor published")
    wait_for(lambda: handle.batch_status().successor_state == "running", 20, message="the successor running")
    # A second copy while the first runs (a broker redelivery, a relay that died before marking it sent).
    unsend_outbox(producer, handle.batch_id)
    assert relay.run_once() == 1
    status = handle.wait_batch(timeout=30)
    assert status.successor_state == "succeeded"
    assert status.successor_runs == 1 and status.successor_duplicates == 1
    assert len(successor_runs(handle.batch_id)) == 1


def test_successor_killed_mid_body_runs_again_on_redelivery(
    producer: Any, processes: Any, successor_runs: Runs
) -> None:
    processes.worker(extra_env={"FANIN_TEST_ACKS_LATE": "1"})
    processes.relay()
    handle = fan_in_group([tasks.ok.s(1)], then=tasks.successor_dies_once.s("phoenix")).apply_async()
    # acks_late redelivers at once, while the killed run's lease still looks live: the guard sees that its holder
    # is gone and admits the redelivery, far sooner than the lease (60 s) and its grace (60 s) would lapse.
    status = handle.wait_batch(timeout=30)
    assert status.successor_state == "succeeded"
    assert status.successor_runs == 2
    assert len(successor_runs(handle.batch_id)) == 1


def test_child_starts_are_recorded(producer: Any, processes: Any) -> None:
    processes.worker()
    handle = fan_in_group([tasks.sleepy.s(3)], then=tasks.record_run.s("started")).apply_async()
    row = wait_for(
        lambda: rows(
            producer,
            "SELECT state, attempt, starts, worker FROM fanin_children WHERE batch_id = :b AND state = 'started'",
            b=handle.batch_id,
        ),
        20,
        message="the child to be started",
    )[0]
    assert row.state == "started" and row.attempt == 0 and row.starts == 1 and row.worker.startswith("e2e-")


def test_child_never_delivered_is_counted_lost_and_its_late_report_is_not(
    producer: Any, processes: Any, successor_runs: Runs
) -> None:
    processes.worker()
    processes.relay()
    children = [tasks.ok.s(0), tasks.ok.s(1).set(queue="nobody-consumes-this")]
    handle = fan_in_group(children, then=tasks.record_run.s("lost"), child_timeout=clock.LONG).apply_async()
    clock.wait_finished(producer, handle.batch_id, {0})  # the healthy child is never raced by the timeout
    clock.expire_child_timeout(producer, handle.batch_id)
    status = handle.wait_batch(timeout=60)
    assert (status.succeeded, status.failed) == (1, 1)
    outcome = successor_runs(handle.batch_id)[0]["outcome"]
    assert outcome["failures"][0]["state"] == "lost" and outcome["failures"][0]["exc_type"] == "ChildLost"
    # The message turns up after all: a worker for that queue runs it, and its report is recorded as late.
    processes.worker(extra=["-Q", "nobody-consumes-this"])
    late = wait_for(
        lambda: rows(
            producer,
            "SELECT state, late_state, late_reports FROM fanin_children WHERE batch_id = :b "
            "AND idx = 1 AND late_reports > 0",
            b=handle.batch_id,
        ),
        30,
        message="the late report",
    )[0]
    assert (late.state, late.late_state) == ("lost", "revoked") or (late.state, late.late_state) == (
        "lost",
        "succeeded",
    )
    assert late.late_reports == 1  # its one delivery, reported once
    final = handle.batch_status()
    assert (final.succeeded, final.failed, final.remaining) == (1, 1, 0)
    assert len(successor_runs(handle.batch_id)) == 1


def test_child_lost_with_its_worker_is_redriven(producer: Any, processes: Any, successor_runs: Runs) -> None:
    first = processes.worker()
    processes.relay()
    children = [tasks.sleepy_once.s("redrive-me", 60, 0.1), tasks.ok.s(1)]
    handle = fan_in_group(
        children, then=tasks.record_run.s("redriven"), child_timeout=clock.LONG, on_lost="redrive"
    ).apply_async()
    wait_for(
        lambda: rows(
            producer,
            "SELECT 1 FROM fanin_children WHERE batch_id = :b AND idx = 0 AND state = 'started'",
            b=handle.batch_id,
        ),
        20,
        message="the long child to start",
    )
    clock.wait_finished(producer, handle.batch_id, {1})
    first.kill()  # the whole worker, main process included: without acks_late the message is gone
    # Past the timeout for the run that died with its worker; the redrive starts a new hour: exactly one redrive.
    clock.expire_child_timeout(producer, handle.batch_id)
    wait_for(
        lambda: rows(
            producer, "SELECT 1 FROM fanin_children WHERE batch_id = :b AND idx = 0 AND redrives = 1", b=handle.batch_id
        ),
        30,
        message="the lost child to be redriven",
    )
    processes.worker()
    status = handle.wait_batch(timeout=60)
    assert (status.succeeded, status.failed) == (2, 0)
    row = rows(
        producer, "SELECT redrives, starts FROM fanin_children WHERE batch_id = :b AND idx = 0", b=handle.batch_id
    )[0]
    # The redriven run ends sooner than starts are written: its terminal report carries its start.
    assert (row.redrives, row.starts) == (1, 2)
    assert len(successor_runs(handle.batch_id)) == 1


@pytest.mark.timeout(150)
def test_a_tree_child_redriven_after_its_worker_was_lost_hands_its_successor_to_the_worker_that_completes_it(
    producer: Any, processes: Any, successor_runs: Runs
) -> None:
    """A tree's children are rows of its leaves, and their messages name its root. The relay redrove a tree's lost
    child naming its leaf instead, so the report that completed the batch found no successor handed to it (the root
    holds the outbox row): the successor waited out the whole hand-off (600 s here) before the relay published it.
    The redriven copy names the root, as the producer's did."""
    env = {"FANIN_TEST_SUCCESSOR_HANDOFF": "600"}
    first = processes.worker(extra_env=env)
    processes.relay()
    key = f"redrive-tree-{uuid.uuid4().hex[:8]}"
    children = [tasks.sleepy_once.s(key, 60, 0.1), tasks.ok.s(1)]
    handle = fan_in_group(
        children, then=tasks.record_run.s("redriven-tree"), child_timeout=clock.LONG, on_lost="redrive", max_width=1
    ).apply_async()
    members = "batch_id IN (SELECT id FROM fanin_batches WHERE id = :b OR parent_id = :b)"
    assert rows(producer, "SELECT count(*) AS n FROM fanin_batches WHERE parent_id = :b", b=handle.batch_id)[0].n == 2
    wait_for(
        lambda: rows(
            producer,
            f"SELECT 1 FROM fanin_children WHERE {members} AND idx = 0 AND state = 'started'",
            b=handle.batch_id,
        ),
        20,
        message="the long child to start",
    )
    clock.wait_finished(producer, handle.batch_id, {1})
    first.kill()  # the whole worker: without acks_late the message is gone
    clock.expire_child_timeout(producer, handle.batch_id)
    wait_for(
        lambda: rows(
            producer, f"SELECT 1 FROM fanin_children WHERE {members} AND idx = 0 AND redrives = 1", b=handle.batch_id
        ),
        30,
        message="the lost child to be redriven",
    )
    processes.worker(extra_env=env)
    wait_for(
        lambda: successor_runs(handle.batch_id),
        45,
        message="the successor to run (handed to the worker whose report completed the batch, not after 600 s)",
    )
    status = handle.wait_batch(timeout=30)
    assert (status.succeeded, status.failed, status.successor_state, status.successor_runs) == (2, 0, "succeeded", 1)
    assert len(successor_runs(handle.batch_id)) == 1


def test_deadline_proceed_runs_successor_with_partial_outcome(
    producer: Any, processes: Any, successor_runs: Runs
) -> None:
    processes.worker()
    processes.relay()
    children = [tasks.ok.s(0), tasks.ok.s(1), tasks.ok.s(2).set(queue="nobody-consumes-this")]
    handle = fan_in_group(
        children, then=tasks.record_run.s("deadline"), deadline=timedelta(seconds=clock.LONG), child_timeout=0
    ).apply_async()
    clock.wait_finished(producer, handle.batch_id, {0, 1})  # the deadline never races the healthy children
    clock.pass_deadline(producer, handle.batch_id)
    status = handle.wait_batch(timeout=60)
    assert status.state == "partial"
    outcome = successor_runs(handle.batch_id)[0]["outcome"]
    assert outcome["partial"] is True and outcome["abandoned"] == 1
    assert (outcome["succeeded"], outcome["failed"]) == (2, 1)
    assert [(f["index"], f["state"]) for f in outcome["failures"]] == [(2, "abandoned")]


def test_deadline_abandon_runs_on_expire_only(producer: Any, processes: Any, successor_runs: Runs) -> None:
    processes.worker()
    processes.relay()
    children = [tasks.ok.s(0), tasks.ok.s(1).set(queue="nobody-consumes-this")]
    handle = fan_in_group(
        children,
        then=tasks.record_run.s("then"),
        deadline=timedelta(seconds=clock.LONG),
        on_deadline="abandon",
        on_expire=tasks.record_run.s("expired"),
        child_timeout=0,
    ).apply_async()
    clock.wait_finished(producer, handle.batch_id, {0})
    clock.pass_deadline(producer, handle.batch_id)
    status = handle.wait_batch(timeout=60)
    assert status.state == "expired"
    runs = successor_runs(handle.batch_id)
    assert [r["label"] for r in runs] == ["expired"]
    assert runs[0]["outcome"]["state"] == "expired"


def test_deadline_abandon_without_on_expire_is_visible(producer: Any, processes: Any) -> None:
    processes.relay()  # no worker at all: nothing will ever finish
    handle = fan_in_group(
        [tasks.ok.s(0)], then=tasks.record_run.s("never"), deadline=timedelta(seconds=1), on_deadline="abandon"
    ).apply_async()
    wait_for(lambda: handle.batch_status().state == "expired", 30, message="the batch to expire")
    status = handle.batch_status()
    assert status.successor_state is None and status.remaining == 0 and status.failed == 1


def test_failure_threshold_finishes_early_and_revokes_the_rest(
    producer: Any, processes: Any, successor_runs: Runs
) -> None:
    # The relay publishes `on_failure` and abandons the rest once the worker has moved on to `gated` (a worker that
    # published it itself would abandon and revoke `gated` too before taking it: tests/e2e/test_successor_publish.py).
    processes.worker(RELAY_PUBLISHES, concurrency=1)
    processes.relay()
    rows(producer, tasks.ATTEMPTS_DDL)
    gate = f"threshold-{uuid.uuid4().hex[:8]}"
    # One pool process: the two failures run first, then `gated` holds it until the worker has the revokes, so
    # exactly the seven children behind it are still queued when they arrive.
    children = [tasks.fail.s(0), tasks.fail.s(1), tasks.gated.s(gate), *[tasks.ok.s(i) for i in range(3, 10)]]
    handle = fan_in_group(
        children, then=tasks.record_run.s("then"), max_failures=1, on_failure=tasks.record_run.s("too-many")
    ).apply_async()
    # Not handle.wait(): the successor waits for the one pool process, which `gated` holds until the gate opens.
    wait_for(lambda: handle.batch_status().state == "failed_threshold", 60, message="the threshold")
    found = rows(producer, "SELECT task_id FROM fanin_children WHERE batch_id = :b AND idx >= 3", b=handle.batch_id)
    queued = {r.task_id for r in found}  # behind `gated`

    def revoked_by_the_worker() -> bool:
        replies = producer.control.inspect(timeout=2).revoked() or {}
        return queued <= {task_id for ids in replies.values() for task_id in ids}

    wait_for(revoked_by_the_worker, 30, interval=0.5, message="the worker to receive the revokes")
    open_gate(producer, gate)
    status = handle.wait_batch(timeout=60)
    assert status.state == "failed_threshold"
    runs = successor_runs(handle.batch_id)
    assert [r["label"] for r in runs] == ["too-many"]
    assert runs[0]["outcome"]["failed"] == 2 and runs[0]["outcome"]["partial"] is True
    # Past the threshold the relay abandons every unfinished child (the running `gated` too) and revokes them:
    # every child ends terminal and is counted once, and their own later reports (the seven revoked, `gated`'s
    # success) are recorded as late, changing no counter.
    final = wait_for(lambda: (s := handle.batch_status()).remaining == 0 and s, 60, message="all children terminal")
    assert (final.succeeded, final.failed) == (0, 10)
    sql = "SELECT state, late_state, count(*) AS n FROM fanin_children WHERE batch_id = :b GROUP BY state, late_state"
    expected = {("failed", None): 2, ("abandoned", "succeeded"): 1, ("abandoned", "revoked"): 7}
    wait_for(
        lambda: {(r.state, r.late_state): r.n for r in rows(producer, sql, b=handle.batch_id)} == expected,
        60,
        message=f"children {expected}",
    )
    assert handle.batch_status().failed == final.failed  # late reports change no counter
    assert len(successor_runs(handle.batch_id)) == 1


def test_reconcile_repairs_drifted_counters_and_finishes_stuck_batches(
    producer: Any, processes: Any, successor_runs: Runs
) -> None:
    from celery_fanin.relay import maintenance

    processes.worker(RELAY_PUBLISHES)  # no successor runs before the hand edits: nothing publishes it until the relay
    fanin = FanIn.of(producer)
    drifted = fan_in_group([tasks.ok.s(i) for i in range(4)], then=tasks.record_run.s("drift")).apply_async()
    stuck = fan_in_group([tasks.ok.s(i) for i in range(3)], then=tasks.record_run.s("stuck")).apply_async()
    for h in (drifted, stuck):
        wait_for(lambda h=h: h.batch_status().state == "complete", 30, message="complete")
    # Drift: counters edited by hand on a finished batch are left alone (only open batches are recomputed) ...
    # ... so make both open again: one with wrong counts, one whose last decrement was "lost".
    rows(
        producer,
        "UPDATE fanin_batches SET state = 'running', remaining = 3, succeeded = 0 WHERE id = :b",
        b=drifted.batch_id,
    )
    drop_outbox(producer, stuck.batch_id)
    rows(producer, "DELETE FROM fanin_successors WHERE batch_id = :b", b=stuck.batch_id)
    rows(
        producer,
        "UPDATE fanin_batches SET state = 'running', remaining = 1, succeeded = 2 WHERE id = :b",
        b=stuck.batch_id,
    )
    drop_outbox(producer, drifted.batch_id)
    rows(producer, "DELETE FROM fanin_successors WHERE batch_id = :b", b=drifted.batch_id)
    repairs = {str(r.batch_id): r for r in maintenance.reconcile(fanin)}
    assert set(repairs) == {drifted.batch_id, stuck.batch_id}
    assert maintenance.reconcile(fanin) == []  # a second run finds nothing
    processes.relay()
    for h, n in ((drifted, 4), (stuck, 3)):
        status = h.wait_batch(timeout=30)
        assert (status.planned, status.succeeded, status.failed, status.remaining) == (n, n, 0, 0)
        assert len(successor_runs(h.batch_id)) == 1


def test_reconcile_beside_live_traffic_changes_nothing(producer: Any, processes: Any, successor_runs: Runs) -> None:
    import threading

    from celery_fanin.relay import maintenance

    processes.worker()
    processes.relay()
    fanin = FanIn.of(producer)
    stop = threading.Event()
    found: list[Any] = []

    def keep_reconciling() -> None:
        while not stop.is_set():
            found.extend(maintenance.reconcile(fanin))

    thread = threading.Thread(target=keep_reconciling)
    thread.start()
    try:
        handle = fan_in_group([tasks.ok.s(i) for i in range(200)], then=tasks.record_run.s("live")).apply_async()
        status = handle.wait_batch(timeout=90)
    finally:
        stop.set()
        thread.join(30)
    assert found == []
    assert (status.succeeded, status.failed, status.remaining) == (200, 0, 0)
    assert len(successor_runs(handle.batch_id)) == 1


def test_reconcile_reports_deleted_child_rows(producer: Any, processes: Any) -> None:
    from celery_fanin.relay import maintenance

    handle = fan_in_group([tasks.ok.s(i) for i in range(3)], then=tasks.record_run.s("gone")).apply_async()
    rows(producer, "DELETE FROM fanin_children WHERE batch_id = :b AND idx = 1", b=handle.batch_id)
    repairs = maintenance.reconcile(FanIn.of(producer))
    assert len(repairs) == 1 and "planned 3 children but 2 rows exist" in repairs[0].problems[0]
    assert handle.batch_status().state == "running"  # reported, never guessed at


def test_successor_message_lost_is_published_again(
    producer: Any, processes: Any, successor_runs: Runs, clean_redis: str
) -> None:
    import redis

    # The stall scan publishes it again 5 s after it was sent, by when the worker started below is consuming: its
    # copy is admitted at once, long before a second republish (5 s later again) could make a duplicate.
    relay = processes.relay(extra_env={"FANIN_TEST_SUCCESSOR_TIMEOUT": "5"})
    handle = fan_in_group([], then=tasks.record_run.s("lost-successor")).apply_async()
    wait_for(lambda: handle.batch_status().successor_state == "sent", 20, message="the successor sent")
    # The broker loses it (a restart without persistence): the queue read and deleted in one transaction, so what
    # was lost is known to be the successor's one message, and nothing of it is left to deliver.
    with redis.Redis.from_url(clean_redis).pipeline(transaction=True) as pipe:
        queued, deleted = pipe.lrange("celery", 0, -1).delete("celery").execute()
    assert deleted == 1
    assert [json.loads(m)["headers"]["id"] for m in queued] == [handle.batch_status().successor_task_id]
    processes.worker()
    status = handle.wait_batch(timeout=60)
    assert status.successor_state == "succeeded" and status.successor_runs == 1
    assert status.successor_duplicates == 0  # the copy the relay published again is the only one delivered
    assert len(successor_runs(handle.batch_id)) == 1
    assert "stalled" in relay.output()


def test_successor_whose_whole_worker_died_is_published_again(
    producer: Any, processes: Any, successor_runs: Runs, clean_redis: str
) -> None:
    import redis

    lease = {"FANIN_TEST_SUCCESSOR_LEASE": "2", "FANIN_TEST_SUCCESSOR_LEASE_GRACE": "1"}
    first = processes.worker(extra_env=lease)
    processes.relay(extra_env={**lease, "FANIN_TEST_SUCCESSOR_TIMEOUT": "2"})
    handle = fan_in_group([tasks.ok.s(1)], then=tasks.slow_once_successor.s("phoenix", 60)).apply_async()
    wait_for(lambda: handle.batch_status().successor_state == "running", 30, message="the successor running")
    # Its body has begun (counted its first run): killed before that, the run after it would be the one to sleep.
    began = f"e2e:slow_once_successor:{handle.batch_id}"
    wait_for(lambda: redis.Redis.from_url(clean_redis).get(began) == b"1", 30, message="the first run's body")
    first.kill()  # main process too: nothing reports, and without acks_late nothing redelivers
    processes.worker(extra_env=lease)
    # Its lease is no longer renewed: once it has lapsed for the grace, the relay publishes the successor again,
    # and the new worker runs it to the end (its second run does not sleep).
    status = handle.wait_batch(timeout=60)
    assert (status.successor_state, status.successor_runs) == ("succeeded", 2)
    assert [r["label"] for r in successor_runs(handle.batch_id)] == ["phoenix"]
