"""Children's start records, written off the child's path by a thread of the process that runs it.

A start says "a worker took this child" (when, which attempt, which worker): `status` shows it, and child_timeout
measures a running child from it. `task_prerun` only queues it; a daemon thread of the same (pool) process writes
the starts queued since its previous write with one statement (`fanin_record_starts`,
migrations/0006_batched_starts.sql). So the child's own path waits for one round trip only, its terminal report:
with prefork's fair scheduling a pool process takes its next task only after the last one returned, and every
wait on that path is lost throughput. (Celery's main process also learns of starts, in `Request.on_accepted`, but
it is the busiest process of a prefork worker with short tasks; writing there slowed the whole worker down.)

A child that ends before its start was written takes the start out of the queue and hands it to its terminal
report, which records both in the same row update: no statement of its own, and `starts` still counts every run.
A start is advisory and its write is best effort: committed asynchronously, retried a few times, then dropped with
a warning. A lost start leaves the child timed from its creation, as if it had not started.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections import deque
from datetime import datetime, timezone

from .. import retry
from ..context import FanIn
from ..store.batches import Start

logger = logging.getLogger("celery_fanin.starts")

MAX_PER_WRITE = 1000  # starts per statement
# A start is advisory: its write is retried briefly (transient errors only), then dropped with a warning.
WRITE_ATTEMPTS = 3
WRITE_TIMEOUT = 5.0


class StartRecorder:
    """Gathers starts and writes them from a daemon thread, at most once per `interval` seconds.

    Waiting `interval` after the first queued start lets one statement carry every start of that stretch (a pool
    process starts hundreds of short children a second): the database does one update per stretch, not one per
    child. A start is advisory, so a fraction of a second's delay changes nothing a reader relies on; a child
    that ends sooner than that takes its start back (`take`) and its terminal report records it.
    """

    def __init__(self, fanin: FanIn, interval: float = 0.25) -> None:
        self._fanin = fanin
        self._interval = interval
        self._flushing = False
        self._pending: deque[Start] = deque()
        self._cond = threading.Condition()
        self._writing = 0
        self._idle = False  # the writer waits for a stretch's first start: only then must `add` wake it
        self._thread: threading.Thread | None = None
        self._pid: int | None = None

    def add(self, start: Start) -> None:
        with self._cond:
            if self._thread is None or self._pid != os.getpid() or not self._thread.is_alive():
                # First start in this process (or a forked copy, whose parent's thread does not exist here).
                self._pending.clear()
                self._writing = 0
                self._idle = False
                self._pid = os.getpid()
                self._thread = threading.Thread(target=self._run, name="celery-fanin-starts", daemon=True)
                self._thread.start()
            self._pending.append(start)
            if self._idle or len(self._pending) >= MAX_PER_WRITE:
                # The first start of a stretch, or a full one. Otherwise the writer is already timing its stretch:
                # waking it for every start (short children add and take back one each) cost a pool process a
                # thread switch per child.
                self._cond.notify()

    def take(self, task_id: str) -> Start | None:
        """Remove and return this child's start if it is still queued: its terminal report carries it instead."""
        with self._cond:
            if self._pid != os.getpid():
                return None
            for i in range(len(self._pending) - 1, -1, -1):  # the newest first: it is almost always the last one
                if self._pending[i].task_id == task_id:
                    start = self._pending[i]
                    del self._pending[i]
                    return start
        return None

    def flush(self, timeout: float) -> bool:
        """Wait until every start added so far is written (or dropped); False if `timeout` passed first."""
        deadline = time.monotonic() + timeout
        with self._cond:
            self._flushing = True
            self._cond.notify_all()
            try:
                while self._pending or self._writing:
                    left = deadline - time.monotonic()
                    if left <= 0 or self._pid != os.getpid():
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
                batch = [self._pending.popleft() for _ in range(min(len(self._pending), MAX_PER_WRITE))]
                self._writing = len(batch)
                if not batch:  # every start of the stretch was taken back by its terminal report: nothing to write
                    self._cond.notify_all()  # a `flush` may be waiting for the queue to empty
                    continue
            try:
                self._write(batch)
            finally:
                with self._cond:
                    self._writing = 0
                    self._cond.notify_all()

    def _write(self, batch: list[Start]) -> None:
        def write() -> int:
            return self._fanin.reports.record_starts(batch)

        try:
            retry.call(write, what="writing start records", attempts=WRITE_ATTEMPTS, timeout=WRITE_TIMEOUT)
        except retry.GaveUp as exc:
            logger.warning("dropped %d children's start records (advisory): %s", len(batch), exc.__cause__)
        except Exception:  # noqa: BLE001 - the thread must survive anything: starts are advisory
            logger.exception("dropped %d children's start records", len(batch))


_recorders: weakref.WeakKeyDictionary[FanIn, StartRecorder] = weakref.WeakKeyDictionary()
_recorders_lock = threading.Lock()


def recorder(fanin: FanIn) -> StartRecorder:
    with _recorders_lock:
        found = _recorders.get(fanin)
        if found is None:
            found = _recorders[fanin] = StartRecorder(fanin, float(fanin.setting("start_write_interval")))
        return found


def note_start(fanin: FanIn, task_id: str, attempt: int, worker: str | None) -> None:
    """Queue a child's start for this process's writer thread (called from `task_prerun`)."""
    recorder(fanin).add(Start(task_id, attempt, worker, datetime.now(timezone.utc)))


def take_start(fanin: FanIn, task_id: str) -> Start | None:
    """The child's start if this process queued it and has not written it yet (see `StartRecorder.take`)."""
    with _recorders_lock:
        found = _recorders.get(fanin)
    return found.take(task_id) if found is not None else None


def flush_all(timeout: float = 5.0) -> None:
    """Write what is still queued (when a pool process or the worker shuts down)."""
    with _recorders_lock:
        recorders = list(_recorders.values())
    for rec in recorders:
        rec.flush(timeout)
