"""Children's start records, queued by the worker hooks and written many per statement by a thread of the
same process (docs/concepts/worker.md).

A start is kept until it is written, through a database outage as long as `fanin_report_timeout`, like a report:
the relay's expiry sweep reads a child with no start as one no worker took (docs/concepts/terminal-outcomes.md).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import deque
from datetime import datetime, timezone
from typing import NamedTuple

from .. import retry
from ..context import FanIn
from ..store import reports
from ..store.batches import Start
from . import process

logger = logging.getLogger("celery_fanin.starts")

MAX_PER_WRITE = 1000  # starts per statement
# Starts one process keeps while the store is unreachable. A prefork pool process runs one child at a time and
# waits for each terminal report, so it holds a handful; this bounds a threads or gevent pool running thousands of
# long children through a long outage (a start is a few hundred bytes: about 20 MB at the bound).
MAX_QUEUED = 50_000


class _Queued(NamedTuple):
    start: Start
    deadline: float  # time.monotonic() past which the start is dropped: queued + fanin_report_timeout


class StartRecorder:
    """Gathers starts and writes them from a daemon thread, at most once per `interval` seconds.

    Waiting `interval` after the first queued start lets one statement carry every start of that stretch (a pool
    process starts hundreds of short children a second): the database does one update per stretch, not one per
    child. A child that ends sooner than that takes its start back (`take`) and its terminal report records it.

    A statement that meets a transient error is retried with the project's backoff (`retry.call`) until each of
    its starts has waited `timeout` seconds (`fanin_report_timeout`); the starts queued meanwhile join it, so the
    statement after an outage still carries them all. Between attempts a child that ends takes its start back as
    before. A start past its `timeout`, or one that meets a permanent error, is dropped with a warning.
    """

    def __init__(self, fanin: FanIn, interval: float = 0.25, timeout: float | None = None) -> None:
        self._fanin = fanin
        self._interval = interval
        self._timeout = float(fanin.settings.report_timeout) if timeout is None else timeout
        self._flushing = False
        self._pending: deque[_Queued] = deque()
        self._inflight: list[_Queued] = []  # the statement's starts, kept between attempts while it is retried
        self._sending = False  # an attempt is running with `_inflight` as it was: `take` leaves them alone then
        self._refused = 0  # starts not queued because MAX_QUEUED were waiting (logged once per episode)
        self._cond = threading.Condition()
        self._idle = False  # the writer waits for a stretch's first start: only then must `add` wake it
        self._thread: threading.Thread | None = None

    def add(self, start: Start) -> None:
        with self._cond:
            if self._thread is None or not self._thread.is_alive():  # the first start (this object is per process)
                self._sending = False
                self._idle = False
                self._thread = threading.Thread(target=self._run, name="celery-fanin-starts", daemon=True)
                self._thread.start()
            if len(self._pending) + len(self._inflight) >= MAX_QUEUED:
                self._refused += 1
                if self._refused == 1:
                    logger.warning(
                        "%d children's start records are waiting for the store (the bound): new starts are dropped "
                        "until it is back; a dropped start of a child with `expires` may let the relay count that "
                        "child revoked",
                        MAX_QUEUED,
                    )
                return
            self._pending.append(_Queued(start, time.monotonic() + self._timeout))
            if self._idle or len(self._pending) >= MAX_PER_WRITE:
                # The first start of a stretch, or a full one. Otherwise the writer is already timing its stretch:
                # waking it for every start (short children add and take back one each) cost a pool process a
                # thread switch per child.
                self._cond.notify()

    def take(self, task_id: str) -> Start | None:
        """Remove and return this child's start if it is still queued: its terminal report carries it instead.

        A start in a statement being retried is taken too, between attempts; one in a statement on its way is not
        (both would count the run): that statement records it, even after the terminal report."""
        with self._cond:
            for i in range(len(self._pending) - 1, -1, -1):  # the newest first: it is almost always the last one
                if self._pending[i].start.task_id == task_id:
                    queued = self._pending[i]
                    del self._pending[i]
                    return queued.start
            if not self._sending:
                for i, queued in enumerate(self._inflight):
                    if queued.start.task_id == task_id:
                        del self._inflight[i]
                        return queued.start
        return None

    def queued(self) -> int:
        """How many starts are waiting to be written (in this process)."""
        with self._cond:
            return len(self._pending) + len(self._inflight)

    def flush(self, timeout: float) -> bool:
        """Wait until every start added so far is written (or dropped); False if `timeout` passed first."""
        deadline = time.monotonic() + timeout
        with self._cond:
            self._flushing = True
            self._cond.notify_all()
            try:
                while self._pending or self._inflight:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    self._cond.wait(left)
                return True
            finally:
                self._flushing = False

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending:
                    self._idle = True
                    self._cond.wait()
                self._idle = False
                due = time.monotonic() + self._interval
                while len(self._pending) < MAX_PER_WRITE and not self._flushing:
                    left = due - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
                self._inflight = [self._pending.popleft() for _ in range(min(len(self._pending), MAX_PER_WRITE))]
                if not self._inflight:  # every start of the stretch was taken back by its terminal report
                    self._cond.notify_all()  # a `flush` may be waiting for the queue to empty
                    continue
            try:
                self._send()
            except Exception:  # noqa: BLE001 - the thread must survive anything
                logger.exception("dropped %d children's start records", len(self._inflight))
            finally:
                with self._cond:
                    self._inflight = []
                    self._sending = False
                    if self._refused and len(self._pending) < MAX_QUEUED:
                        logger.warning("start records are queued again; %d were dropped meanwhile", self._refused)
                        self._refused = 0
                    self._cond.notify_all()

    def _send(self) -> None:
        """Write `_inflight` until it is written, every start in it is past its deadline, or an error is permanent."""
        while True:
            with self._cond:
                deadline = max((q.deadline for q in self._inflight), default=None)
            if deadline is None:
                return  # every start taken back by its terminal report, or dropped
            try:
                retry.call(self._attempt, what="writing start records", timeout=deadline - time.monotonic())
                return
            except retry.GaveUp as exc:
                # Starts that joined the statement later may still have time: go round again with those.
                self._drop_expired(exc.__cause__)
            except Exception as exc:  # noqa: BLE001 - permanent (a permission, a schema out of date): not retried
                with self._cond:
                    dropped, self._inflight = len(self._inflight), []
                logger.error("dropped %d children's start records: %s", dropped, retry.brief(exc), exc_info=exc)
                return

    def _attempt(self) -> int:
        """One statement: the starts still in flight and within their deadline, and those queued since."""
        self._drop_expired(None)
        with self._cond:
            while self._pending and len(self._inflight) < MAX_PER_WRITE:  # queued during the outage
                self._inflight.append(self._pending.popleft())
            batch = [q.start for q in self._inflight]
            self._sending = bool(batch)
        if not batch:
            return 0
        try:
            return self._write(batch)
        finally:
            with self._cond:
                self._sending = False

    def _write(self, batch: list[Start]) -> int:
        return reports.record_starts(self._fanin.reports, batch)

    def _drop_expired(self, cause: BaseException | None) -> None:
        now = time.monotonic()
        with self._cond:
            expired = [q for q in self._inflight if q.deadline <= now]
            if expired:
                self._inflight = [q for q in self._inflight if q.deadline > now]
        if expired:
            logger.warning(
                "dropped %d children's start records: the store was unreachable for fanin_report_timeout (%.0fs)%s",
                len(expired),
                self._timeout,
                f" ({retry.brief(cause)})" if cause is not None else "",
            )


class _Recorders:
    """This process's recorders, one per app (`worker.process`: made anew in a forked pool process)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_app: weakref.WeakKeyDictionary[FanIn, StartRecorder] = weakref.WeakKeyDictionary()


def recorder(fanin: FanIn) -> StartRecorder:
    held = process.held(_Recorders)
    with held.lock:
        found = held.by_app.get(fanin)
        if found is None:
            found = held.by_app[fanin] = StartRecorder(fanin, float(fanin.settings.start_write_interval))
        return found


def recorders() -> list[StartRecorder]:
    """This process's recorders."""
    held = process.held(_Recorders)
    with held.lock:
        return list(held.by_app.values())


def note_start(fanin: FanIn, task_id: str, attempt: int, worker: str | None) -> None:
    """Queue a child's start for this process's writer thread (called from `task_prerun`)."""
    recorder(fanin).add(Start(task_id, attempt, worker, datetime.now(timezone.utc)))


def take_start(fanin: FanIn, task_id: str) -> Start | None:
    """The child's start if this process queued it and has not written it yet (see `StartRecorder.take`)."""
    held = process.held(_Recorders)
    with held.lock:
        found = held.by_app.get(fanin)
    return found.take(task_id) if found is not None else None


def flush_all(timeout: float = 5.0) -> None:
    """Write what is still queued (when a pool process or the worker shuts down).

    Starts still unwritten after `timeout` (the store unreachable) die with the process, with a warning. At a warm
    shutdown every child of the process has ended by then and its terminal report carried its start (`take`), so
    only the start details of children already counted are lost; a child killed mid-run (a cold shutdown) keeps
    no start, as if it had never been taken: see docs/concepts/worker.md.
    """
    for rec in recorders():
        if not rec.flush(timeout):
            left = rec.queued()
            if left:
                logger.warning(
                    "%d children's start records not written at shutdown (the store unreachable for %.0fs): dropped",
                    left,
                    timeout,
                )
