"""`max_failures` given as a ratio, end to end: real prefork workers, the relay and PostgreSQL.

The children that must fail one at a time are each on a queue of their own, consumed only when the test says
(tests/e2e/holds.py), so the test sees the batch after each failure: still running at the threshold, stopped one
failure past it. Nothing races a timer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from celery_fanin import fan_in_group
from tests import app as tasks
from tests.e2e import holds
from tests.sql import counters, rows
from tests.workers import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(150)]

Runs = Callable[[str], list[dict[str, Any]]]


def test_a_ratio_stops_the_batch_one_failure_past_floor_of_ratio_times_planned(
    producer: Any, processes: Any, successor_runs: Runs
) -> None:
    worker = processes.worker(concurrency=1)
    processes.relay()
    # 10 children, max_failures=0.25: the threshold is floor(2.5) = 2 failures, so the third one stops the batch
    # (a ceil would wait for a fourth, a >= would stop at the second). Each failure is on its own queue; the seven
    # that would succeed are held on another, so that when the batch stops they are all still unfinished.
    fails = [f"ratio-fail-{i}" for i in range(3)]
    children = [tasks.fail.s(i).set(queue=q) for i, q in enumerate(fails)]
    children += [tasks.ok.s(i).set(queue="ratio-hold") for i in range(3, 10)]
    handle = fan_in_group(
        children, then=tasks.record_run.s("then"), max_failures=0.25, on_failure=tasks.record_run.s("too-many")
    ).apply_async()
    [threshold] = rows(producer, "SELECT max_failures FROM fanin_batches WHERE id = :b", b=handle.batch_id)
    assert threshold.max_failures == 2

    for n, queue in enumerate(fails[:2], start=1):
        holds.consume(producer, worker, queue)
        wait_for(lambda n=n: counters(producer, handle.batch_id)[3] == n, 30, message=f"failure {n} counted")
        assert counters(producer, handle.batch_id) == ("running", 10 - n, 0, n)  # at the threshold, not past it
    holds.consume(producer, worker, fails[2])
    status = handle.wait_batch(timeout=60)
    assert status.state == "failed_threshold"

    [run] = successor_runs(handle.batch_id)
    assert run["label"] == "too-many"  # on_failure, not `then`
    outcome = run["outcome"]
    assert (outcome["state"], outcome["partial"], outcome["planned"]) == ("failed_threshold", True, 10)
    assert (outcome["succeeded"], outcome["failed"], outcome["unfinished"], outcome["abandoned"]) == (0, 3, 7, 0)
    assert [(f["index"], f["state"]) for f in outcome["failures"]] == [(0, "failed"), (1, "failed"), (2, "failed")]

    # As documented: the unfinished children are abandoned and revoked, their later reports recorded, not counted.
    states = rows(
        producer,
        "SELECT idx, state, exc_type, task_id FROM fanin_children WHERE batch_id = :b ORDER BY idx",
        b=handle.batch_id,
    )
    assert [(r.state, r.exc_type) for r in states[3:]] == [("abandoned", "FailureThresholdPassed")] * 7
    assert (status.remaining, status.succeeded, status.failed) == (0, 0, 10)
    holds.wait_revoked(producer, worker, [r.task_id for r in states[3:]])
    holds.consume(producer, worker, "ratio-hold")
    late_sql = (
        "SELECT count(*) AS n FROM fanin_children WHERE batch_id = :b AND late_state = 'revoked' AND late_reports = 1"
    )
    wait_for(lambda: rows(producer, late_sql, b=handle.batch_id)[0].n == 7, 30, message="7 late revoked reports")
    assert counters(producer, handle.batch_id) == ("failed_threshold", 0, 0, 10)
    assert len(successor_runs(handle.batch_id)) == 1
