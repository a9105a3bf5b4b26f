"""How a worker's report reaches the store through an outage: retried with backoff for `fanin_report_timeout`,
off the event loop when a main-process signal sends it, and counted when given up."""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg
from celery.exceptions import SoftTimeLimitExceeded
from prometheus_client import Counter
from sqlalchemy.exc import SQLAlchemyError

from .. import retry
from ..context import FanIn
from ..store import reports
from ..store.reports import ReportConnection
from . import process

logger = logging.getLogger("celery_fanin.hooks")

# Reports a worker gave up on (the store stayed unreachable for `fanin_report_timeout`), by kind ("terminal" for
# a child's outcome, "successor" for a successor's state). In the default prometheus_client registry of the process
# that gave up: exported where the worker exports that registry (prometheus_client's multiprocess mode for prefork).
REPORTS_GIVEN_UP = Counter(
    "fanin_worker_reports_given_up", "Reports a worker gave up after fanin_report_timeout.", ["kind"]
)


def _give_up(kind: str, what: str, exc: retry.GaveUp) -> None:
    REPORTS_GIVEN_UP.labels(kind=kind).inc()
    cause = exc.__cause__
    logger.error("gave up recording %s: %s (%s); child_timeout and reconciliation settle it", what, exc, cause)


def send_terminal(
    fanin: FanIn, what: str, fn: Callable[[ReportConnection], Any], *, batch_id: str | None = None
) -> Any:
    """Send one of a child's reports on the process's report connection, as `send` does.

    Each report is a single statement in autocommit on the process's report connection: one round trip. The
    connection is dropped after an error, so each attempt after one reconnects. A report that `background` sent
    and that created the successor of `batch_id` leaves it to the relay (`wake_relay`): nobody is left to publish
    it here.
    """
    return send(fanin, "terminal", what, lambda: fn(fanin.reports), batch_id)


def wake_relay(fanin: FanIn, batch_id: str) -> None:
    """Leave a successor this process's report created to the relay, now (`store.reports.wake_relay`). Never
    raises: if the store cannot be reached, the row is the relay's anyway once its handoff has passed."""
    try:
        reports.wake_relay(fanin.reports, batch_id)
    except Exception as exc:  # noqa: BLE001 - the relay's scan publishes it once due
        logger.warning("cannot wake the relay for batch %s (%s): its scan publishes it", batch_id, exc)


def send(fanin: FanIn, kind: str, what: str, once: Callable[[], Any], batch_id: str | None = None) -> Any:
    """Run `once` (one report) until it succeeds, `fanin_report_timeout` passes or an error proves permanent.

    In a main-process signal handler (`in_event_loop`) only one attempt is made here and the retries are left to
    a thread (`background`), which wakes the relay if the report created `batch_id`'s successor; a pool process
    waits, since it takes its next task only after its report.
    """
    timeout = float(fanin.settings.report_timeout)
    if not in_event_loop_now():
        try:
            return _send_waiting(kind, what, once, timeout)
        except SoftTimeLimitExceeded:
            return _send_again(fanin, kind, what, once, timeout, batch_id)
    # In the worker's event loop (a main-process signal): one attempt here; if the store is unreachable, the rest
    # of the retrying is done by a thread, since waiting here would stall the whole worker for the outage.
    try:
        return once()
    except Exception as exc:
        if not retry.is_transient(exc):
            _permanent(kind, what)
            return None
        logger.warning("cannot record %s now (%s); retrying off the event loop", what, retry.brief(exc))
        background().submit(lambda: _wake_if_created(fanin, batch_id, _send_waiting(kind, what, once, timeout)))
        return None


def _send_again(
    fanin: FanIn, kind: str, what: str, once: Callable[[], Any], timeout: float, batch_id: str | None
) -> Any:
    """A soft time limit raised into a pool process's wait for a report's reply: the task has already ended, and
    the server may have committed the report with nobody reading its answer. Reports are idempotent, so it is sent
    again (a late copy if the first committed). A successor the first created and handed to this worker is lost with
    that answer: the relay is woken for the batch, instead of publishing it only once the hand-off has passed. Only
    a resend that comes back late needs it (the first committed); one that counted returns its successor itself."""
    logger.warning("recording %s was interrupted by the soft time limit; sending it again", what)
    rec = _send_waiting(kind, what, once, timeout)
    if batch_id is not None and getattr(rec, "late", False):
        wake_relay(fanin, batch_id)
    return rec


def _wake_if_created(fanin: FanIn, batch_id: str | None, rec: Any) -> None:
    if batch_id is not None and getattr(rec, "successor_created", False):
        wake_relay(fanin, batch_id)


def _send_waiting(kind: str, what: str, once: Callable[[], Any], timeout: float) -> Any:
    try:
        return retry.call(once, what=f"recording {what}", timeout=timeout)
    except retry.GaveUp as exc:
        _give_up(kind, what, exc)
    except (SQLAlchemyError, psycopg.Error):  # permanent (a permission, a schema out of date): retrying won't help
        _permanent(kind, what)
    return None


def _permanent(kind: str, what: str) -> None:
    REPORTS_GIVEN_UP.labels(kind=kind).inc()
    logger.exception("cannot record %s (not a transient error, not retried)", what)


class BackgroundReports:
    """Reports of the worker's main process that met an outage, retried in order by one daemon thread.

    The main process runs the worker's event loop (consuming, acknowledging, broker heartbeats, pool results), so it
    must not wait for the store; a pool process may, since it takes its next task only after its report. Reports
    still queued when the worker stops get a few seconds (`flush`); any left are found by reconciliation and
    child_timeout, like a report given up.
    """

    def __init__(self) -> None:
        self._queue: queue.Queue[Callable[[], Any]] = queue.Queue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def submit(self, job: Callable[[], Any]) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="celery-fanin-reports", daemon=True)
                self._thread.start()
            self._queue.put(job)

    def _run(self) -> None:
        jobs = self._queue
        while True:
            job = jobs.get()
            try:
                job()
            except Exception:  # noqa: BLE001 - the thread must survive anything; the job logs its own failures
                logger.exception("background report failed")
            finally:
                jobs.task_done()

    def flush(self, timeout: float) -> bool:
        """Wait until every report queued so far was sent or given up; False if `timeout` passed first."""
        deadline = time.monotonic() + timeout
        jobs = self._queue
        with jobs.all_tasks_done:
            while jobs.unfinished_tasks:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                jobs.all_tasks_done.wait(left)
        return True


def background() -> BackgroundReports:
    """This process's background reports (`worker.process`: made anew in a forked pool process)."""
    return process.held(BackgroundReports)


_loop = threading.local()  # `active` while a main-process (event loop) signal handler runs


def in_event_loop_now() -> bool:
    """Whether this thread is in a main-process signal handler (`in_event_loop`): nothing may wait here."""
    return bool(getattr(_loop, "active", False))


def in_event_loop(handler: Callable[..., None]) -> Callable[..., None]:
    """Mark a handler of a signal that Celery sends in the worker's main process (see `send`)."""

    @functools.wraps(handler)
    def marked(*args: Any, **kwargs: Any) -> None:
        _loop.active = True
        try:
            handler(*args, **kwargs)
        finally:
            _loop.active = False

    return marked
