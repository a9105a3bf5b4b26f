"""Lock and statement timeouts and read-only sessions, end to end (issue 38, hole 5): a real `celery worker` logs
in as a role of the test's own whose sessions have `lock_timeout`, `statement_timeout` or
`default_transaction_read_only` set (`ALTER ROLE`, tests.session_roles), and a child's terminal report meets the
error the server really raises: 55P03, 57014 or 25006. Each is retried within `fanin_report_timeout` (a 25006 on
a new connection) and the report counts once the cause is gone; before, it was dropped as permanent and the child
stayed `started` until child_timeout counted it lost.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest

from celery_fanin import fan_in_group
from celery_fanin.store.reports import libpq_conninfo
from tests import app as tasks
from tests.e2e.brokers import BROKERS, broker_env
from tests.session_roles import SessionRole, session_role
from tests.sql import attempts, batch, child_states, open_gate, outbox
from tests.workers import wait_for

pytestmark = [pytest.mark.e2e]

Runs = Callable[[str], list[dict[str, Any]]]
__all__ = ["broker_env"]  # the `e2e_env` fixture, on the broker each test is parametrized with


@pytest.fixture
def role(request: pytest.FixtureRequest, e2e_env: dict[str, str]) -> Iterator[SessionRole]:
    """Asked for before `processes`, so dropped after the worker logging in as it has stopped."""
    with session_role(e2e_env["FANIN_DATABASE_URL"], getattr(request, "param", {})) as made:
        yield made


def _worker_as(role: SessionRole, processes: Any, e2e_env: dict[str, str]) -> Any:
    # The successor's own record of its runs goes in as the admin: it is the test's witness, not the code under test.
    worker = processes.worker(
        extra_env={"FANIN_DATABASE_URL": role.url, "FANIN_TEST_RUNS_URL": e2e_env["FANIN_DATABASE_URL"]}
    )
    assert f"transport:   {e2e_env['FANIN_TEST_BROKER'].split(':')[0]}://" in worker.output()
    return worker


def _met(worker: Any, error: str, times: int) -> bool:
    """The worker's reports met `error` `times` times, or one was dropped as permanent (what this test catches)."""
    log = worker.output()
    return log.count(error) >= times or "not a transient error" in log


def _done(role: SessionRole, handle: Any, runs: Runs, worker: Any, error: str) -> None:
    """The batch finished with its one child succeeded, its successor ran once, and the report met `error` and
    was retried, never given up."""
    wait_for(
        lambda: child_states(role.database_url, handle.batch_id) == {"succeeded": 1},
        30,
        message="the child's report to count (a report dropped as permanent leaves it 'started')",
    )
    status = handle.wait_batch(timeout=30)
    assert (status.succeeded, status.failed, status.remaining) == (1, 0, 0)
    assert status.successor_state == "succeeded" and status.successor_runs == 1
    assert len(runs(handle.batch_id)) == 1
    log = worker.output()
    assert "recording terminal outcome" in log and error in log and "retrying in" in log
    assert "not a transient error" not in log and "gave up" not in log


@pytest.mark.timeout(120)
@BROKERS
@pytest.mark.parametrize(
    ("role", "error"),
    [
        pytest.param({"lock_timeout": "100ms"}, "LockNotAvailable", id="55P03-lock_timeout"),
        pytest.param({"statement_timeout": "200ms"}, "QueryCanceled", id="57014-statement_timeout"),
    ],
    indirect=["role"],
)
def test_a_report_that_times_out_on_a_held_row_lock_counts_once_the_lock_is_gone(
    role: SessionRole, producer: Any, processes: Any, successor_runs: Runs, e2e_env: dict[str, str], error: str
) -> None:
    worker = _worker_as(role, processes, e2e_env)
    processes.relay()
    handle = fan_in_group([tasks.sleepy.s(1)], then=tasks.record_run.s("lock")).apply_async()
    wait_for(
        lambda: child_states(role.database_url, handle.batch_id) == {"started": 1}, 30, message="the child started"
    )
    # Another session holds the child's row while the child ends: its report waits for the lock past the role's
    # timeout, and the server cancels it (55P03 for lock_timeout, 57014 for statement_timeout).
    holder = psycopg.connect(role.database_url)
    try:
        holder.execute("SELECT 1 FROM fanin_children WHERE batch_id = %s FOR UPDATE", (handle.batch_id,))
        wait_for(lambda: error in worker.output(), 30, message=f"the report to meet {error}")
        wait_for(lambda: _met(worker, error, 2), 10, message="a second attempt to meet it too (or a report dropped)")
        # not counted while the row is held...
        assert child_states(role.database_url, handle.batch_id) == {"started": 1}
    finally:
        holder.rollback()
        holder.close()
    _done(role, handle, successor_runs, worker, error)  # ...and counted once it is free


@pytest.mark.timeout(120)
def test_a_report_that_meets_a_read_only_session_reconnects_and_counts_once_writes_are_back(
    role: SessionRole, producer: Any, processes: Any, successor_runs: Runs, e2e_env: dict[str, str]
) -> None:
    """A failover behind the DNS name, as the worker sees it: its sessions end, and the server it reconnects to
    is read-only for a while (the role's `default_transaction_read_only`, which applies at a session's start). The
    report meets 25006 and is retried; it lands only on a session opened after writes are back, so it reconnected."""
    worker = _worker_as(role, processes, e2e_env)
    processes.relay()
    handle = fan_in_group([tasks.sleepy.s(3)], then=tasks.record_run.s("read-only")).apply_async()
    wait_for(
        lambda: child_states(role.database_url, handle.batch_id) == {"started": 1}, 30, message="the child started"
    )
    role.set("default_transaction_read_only", "on")
    try:
        assert role.terminate_sessions() >= 1  # the worker's sessions, read-write, end with the old primary
        wait_for(lambda: "ReadOnlySqlTransaction" in worker.output(), 30, message="the report to meet 25006")
        wait_for(lambda: _met(worker, "ReadOnlySqlTransaction", 2), 10, message="a second 25006 (or a report dropped)")
        assert child_states(role.database_url, handle.batch_id) == {"started": 1}
    finally:
        role.set("default_transaction_read_only", None)
    _done(role, handle, successor_runs, worker, "ReadOnlySqlTransaction")


@pytest.mark.timeout(150)
def test_a_child_report_interrupted_by_the_soft_time_limit_leaves_its_successor_to_the_relay_at_once(
    producer: Any, processes: Any, successor_runs: Runs, e2e_env: dict[str, str]
) -> None:
    """Celery's soft time limit (SIGUSR1 from the main process) can arrive in a prefork pool process while it waits
    for its child's terminal report, after the body has ended. Here the test holds the batch row, so the report (a
    child row updated, then the batch) waits past the child's `soft_time_limit=1` and is interrupted. The server
    goes on with the abandoned statement: once the row is free it commits it, completing the batch and creating the
    successor handed to this worker, which never reads the answer. The report is sent again (late) and the relay
    woken for the batch (`worker.report._send_again`), so the successor runs once and at once, not after the
    hand-off (`fanin_successor_handoff`, 600 s here, past this test's timeout) has lapsed."""
    key = f"soft-report-{uuid.uuid4().hex[:8]}"
    # One pool process: the child waits behind a gated plain task until the test holds the batch row.
    worker = processes.worker(extra_env={"FANIN_TEST_SUCCESSOR_HANDOFF": "600"}, concurrency=1)
    processes.relay()
    tasks.gated.apply_async((key,))
    wait_for(lambda: attempts(producer, key) == 1, 30, message="the gated task to hold the pool process")
    handle = fan_in_group(
        [tasks.sleepy.s(0.1).set(soft_time_limit=1)], then=tasks.record_run.s("soft-report")
    ).apply_async()
    wait_for(
        lambda: batch(e2e_env, handle.batch_id, "published_upto")["published_upto"] == 1,
        30,
        message="the child to be published",
    )
    holder = psycopg.connect(libpq_conninfo(e2e_env["FANIN_DATABASE_URL"]))
    try:
        holder.execute("SELECT 1 FROM fanin_batches WHERE id = %s FOR UPDATE", (handle.batch_id,))
        open_gate(e2e_env, key)
        wait_for(
            lambda: "was interrupted by the soft time limit; sending it again" in worker.output(),
            30,
            message="the child's terminal report to be interrupted by its soft time limit",
        )
        # (its start goes with the report, so the child reads as pending or started until the row is free)
        states = child_states(e2e_env, handle.batch_id)
        assert set(states) <= {"pending", "started"}, f"the report counted under the held row: {states}"
    finally:
        holder.rollback()  # the abandoned statement commits now; the one sent again waits for its child row
        holder.close()
    released = time.monotonic()
    wait_for(
        lambda: successor_runs(handle.batch_id),
        30,
        message="the successor to run (without the wake it waits out the 600 s hand-off)",
    )
    took = time.monotonic() - released
    status = handle.wait_batch(timeout=30)
    assert (status.succeeded, status.failed, status.remaining) == (1, 0, 0)
    assert (status.successor_state, status.successor_runs, status.successor_duplicates) == ("succeeded", 1, 0)
    assert len(successor_runs(handle.batch_id)) == 1
    assert took < 15, f"the successor ran {took:.1f}s after the row was released"
    sent = outbox(e2e_env, handle.batch_id, "sent_at", "attempts")
    assert len(sent) == 1 and sent[0]["sent_at"] is not None and sent[0]["attempts"] == 1, sent
    log = worker.output()
    assert "late or repeated report not counted" in log, "the report sent again was counted (or never sent)"
    assert "published successor batch_id" not in log, "the worker published it: the first answer was read"
    assert "gave up" not in log and "not a transient error" not in log
