"""A deadline that passes while a child is RUNNING, end to end: real prefork workers, the relay and PostgreSQL.

The running child is held in its body by a gate the test opens (`tasks.gated`: it waits on a row in PostgreSQL), so
it is known to be running when the deadline passes, and its report is known to come after. The hour-long deadline
is passed in PostgreSQL (tests/e2e/clock.py) once the other child has finished.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest

from celery_fanin import fan_in_group
from tests import app as tasks
from tests.e2e import clock
from tests.sql import attempts, child, open_gate, rows
from tests.workers import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(150)]

Runs = Callable[[str], list[dict[str, Any]]]


@pytest.mark.parametrize("on_deadline", ["proceed", "abandon"])
def test_a_deadline_abandons_a_running_child_and_its_later_report_is_recorded_late(
    producer: Any, processes: Any, successor_runs: Runs, on_deadline: str
) -> None:
    processes.worker(concurrency=2)  # one process held by the gated child, one for the successor
    processes.relay()
    rows(producer, tasks.ATTEMPTS_DDL)
    gate = f"deadline-{uuid.uuid4().hex[:8]}"
    handle = fan_in_group(
        [tasks.ok.s(0), tasks.gated.s(gate)],
        then=tasks.record_run.s("then"),
        on_expire=tasks.record_run.s("expired") if on_deadline == "abandon" else None,
        deadline=timedelta(seconds=clock.LONG),
        on_deadline=on_deadline,
        child_timeout=0,
    ).apply_async()
    clock.wait_finished(producer, handle.batch_id, {0})
    # The gated child is running: its body began, and its start is recorded.
    wait_for(lambda: child(producer, handle.batch_id, 1).state == "started", 30, message="the gated child started")
    assert attempts(producer, gate) == 1

    clock.pass_deadline(producer, handle.batch_id)
    status = handle.wait_batch(timeout=60)  # the successor (or on_expire) runs while the child is still in its body
    assert status.state == ("partial" if on_deadline == "proceed" else "expired")
    [run] = successor_runs(handle.batch_id)
    assert run["label"] == ("then" if on_deadline == "proceed" else "expired")
    outcome = run["outcome"]
    assert (outcome["succeeded"], outcome["failed"], outcome["abandoned"], outcome["unfinished"]) == (1, 1, 1, 0)
    assert [(f["index"], f["state"], f["exc_type"]) for f in outcome["failures"]] == [
        (1, "abandoned", "DeadlineExceeded")
    ]
    assert child(producer, handle.batch_id, 1).state == "abandoned"
    assert attempts(producer, f"{gate}:open") == 0  # still held

    # The child's body now returns: its report finds the row abandoned and is recorded late; no counter moves.
    open_gate(producer, gate)
    late = wait_for(
        lambda: (c := child(producer, handle.batch_id, 1)).late_reports > 0 and c, 30, message="the late report"
    )
    assert (late.state, late.late_state, late.late_reports, late.exc_type) == (
        "abandoned",
        "succeeded",
        1,
        "DeadlineExceeded",
    )
    after = handle.batch_status()
    assert (after.state, after.remaining, after.succeeded, after.failed) == (status.state, 0, 1, 1)
    assert attempts(producer, gate) == 1  # it ran once
    assert len(successor_runs(handle.batch_id)) == 1
