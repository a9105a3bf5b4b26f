"""Reconciliation as the processes an operator runs: the relay's periodic pass and `celery -A ... fanin reconcile`,
against counters broken on purpose in PostgreSQL while real prefork workers run the batches.

Batches are kept running by a child held in its body (`tasks.gated`, a gate the test opens) or by children held
on queues no worker consumes until the test says so (tests/e2e/holds.py); a deadline is an hour long and passed in
PostgreSQL (tests/e2e/clock.py). No step races a timer.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest

from celery_fanin import fan_in_group
from tests import app as tasks
from tests.e2e import clock, holds
from tests.e2e.test_cli import celery, fanin
from tests.sql import counters, drop_outbox, open_gate, outbox, rows
from tests.workers import RELAY_PUBLISHES, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(150)]

Runs = Callable[[str], list[dict[str, Any]]]
FAST_RECONCILE = {"FANIN_TEST_RECONCILE_INTERVAL": "0.5"}  # the relay reconciles every half second


def _drift(app: Any, batch_id: str, remaining: int, succeeded: int, failed: int) -> None:
    """Counters broken by hand (a bug, a restored backup, an operator's UPDATE)."""
    rows(
        app,
        "UPDATE fanin_batches SET remaining = :r, succeeded = :s, failed = :f WHERE id = :b",
        b=batch_id,
        r=remaining,
        s=succeeded,
        f=failed,
    )


def _held_running(app: Any, gate: str) -> Any:
    """A batch [ok, ok, gated] whose two ok children have finished and whose gated child is in its body."""
    rows(app, tasks.ATTEMPTS_DDL)
    handle = fan_in_group(
        [tasks.ok.s(0), tasks.ok.s(1), tasks.gated.s(gate)], then=tasks.record_run.s(gate)
    ).apply_async()
    clock.wait_finished(app, handle.batch_id, {0, 1})
    wait_for(
        lambda: rows(
            app, "SELECT 1 FROM fanin_children WHERE batch_id = :b AND idx = 2 AND state = 'started'", b=handle.batch_id
        ),
        30,
        message="the gated child to start",
    )
    assert counters(app, handle.batch_id) == ("running", 1, 2, 0)
    return handle


def _reconciled(log: str, batch_id: str) -> int:
    return log.count(f"reconciled batch_id={batch_id}")


def test_the_running_relay_reconciles_periodically(producer: Any, processes: Any, successor_runs: Runs) -> None:
    processes.worker(concurrency=2)
    relay = processes.relay(extra_env=FAST_RECONCILE)
    gate = f"periodic-{uuid.uuid4().hex[:8]}"
    held = _held_running(producer, gate)
    stuck = fan_in_group([tasks.ok.s(0), tasks.ok.s(1)], then=tasks.record_run.s("stuck")).apply_async()
    wait_for(lambda: stuck.batch_status().successor_state == "succeeded", 30, message="the second batch done")
    rows(producer, "TRUNCATE e2e_successor_runs")

    # First drift, on a batch the relay has been reconciling since it started: the next pass repairs it.
    _drift(producer, held.batch_id, remaining=5, succeeded=0, failed=2)
    wait_for(lambda: counters(producer, held.batch_id) == ("running", 1, 2, 0), 30, message="the first repair")
    wait_for(lambda: _reconciled(relay.output(), held.batch_id) == 1, 10, message="the first repair logged")
    # Second drift, and a batch whose last decrement and successor were lost: a later pass repairs both.
    _drift(producer, held.batch_id, remaining=2, succeeded=1, failed=1)
    for table in ("fanin_outbox", "fanin_successors"):
        rows(producer, f"DELETE FROM {table} WHERE batch_id = :b", b=stuck.batch_id)  # a constant table name
    rows(
        producer,
        "UPDATE fanin_batches SET state = 'running', remaining = 1, succeeded = 1, completed_at = NULL WHERE id = :b",
        b=stuck.batch_id,
    )
    wait_for(lambda: counters(producer, held.batch_id) == ("running", 1, 2, 0), 30, message="the second repair")
    status = stuck.wait_batch(timeout=30)  # finished by the relay's reconcile, its successor created and published once
    assert (status.state, status.remaining, status.succeeded, status.failed) == ("complete", 0, 2, 0)
    assert (status.successor_state, status.successor_runs, status.successor_duplicates) == ("succeeded", 1, 0)
    assert [r["label"] for r in successor_runs(stuck.batch_id)] == ["stuck"]
    log = relay.output()
    assert _reconciled(log, held.batch_id) == 2 and _reconciled(log, stuck.batch_id) == 1

    # The repaired counters are the ones the last report then decrements: the held batch finishes exactly.
    open_gate(producer, gate)
    final = held.wait_batch(timeout=30)
    assert (final.state, final.remaining, final.succeeded, final.failed) == ("complete", 0, 3, 0)
    assert len(successor_runs(held.batch_id)) == 1
    assert _reconciled(relay.output(), held.batch_id) == 2  # nothing to repair in a healthy batch


def test_fanin_reconcile_command_repairs_counters_and_a_missing_outbox_row(
    e2e_env: dict[str, str], producer: Any, processes: Any, successor_runs: Runs
) -> None:
    # No relay yet, and a worker that leaves successors to it: a finished batch's successor waits in the outbox.
    processes.worker(RELAY_PUBLISHES, concurrency=2)
    gate = f"command-{uuid.uuid4().hex[:8]}"
    held = _held_running(producer, gate)
    done = fan_in_group([tasks.ok.s(0)], then=tasks.record_run.s("no-outbox")).apply_async()
    wait_for(lambda: done.batch_status().state == "complete", 30, message="the second batch complete")
    _drift(producer, held.batch_id, remaining=5, succeeded=0, failed=2)
    drop_outbox(producer, done.batch_id)

    result = celery(e2e_env, "reconcile", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["deadlines"] == []
    repairs = {r["batch_id"]: (r["problems"], r["actions"]) for r in report["repairs"]}
    assert repairs == {
        held.batch_id: (
            ["counter says remaining=5 succeeded=0 failed=2, children say remaining=1 succeeded=2 failed=0"],
            ["counters recomputed from child rows"],
        ),
        done.batch_id: (["successor had no outbox row"], ["outbox row inserted"]),
    }
    assert counters(producer, held.batch_id) == ("running", 1, 2, 0)
    assert outbox(producer, done.batch_id, "sent_at") == [{"sent_at": None}]
    again = celery(e2e_env, "reconcile")
    assert again.returncode == 0, again.stderr
    assert "all batches agree with their child rows" in again.stdout

    processes.relay()  # publishes the restored outbox row; the successor runs once
    status = done.wait_batch(timeout=30)
    assert (status.successor_state, status.successor_runs, status.successor_duplicates) == ("succeeded", 1, 0)
    assert len(successor_runs(done.batch_id)) == 1
    open_gate(producer, gate)
    final = held.wait_batch(timeout=30)
    assert (final.state, final.remaining, final.succeeded, final.failed) == ("complete", 0, 3, 0)
    assert len(successor_runs(held.batch_id)) == 1


def test_a_missing_outbox_row_alone_is_restored_and_its_successor_runs_once(
    producer: Any, processes: Any, successor_runs: Runs
) -> None:
    processes.worker(RELAY_PUBLISHES)  # the outbox row is deleted before anything publishes it
    handle = fan_in_group([tasks.ok.s(0), tasks.ok.s(1)], then=tasks.record_run.s("restored")).apply_async()
    wait_for(lambda: handle.batch_status().state == "complete", 30, message="the batch complete")
    # Counters and successor row are right; only the outbox row is gone (deleted by hand, a partial restore).
    assert drop_outbox(producer, handle.batch_id) == 1
    assert handle.batch_status().successor_state == "pending"
    relay = processes.relay()
    status = handle.wait_batch(timeout=30)
    assert (status.state, status.succeeded, status.failed) == ("complete", 2, 0)
    assert (status.successor_state, status.successor_runs, status.successor_duplicates) == ("succeeded", 1, 0)
    assert [r["label"] for r in successor_runs(handle.batch_id)] == ["restored"]
    [row] = outbox(producer, handle.batch_id, "sent_at")
    assert row["sent_at"] is not None
    assert f"reconciled batch_id={handle.batch_id}: successor had no outbox row; outbox row inserted" in relay.output()


@pytest.mark.parametrize("first", ["threshold", "deadline"])
def test_a_tree_with_a_deadline_a_threshold_and_reconcile(
    e2e_env: dict[str, str], producer: Any, processes: Any, successor_runs: Runs, first: str
) -> None:
    """A tree of 4 leaves (12 children, max_width=3) with max_failures=2 and an hour-long deadline: its counters
    are broken on the root and on a leaf and the running relay repairs them; then either the threshold passes
    (the third failure) and the deadline after it changes nothing, or the deadline passes first and the failures
    after it are recorded late and pass no threshold."""
    worker = processes.worker(concurrency=1)
    relay = processes.relay(extra_env=FAST_RECONCILE)
    children = [
        tasks.fail.s(0),
        tasks.ok.s(1),
        tasks.ok.s(2),
        tasks.ok.s(3),
        tasks.fail.s(4).set(queue="tree-f1"),
        tasks.fail.s(5).set(queue="tree-f2"),
        *[tasks.ok.s(i).set(queue="tree-hold") for i in range(6, 12)],
    ]
    handle = fan_in_group(
        children,
        then=tasks.record_run.s("then"),
        max_failures=2,
        on_failure=tasks.record_run.s("too-many"),
        deadline=timedelta(seconds=clock.LONG),
        child_timeout=0,
        max_width=3,
    ).apply_async()
    root = handle.batch_id
    children_rows = rows(
        producer,
        "SELECT c.idx, c.task_id, c.batch_id FROM fanin_children c JOIN fanin_batches b ON "
        "b.id = c.batch_id WHERE b.parent_id = :b ORDER BY c.idx",
        b=root,
    )
    assert len(children_rows) == 12 and len({r.batch_id for r in children_rows}) == 4
    leaf = str(children_rows[0].batch_id)  # the leaf holding the first failure
    task_ids = {r.idx: r.task_id for r in children_rows}
    wait_for(
        lambda: (
            rows(
                producer,
                "SELECT count(*) AS n FROM fanin_children c JOIN fanin_batches b ON b.id = c.batch_id"
                " WHERE b.parent_id = :b AND c.state IN ('succeeded', 'failed')",
                b=root,
            )[0].n
            == 4
        ),
        30,
        message="the first four children",
    )
    # No leaf has finished; the root holds one unit per open leaf and the failure its leaf handed up at once.
    healthy_root, healthy_leaf = counters(producer, root), counters(producer, leaf)
    assert healthy_root == ("running", 4, 0, 1) and healthy_leaf[0] == "running" and healthy_leaf[3] == 1

    _drift(producer, root, remaining=9, succeeded=5, failed=0)
    _drift(producer, leaf, remaining=1, succeeded=2, failed=0)
    wait_for(
        lambda: (counters(producer, root), counters(producer, leaf)) == (healthy_root, healthy_leaf),
        30,
        message="the root and the leaf repaired",
    )
    log = relay.output()
    assert _reconciled(log, root) >= 1 and _reconciled(log, leaf) >= 1

    if first == "threshold":
        holds.consume(producer, worker, "tree-f1")
        wait_for(lambda: counters(producer, root)[3] == 2, 30, message="the second failure at the root")
        assert counters(producer, root)[0] == "running"  # two failures: at max_failures, not past it
        holds.consume(producer, worker, "tree-f2")
        status = handle.wait_batch(timeout=60)
        assert status.state == "failed_threshold"
        [run] = successor_runs(root)
        assert run["label"] == "too-many"
        outcome = run["outcome"]
        assert (outcome["succeeded"], outcome["failed"], outcome["unfinished"], outcome["abandoned"]) == (3, 3, 6, 0)
        late = range(6, 12)
        clock.pass_deadline(producer, root)  # the deadline of a stopped batch: nothing left to apply
    else:
        clock.pass_deadline(producer, root)
        status = handle.wait_batch(timeout=60)
        assert status.state == "partial"  # 9 failures with the abandoned ones, yet no threshold: the deadline ended it
        [run] = successor_runs(root)
        assert run["label"] == "then"
        outcome = run["outcome"]
        assert (outcome["succeeded"], outcome["failed"], outcome["unfinished"], outcome["abandoned"]) == (3, 9, 0, 8)
        late = range(4, 12)
        holds.wait_revoked(producer, worker, [task_ids[i] for i in (4, 5)])
        holds.consume(producer, worker, "tree-f1")
        holds.consume(producer, worker, "tree-f2")

    holds.wait_revoked(producer, worker, [task_ids[i] for i in range(6, 12)])
    holds.consume(producer, worker, "tree-hold")
    late_sql = (
        "SELECT count(*) AS n FROM fanin_children c JOIN fanin_batches b ON b.id = c.batch_id WHERE "
        "b.parent_id = :b AND c.state = 'abandoned' AND c.late_state = 'revoked' AND c.late_reports = 1"
    )
    wait_for(lambda: rows(producer, late_sql, b=root)[0].n == len(late), 30, message="the late revoked reports")
    result = fanin(producer, "reconcile", "--json")  # reconcile and the deadline duty, once more by hand
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"repairs": [], "deadlines": []}
    after = handle.batch_status()
    assert (after.state, after.remaining, after.succeeded, after.failed) == (status.state, 0, 3, 9)
    assert len(successor_runs(root)) == 1
    leaves = rows(producer, "SELECT state, remaining FROM fanin_batches WHERE parent_id = :b", b=root)
    assert {(r.state, r.remaining) for r in leaves} == {(status.state, 0)}
