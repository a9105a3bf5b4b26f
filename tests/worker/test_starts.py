"""Children's starts: `fanin_record_starts` moves only open children, a child that ends first carries its start
in its terminal report, and `StartRecorder` batches them off the
child's path (many starts per statement), flushes on demand, and survives a broken connection."""

from __future__ import annotations

import logging
import threading
from datetime import datetime, timedelta, timezone

import psycopg
import pytest
from celery import Celery
from sqlalchemy import Engine

from celery_fanin import FanIn
from celery_fanin.store import batches
from celery_fanin.store.reports import ReportConnection, record_starts, record_terminal
from celery_fanin.worker import process, starts
from celery_fanin.worker.starts import StartRecorder
from tests.sql import Held
from tests.sql import children as child_rows
from tests.store.helpers import create, fetch_all, json_encoded, wait_for

pytestmark = pytest.mark.timeout(60)


def test_record_starts_moves_open_children_only(app: Celery, engine: Engine) -> None:
    batch, children, _ = create(engine, 3)
    reports = ReportConnection(FanIn.of(app).database_url)
    try:
        with engine.begin() as conn:  # child 2 finished before its start arrived (a slow writer, a fast child)
            record_terminal(Held(conn), children[2].task_id, "succeeded", result=json_encoded(2))
        at = datetime(2026, 11, 30, 12, 0, tzinfo=timezone.utc)
        moved = record_starts(
            reports, [batches.Start(c.task_id, 1, "w1@host", at + timedelta(seconds=i)) for i, c in enumerate(children)]
        )
        assert moved == 3
        rows = child_rows(engine, batch.id, "task_id", "state", "attempt", "starts", "worker", "started_at")
        # The finished child keeps its state; its run is still counted, with when and where it started.
        assert [(r["state"], r["attempt"], r["starts"], r["worker"]) for r in rows] == [
            ("started", 1, 1, "w1@host"),
            ("started", 1, 1, "w1@host"),
            ("succeeded", 1, 1, "w1@host"),
        ]
        assert rows[1]["started_at"] == at + timedelta(seconds=1)
        # A second attempt of child 0 (a retry) starts it again; its counters are untouched.
        assert record_starts(reports, [batches.Start(children[0].task_id, 2, "w2@host", at)]) == 1
        assert child_rows(engine, batch.id, "starts")[0]["starts"] == 2
        with engine.connect() as conn:
            counters = fetch_all(
                conn, "SELECT remaining, succeeded, failed FROM fanin_batches WHERE id = :b", b=batch.id
            )
        assert counters == [{"remaining": 2, "succeeded": 1, "failed": 0}]
    finally:
        reports.reset()


def test_recorder_writes_many_starts_per_statement(app: Celery, engine: Engine) -> None:
    batch, children, _ = create(engine, 50)
    fanin = FanIn.of(app)
    writes: list[int] = []
    # An interval no burst outlasts, however slow the machine: the stretch ends only with the flush.
    recorder = StartRecorder(fanin, interval=3600.0)
    cond = recorder._cond = _TimedWaitsCondition()
    original = recorder._write
    recorder._write = lambda batch_: (writes.append(len(batch_)), original(batch_))[1]  # type: ignore[method-assign]
    now = datetime.now(timezone.utc)
    for c in children:  # a burst, as a pool process running short children produces
        recorder.add(batches.Start(c.task_id, 0, "w@host", now))
    wait_for(lambda: cond.waiting_out(60), 10, "the writer to wait out its interval", interval=0.005)
    assert writes == []
    assert recorder.flush(timeout=30)
    assert writes == [50]  # one stretch, one statement
    assert {r["state"] for r in child_rows(engine, batch.id, "state")} == {"started"}


class _CountingCondition(threading.Condition):
    """Counts the wake-ups `add` sends (`notify`), not the writer's own `notify_all` to `flush` waiters (CPython's
    `notify_all` calls `notify`: counted, whether an emptied stretch ended before or after a test's step would
    race with the scheduler)."""

    def __init__(self) -> None:
        super().__init__()
        self.notifies = 0
        self._all = False

    def notify(self, n: int = 1) -> None:
        if not self._all:
            self.notifies += 1
        super().notify(n)

    def notify_all(self) -> None:
        self._all = True  # the lock is held: no other thread reads it meanwhile
        try:
            super().notify_all()
        finally:
            self._all = False


def test_short_children_wake_the_writer_once_per_stretch_and_write_nothing(app: Celery, engine: Engine) -> None:
    """Children that end before their start is written each add a start and take it back: the writer, already
    timing its stretch, is not woken for each of them, and a stretch left empty costs no statement."""
    batch, children, _ = create(engine, 60)
    fanin = FanIn.of(app)
    writes: list[int] = []
    recorder = StartRecorder(fanin, interval=0.3)
    cond = recorder._cond = _CountingCondition()
    original = recorder._write
    recorder._write = lambda batch_: (writes.append(len(batch_)), original(batch_))[1]  # type: ignore[method-assign]
    now = datetime.now(timezone.utc)

    def short_child(task_id: str) -> None:
        recorder.add(batches.Start(task_id, 0, "w@host", now))
        assert recorder.take(task_id) is not None

    short_child(children[0].task_id)  # starts the writer thread
    wait_for(lambda: recorder._idle, 10, "the writer to wait for a start", interval=0.005)  # nothing to write
    recorder.add(batches.Start(children[1].task_id, 0, "w@host", now))  # the first start of a stretch wakes it...
    assert cond.notifies == 1
    wait_for(lambda: not recorder._idle, 10, "the writer to time its stretch", interval=0.005)
    assert recorder.take(children[1].task_id) is not None
    for c in children[2:]:  # ...and the rest of the stretch does not
        short_child(c.task_id)
    assert cond.notifies == 1
    wait_for(lambda: recorder._idle, 10, "the stretch to end", interval=0.005)  # every start taken back
    assert writes == []
    assert recorder.flush(timeout=10)
    assert {r["state"] for r in child_rows(engine, batch.id, "state")} == {"pending"}


def test_recorder_waits_for_its_interval_unless_flushed(app: Celery, engine: Engine) -> None:
    batch, children, _ = create(engine, 1)
    """An interval far longer than the test may run: the writer timing its stretch cannot have written, and a
    flush that returns True before its own (much shorter) timeout did not wait the interval out."""
    recorder = StartRecorder(FanIn.of(app), interval=3600.0)
    cond = recorder._cond = _TimedWaitsCondition()
    recorder.add(batches.Start(children[0].task_id, 0, "w@host", datetime.now(timezone.utc)))
    wait_for(lambda: cond.waiting_out(60), 10, "the writer to wait out its interval", interval=0.005)
    assert child_rows(engine, batch.id, "state")[0]["state"] == "pending"
    assert recorder.flush(timeout=30), "flush waited out the interval instead of writing at once"
    assert child_rows(engine, batch.id, "state")[0]["state"] == "started"


class _TimedWaitsCondition(threading.Condition):
    """Tells whether the writer is blocked waiting out a long interval (a wait with a timeout, not yet woken)."""

    def __init__(self) -> None:
        super().__init__()
        self.timed_wait: float | None = None

    def wait(self, timeout: float | None = None) -> bool:
        self.timed_wait = timeout
        try:
            return super().wait(timeout)
        finally:
            self.timed_wait = None

    def waiting_out(self, at_least: float) -> bool:
        with self:  # the writer holds the lock until its wait releases it
            return self.timed_wait is not None and self.timed_wait >= at_least


def test_recorder_reconnects_after_the_connection_is_killed(app: Celery, engine: Engine) -> None:
    batch, children, _ = create(engine, 2)
    fanin = FanIn.of(app)
    recorder = StartRecorder(fanin, interval=0.0)
    recorder.add(batches.Start(children[0].task_id, 0, "w@host", datetime.now(timezone.utc)))
    assert recorder.flush(timeout=10)
    # Kill every report connection of this database (what a PostgreSQL restart does to them).
    with engine.connect() as conn:
        conn.exec_driver_sql(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = current_database() "
            "AND application_name = 'celery-fanin worker' AND pid <> pg_backend_pid()"
        )
    recorder.add(batches.Start(children[1].task_id, 0, "w@host", datetime.now(timezone.utc)))
    assert recorder.flush(timeout=20)
    assert [r["state"] for r in child_rows(engine, batch.id, "state")] == ["started", "started"]


def test_child_that_ends_before_its_start_is_written_carries_it(app: Celery, engine: Engine) -> None:
    batch, children, _ = create(engine, 2)
    fanin = FanIn.of(app)
    recorder = starts.recorder(fanin)
    at = datetime.now(timezone.utc)
    for c in children:
        recorder.add(batches.Start(c.task_id, 0, "w@host", at))
    taken = starts.take_start(fanin, children[0].task_id)  # what task_postrun does for a finished child
    assert taken is not None and taken.task_id == children[0].task_id
    assert starts.take_start(fanin, children[0].task_id) is None
    rec = record_terminal(fanin.reports, children[0].task_id, "succeeded", result=json_encoded(0), start=taken)
    assert rec.counted and rec.remaining == 1
    assert recorder.flush(timeout=10)  # writes child 1's start only
    rows = child_rows(engine, batch.id, "task_id", "state", "attempt", "starts", "worker", "started_at")
    assert [(r["state"], r["starts"], r["worker"]) for r in rows] == [
        ("succeeded", 1, "w@host"),
        ("started", 1, "w@host"),
    ]
    assert rows[0]["started_at"] == at


def _transient() -> psycopg.OperationalError:
    return psycopg.OperationalError("server closed the connection unexpectedly")


class _Outage:
    """Wraps a recorder's statement: the next `failures` attempts fail as a lost connection does, recording what
    each attempt carried; `hold` (an event) keeps every attempt failing until it is set."""

    def __init__(self, recorder: StartRecorder, failures: int, hold: threading.Event | None = None) -> None:
        self.failures = failures
        self.hold = hold
        self.attempts: list[list[str]] = []
        self._write = recorder._write
        recorder._write = self  # type: ignore[method-assign]

    def __call__(self, batch: list[batches.Start]) -> int:
        self.attempts.append([s.task_id for s in batch])
        if self.hold is not None and not self.hold.is_set():
            raise _transient()
        if self.failures > 0:
            self.failures -= 1
            raise _transient()
        return self._write(batch)


def test_a_start_outlives_an_outage_shorter_than_report_timeout(app: Celery, engine: Engine) -> None:
    """Issue 38, hole 4: a start is retried with backoff until it is written (it used to be dropped after three
    attempts, about 0.6 s of outage), and the starts queued meanwhile join the same statement."""
    batch, children, _ = create(engine, 3)
    recorder = StartRecorder(FanIn.of(app), interval=0.0, timeout=60)
    outage = _Outage(recorder, failures=4)  # four failed attempts: the recorder used to give up after three
    now = datetime.now(timezone.utc)
    recorder.add(batches.Start(children[0].task_id, 0, "w@host", now))
    wait_for(lambda: len(outage.attempts) >= 2, 10, "the write to meet the outage", interval=0.005)
    recorder.add(batches.Start(children[1].task_id, 0, "w@host", now))  # queued during the outage
    recorder.add(batches.Start(children[2].task_id, 0, "w@host", now))
    assert recorder.flush(timeout=30)
    assert [r["state"] for r in child_rows(engine, batch.id, "state")] == ["started", "started", "started"]
    assert len(outage.attempts) == 5
    assert outage.attempts[-1] == [c.task_id for c in children]  # one statement for all of them after the outage


def test_a_child_that_ends_during_an_outage_takes_its_start_back_between_attempts(app: Celery, engine: Engine) -> None:
    batch, children, _ = create(engine, 2)
    recorder = StartRecorder(FanIn.of(app), interval=0.0, timeout=60)
    back = threading.Event()
    outage = _Outage(recorder, failures=0, hold=back)
    at = datetime.now(timezone.utc)
    for c in children:
        recorder.add(batches.Start(c.task_id, 0, "w@host", at))
    wait_for(lambda: bool(outage.attempts) and not recorder._sending, 10, "a failed attempt", interval=0.005)
    taken = recorder.take(children[0].task_id)  # what task_postrun does for a child that ends meanwhile
    assert taken is not None and taken.task_id == children[0].task_id
    assert recorder.queued() == 1
    back.set()
    assert recorder.flush(timeout=30)
    assert outage.attempts[-1] == [children[1].task_id]
    assert [r["state"] for r in child_rows(engine, batch.id, "state")] == ["pending", "started"]


def test_a_start_is_dropped_after_report_timeout(app: Celery, engine: Engine, caplog: pytest.LogCaptureFixture) -> None:
    batch, children, _ = create(engine, 1)
    recorder = StartRecorder(FanIn.of(app), interval=0.0, timeout=0.5)
    outage = _Outage(recorder, failures=0, hold=threading.Event())  # never back
    with caplog.at_level(logging.WARNING, logger="celery_fanin.starts"):
        recorder.add(batches.Start(children[0].task_id, 0, "w@host", datetime.now(timezone.utc)))
        assert recorder.flush(timeout=30)
    assert len(outage.attempts) > 1
    assert "dropped 1 children's start records: the store was unreachable for fanin_report_timeout" in caplog.text
    assert child_rows(engine, batch.id, "state")[0]["state"] == "pending"


def test_queued_starts_are_bounded_and_the_bound_is_logged(
    app: Celery, engine: Engine, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(starts, "MAX_QUEUED", 2)
    batch, children, _ = create(engine, 3)
    recorder = StartRecorder(FanIn.of(app), interval=0.0, timeout=60)
    back = threading.Event()
    outage = _Outage(recorder, failures=0, hold=back)
    at = datetime.now(timezone.utc)
    with caplog.at_level(logging.WARNING, logger="celery_fanin.starts"):
        for c in children:
            recorder.add(batches.Start(c.task_id, 0, "w@host", at))
        assert recorder.queued() == 2
        assert "2 children's start records are waiting for the store (the bound)" in caplog.text
        back.set()
        assert recorder.flush(timeout=30)
        wait_for(lambda: "were dropped meanwhile" in caplog.text, 10, "the bound's end logged", interval=0.005)
    assert outage.attempts[-1] == [c.task_id for c in children[:2]]
    assert [r["state"] for r in child_rows(engine, batch.id, "state")] == ["started", "started", "pending"]


def test_starts_left_at_shutdown_are_logged(
    app: Celery, engine: Engine, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`flush_all` (worker_shutdown) gives the starts a few seconds; what the store could not take meanwhile dies
    with the process, and a warning says how many."""
    batch, children, _ = create(engine, 1)
    fanin = FanIn.of(app)
    recorder = StartRecorder(fanin, interval=0.0, timeout=60)
    monkeypatch.setitem(process.held(starts._Recorders).by_app, fanin, recorder)
    back = threading.Event()
    _Outage(recorder, failures=0, hold=back)
    with caplog.at_level(logging.WARNING, logger="celery_fanin.starts"):
        recorder.add(batches.Start(children[0].task_id, 0, "w@host", datetime.now(timezone.utc)))
        starts.flush_all(timeout=0.5)
    assert "1 children's start records not written at shutdown" in caplog.text
    back.set()
    assert recorder.flush(timeout=30)  # the thread lives on in this process: let it finish before the next test
    assert child_rows(engine, batch.id, "state")[0]["state"] == "started"
