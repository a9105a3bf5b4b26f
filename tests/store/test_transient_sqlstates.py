"""Lock and statement timeouts and read-only sessions (issue 38, hole 5), store-level against the real server: the
errors PostgreSQL really raises for each are transient for `retry.is_transient`, whether psycopg's own or wrapped by
SQLAlchemy, and a 25006 is retried on a new connection, both by the SQLAlchemy engine (its pool discards the
read-only session) and by the workers' report connection. End to end, with a real worker: tests/e2e/test_db_errors.py.
"""

from __future__ import annotations

import logging
import random
import threading
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from typing import TypeVar

import psycopg
import pytest
from celery import Celery
from psycopg import errors as pg_errors
from sqlalchemy import Connection, Engine, text
from sqlalchemy import exc as sa_exc

from celery_fanin import retry
from celery_fanin.context import FanIn
from celery_fanin.store import successors
from celery_fanin.store.batches import Start
from celery_fanin.store.reports import record_starts
from celery_fanin.store.statements import Runner
from celery_fanin.worker import successor_runs
from tests.session_roles import session_role
from tests.sql import BACKEND, READ_ONLY, Held
from tests.workers import wait_for

from .helpers import create

_T = TypeVar("_T")


def _lock_timeout(run: Callable[[str], object], database_url: str) -> None:
    key = random.getrandbits(62)
    with psycopg.connect(database_url, autocommit=True) as holder:
        holder.execute("SELECT pg_advisory_lock(%s)", (key,))
        run("SET lock_timeout = '50ms'")
        run(f"SELECT pg_advisory_lock({key})")


def _statement_timeout(run: Callable[[str], object], database_url: str) -> None:
    run("SET statement_timeout = '50ms'")
    run("SELECT pg_sleep(5)")


def _cancelled(run: Callable[[str], object], database_url: str) -> None:
    """A statement another session cancels (`pg_cancel_backend`: an operator, or a watchdog): 57014 as well."""
    pid = int(run("SELECT pg_backend_pid()"))  # type: ignore[call-overload]
    done = threading.Event()

    def cancel() -> None:
        with psycopg.connect(database_url, autocommit=True) as admin:
            while not done.wait(0.05):
                row = admin.execute(
                    "SELECT pg_cancel_backend(pid) FROM pg_stat_activity WHERE pid = %s AND query LIKE %s",
                    (pid, "%pg_sleep%"),
                ).fetchone()
                if row and row[0]:
                    return

    canceller = threading.Thread(target=cancel, daemon=True)
    canceller.start()
    try:
        run("SELECT pg_sleep(20)")
    finally:
        done.set()
        canceller.join(5)


def _read_only(run: Callable[[str], object], database_url: str) -> None:
    run("SET default_transaction_read_only = on")  # this session only, as a standby's or a demoted primary's are
    run("CREATE TEMP TABLE fanin_read_only_probe (i int)")


CASES = [
    pytest.param(_lock_timeout, pg_errors.LockNotAvailable, id="55P03-lock_timeout"),
    pytest.param(_statement_timeout, pg_errors.QueryCanceled, id="57014-statement_timeout"),
    pytest.param(_cancelled, pg_errors.QueryCanceled, id="57014-pg_cancel_backend"),
    pytest.param(_read_only, pg_errors.ReadOnlySqlTransaction, id="25006-read_only"),
]


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("provoke", "expected"), CASES)
def test_the_server_s_own_error_is_transient_through_psycopg(
    clean_db: str, provoke: Callable[..., None], expected: type[psycopg.Error]
) -> None:
    with psycopg.connect(clean_db, autocommit=True) as conn:

        def run(sql: str) -> object:
            cur = conn.execute(sql)  # type: ignore[arg-type]  # our own constant statements
            row = cur.fetchone() if cur.description else None
            return row[0] if row else None

        with pytest.raises(expected) as info:
            provoke(run, clean_db)
    assert type(info.value) is expected and info.value.sqlstate == expected.sqlstate
    assert retry.is_transient(info.value)


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("provoke", "expected"), CASES)
def test_the_server_s_own_error_is_transient_through_the_engine(
    app: Celery, clean_db: str, provoke: Callable[..., None], expected: type[psycopg.Error]
) -> None:
    engine = FanIn.of(app).engine
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:

        def run(sql: str) -> object:
            result = conn.execute(text(sql))
            return result.scalar() if result.returns_rows else None

        with pytest.raises(sa_exc.DBAPIError) as info:
            provoke(run, clean_db)
    assert isinstance(info.value.orig, expected)
    assert retry.is_transient(info.value)
    # Only a read-only session is a lost connection: the pool must not keep it (see the next test).
    assert info.value.connection_invalidated == (expected is pg_errors.ReadOnlySqlTransaction)


@pytest.fixture
def short_reports(app: Celery) -> Iterator[FanIn]:
    """The app's FanIn with a report timeout of 5 s: a report that cannot get through fails the test quickly."""
    app.conf.fanin_report_timeout = 5.0
    yield FanIn.of(app)


def _backend_pid(conn: Connection) -> int:
    return int(conn.execute(text("SELECT pg_backend_pid()")).scalar_one())


@pytest.mark.timeout(30)
def test_a_read_only_pooled_connection_is_discarded_and_the_statement_retried_on_a_new_one(
    short_reports: FanIn,
) -> None:
    """A statement through the app's engine, retried (`retry.call`, as the relay's are), checks out a pooled
    connection whose session is read-only: the 25006 invalidates it, and the retry gets a new session. Without
    `retry.reconnect_on_read_only` the pool hands the same session back (its pre-ping passes) on every attempt."""
    engine = short_reports.engine
    with engine.connect() as conn:
        stale = _backend_pid(conn)
        conn.exec_driver_sql("SET SESSION default_transaction_read_only = on")
        conn.commit()
    pids: list[int] = []

    def count() -> None:
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            pids.append(_backend_pid(conn))
            successors.count_duplicate(Held(conn), uuid.uuid4(), "then")  # a write: refused on a read-only session

    retry.call(count, what="counting a duplicate", timeout=5)
    assert pids[0] == stale  # the first attempt met the read-only session...
    assert len(pids) == 2 and pids[1] != stale  # ...and the second ran on a new one
    with engine.connect() as conn:
        assert _backend_pid(conn) != stale
        assert conn.exec_driver_sql("SHOW default_transaction_read_only").scalar_one() == "off"


@pytest.mark.timeout(30)
def test_a_successor_run_statement_on_a_read_only_session_is_retried_on_a_new_one(short_reports: FanIn) -> None:
    """A successor run's statements after its admission (`successor_runs._store`: hand-over, take-back, finish) go
    on the report connection (`FanIn.reports`), which drops its session after 25006, so the retry reaches one that
    takes writes."""
    runs = short_reports.reports
    runs.one(READ_ONLY, {})  # on the connection its next statement takes (the one given back last)
    stale = runs.one(BACKEND, {})[0]
    pids: list[int] = []

    def count(runner: Runner) -> None:
        pids.append(runs.one(BACKEND, {})[0])
        successors.count_duplicate(runner, uuid.uuid4(), "then")  # a write: refused on a read-only session

    successor_runs._store(short_reports, "counting a duplicate", count)
    assert pids[0] == stale and len(pids) == 2 and pids[1] != stale
    runs.reset()


@pytest.mark.timeout(30)
def test_the_report_connection_reconnects_after_a_read_only_session(short_reports: FanIn) -> None:
    """The workers' report connection (store.reports) drops its connection after 25006, as after any error, so the
    retry of a report reaches a session that takes writes."""
    reports = short_reports.reports
    reports.one(READ_ONLY, {})  # on the connection its next statement takes (the one given back last)
    stale = reports.one(BACKEND, {})[0]
    pids: list[int] = []

    def record() -> int:
        pids.append(reports.one(BACKEND, {})[0])
        return record_starts(reports, [Start(f"no-such-{uuid.uuid4()}", 0, "w", datetime.now(timezone.utc))])

    assert retry.call(record, what="recording a start", timeout=5) == 0
    assert pids[0] == stale and len(pids) == 2 and pids[1] != stale
    reports.reset()


@pytest.mark.timeout(60)
def test_a_successor_admission_that_meets_a_lock_timeout_is_retried_not_refused(
    clean_db: str, store_engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    """The run guard's statement (`successor_runs.admit`, on the report connection of a worker whose role has
    `lock_timeout`) waits on the successor's row another session holds: 55P03, retried until the row is free, and
    the delivery admitted. Before, it was refused as if the store were broken (the relay republished it later)."""
    caplog.set_level(logging.INFO, logger="celery_fanin")
    batch, _, _ = create(store_engine, 0)
    with session_role(clean_db, {"lock_timeout": "100ms"}) as role:
        worker_app = Celery("fanin-lock-timeout-worker", set_as_current=False)
        worker_app.conf.fanin_database_url = role.url
        fanin = FanIn(worker_app)
        admitted: list[successor_runs.LiveRun | None] = []
        with store_engine.connect() as holder, holder.begin():
            holder.execute(text("SELECT 1 FROM fanin_successors WHERE batch_id = :id FOR UPDATE"), {"id": batch.id})
            delivery = threading.Thread(
                target=lambda: admitted.append(
                    successor_runs.admit(fanin, str(batch.id), batch.step, batch.successor_task_id, 0)
                )
            )
            delivery.start()
            wait_for(lambda: "LockNotAvailable" in caplog.text, 15, message="the admission to meet 55P03")
        delivery.join(30)
        try:
            assert admitted and admitted[0] is not None, "the delivery was refused"
            assert admitted[0].run == successors.Run(batch.id, batch.step, 1, 0)
        finally:
            if admitted and admitted[0] is not None:
                successor_runs.abandon(admitted[0])
            fanin.dispose()


class _SoftTimeLimit(Exception):
    """Stands for Celery's `SoftTimeLimitExceeded`: raised by a SIGUSR1 handler, not a psycopg error."""


def test_a_statement_interrupted_by_another_exception_leaves_the_next_statement_a_working_connection(
    store_engine: Engine, clean_db: str
) -> None:
    """A soft time limit (SIGUSR1 in a prefork pool process) can raise while a report waits for its reply. The
    connection is then busy with a result nobody reads: it is dropped, so that the thread's next statement (a
    mark-sent or a relay wake-up, tried once) runs on a new one instead of failing with "another command is already
    in progress". The interrupted report itself was committed by the server."""
    import os
    import signal

    from celery_fanin.store import batches
    from celery_fanin.store.reports import ReportConnection, note_traceback, record_terminal

    batch, (child,), _ = create(store_engine, 1)
    reports = ReportConnection(clean_db)
    holder = psycopg.connect(clean_db)  # holds the batch's row, so that the report waits for its reply
    holder.execute("SELECT 1 FROM fanin_batches WHERE id = %s FOR UPDATE", (batch.id,))

    def interrupt(*_: object) -> None:
        raise _SoftTimeLimit("soft time limit")

    previous = signal.signal(signal.SIGUSR1, interrupt)
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGUSR1))
    timer.start()
    try:
        with pytest.raises(_SoftTimeLimit):
            record_terminal(reports, child.task_id, "succeeded", claim=batches.Claim(str(batch.id), 0, child.task_name))
    finally:
        timer.cancel()
        signal.signal(signal.SIGUSR1, previous)
        holder.rollback()
        holder.close()

    def state() -> str:
        with store_engine.connect() as conn:
            return str(
                conn.execute(text("SELECT state FROM fanin_batches WHERE id = :i"), {"i": batch.id}).scalar_one()
            )

    wait_for(lambda: state() == "complete", 10, message="the interrupted report committed by the server")
    try:
        note_traceback(
            reports, "no-such-task", "tb", None, None
        )  # the thread's next statement, tried once by its callers
    finally:
        reports.reset()


@pytest.mark.timeout(60)
def test_a_child_report_interrupted_by_the_soft_time_limit_is_sent_again_and_its_successor_left_to_the_relay(
    short_reports: FanIn, store_engine: Engine
) -> None:
    """Celery's soft time limit (SIGUSR1, `SoftTimeLimitExceeded`) can arrive while a pool process waits for its
    child's terminal report, after the task itself has ended. The server commits the report, completing the batch
    and handing its successor to this worker, but nobody reads the answer: the successor would wait out the whole
    hand-off (`fanin_successor_handoff`) before the relay published it. The report is sent again (late: nothing
    counted twice) and the relay is woken for the batch, so its outbox row is due at once."""
    from celery_fanin.protocol import Marker
    from celery_fanin.worker.reporter import Reporter

    published: list[object] = []
    batch, (child,), _ = create(store_engine, 1)
    rec = _soft_time_limit_during(
        short_reports,
        "SELECT 1 FROM fanin_batches WHERE id = %s FOR UPDATE",  # the batch: the report waits for its reply
        batch.id,
        lambda: Reporter(lambda *args: published.append(args)).record_child(
            short_reports,
            child.task_id,
            Marker(str(batch.id), 0, None, task_name=child.task_name),
            "succeeded",
            value=1,
            has_value=True,
        ),
    )
    assert rec is not None and rec.late and not rec.counted, "the second report was counted again"
    assert not published, "a late report published the successor"
    with store_engine.connect() as conn:
        row = conn.execute(
            text(
                "SELECT b.state, b.remaining, o.sent_at IS NULL AS unsent, o.available_at <= now() AS due"
                " FROM fanin_batches b JOIN fanin_outbox o ON o.batch_id = b.id WHERE b.id = :i"
            ),
            {"i": batch.id},
        ).one()
    assert (row.state, row.remaining, row.unsent) == ("complete", 0, True)
    assert row.due, "the successor handed to the interrupted report waits out the hand-off instead of the relay"


def test_a_failed_child_s_report_interrupted_by_the_soft_time_limit_keeps_its_traceback_when_sent_again(
    short_reports: FanIn, store_engine: Engine
) -> None:
    """The same interruption on a failure's report: the first copy is counted with nobody reading its answer, the
    one sent again is late, and the failure's traceback is written all the same (`fanin_note_traceback_v2`: onto
    the counted failure of the same error), as the counted report would have written it."""
    from celery_fanin.protocol import Marker
    from celery_fanin.worker.reporter import Reporter

    batch, (child, _), _ = create(store_engine, 2)
    try:
        raise ValueError("the body failed")
    except ValueError as error:
        exc = error
    rec = _soft_time_limit_during(
        short_reports,
        "SELECT 1 FROM fanin_batches WHERE id = %s FOR UPDATE",
        batch.id,
        lambda: Reporter(None).record_child(
            short_reports,
            child.task_id,
            Marker(str(batch.id), 0, None, task_name=child.task_name),
            "failed",
            exc=exc,
        ),
    )
    assert rec is not None and rec.late and not rec.counted, "the second report was counted again"
    with store_engine.connect() as conn:
        row = conn.execute(
            text("SELECT state, exc_type, traceback FROM fanin_children WHERE task_id = :t"), {"t": child.task_id}
        ).one()
    assert (row.state, row.exc_type) == ("failed", "ValueError")
    assert row.traceback is not None and row.traceback.endswith("ValueError: the body failed\n"), row.traceback


def test_a_successor_s_end_interrupted_by_the_soft_time_limit_is_sent_again(
    short_reports: FanIn, store_engine: Engine
) -> None:
    """The same for a successor's own end (`successor_runs.finish`): the soft time limit hits the wait for it, after
    the body has ended. It is sent again (fenced to the run: nothing moves twice), instead of the exception leaving
    the run unrecorded, its lease to lapse and its body to run a second time."""
    from celery_fanin.store.reports import record_terminal

    batch, (child,), _ = create(store_engine, 1)
    with store_engine.begin() as conn:
        assert record_terminal(Held(conn), child.task_id, "succeeded").counted  # creates the successor
        task_id = conn.execute(
            text("SELECT task_id FROM fanin_successors WHERE batch_id = :b"), {"b": batch.id}
        ).scalar_one()
    live = successor_runs.admit(short_reports, str(batch.id), batch.step, task_id, 0)
    assert live is not None
    _soft_time_limit_during(
        short_reports,
        "SELECT 1 FROM fanin_successors WHERE batch_id = %s FOR UPDATE",  # the successor: its end waits
        batch.id,
        lambda: successor_runs.finish(live, "succeeded"),
    )
    with store_engine.connect() as conn:
        state = conn.execute(text("SELECT state FROM fanin_successors WHERE batch_id = :b"), {"b": batch.id})
        assert state.scalar_one() == "succeeded"


def _soft_time_limit_during(fanin: FanIn, lock: str, row_id: object, report: Callable[[], _T]) -> _T:
    """Run `report` while another session holds the row `lock` selects (`%s`: `row_id`), so that it waits for its
    reply; 0.3 s in, Celery's soft time limit (a real SIGUSR1, raising `SoftTimeLimitExceeded`) interrupts that
    wait, and the row is released 0.3 s later (the first statement then goes on; a retry meets its row)."""
    import os
    import signal

    from celery.exceptions import SoftTimeLimitExceeded

    holder = psycopg.connect(fanin.settings.database_url)
    holder.execute(lock, (row_id,))

    def interrupt(*_: object) -> None:
        holder_release.start()
        raise SoftTimeLimitExceeded("soft time limit")

    holder_release = threading.Timer(0.3, holder.rollback)
    previous = signal.signal(signal.SIGUSR1, interrupt)
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGUSR1))
    timer.start()
    try:
        return report()
    finally:
        timer.cancel()
        signal.signal(signal.SIGUSR1, previous)
        holder_release.join(10)
        holder.close()
        fanin.reports.reset()
