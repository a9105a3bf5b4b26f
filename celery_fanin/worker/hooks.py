"""The worker side: every Celery path that ends a child, mapped to one `record_terminal` call.

Where each outcome surfaces (celery 5.5 to 5.7; see docs/concepts and ../shared/notes/celery-terminal-paths.md):

===============================================  ==============  ==============================================
outcome                                          process         hook used here
===============================================  ==============  ==============================================
success, failure, soft time limit, Reject(False)  pool child      ``task_postrun`` (state, retval)
retry, Reject(requeue=True), Ignore               pool child      ``task_postrun``: not terminal, ignored
hard time limit, pool process lost (no requeue)   main            ``task_failure`` with TimeLimitExceeded /
                                                                  WorkerLostError
revoked (before start, expired, terminated)       main            ``task_revoked``
unregistered task name                            main            ``task_unknown``
message that cannot be decoded                    main            ``task_rejected`` (headers when readable), or
                                                                  ``Consumer.on_decode_error`` (corrupt body)
===============================================  ==============  ==============================================

A child's start is only queued by ``task_prerun`` (a thread writes starts in batches: `celery_fanin.worker.starts`); its
terminal outcome is one statement on the process's report connection (`store.reports`), the only round trip on the
child's own path. Tasks without the fan-in headers return from every hook before any database work. The main
process learns a child's headers from ``task_received`` (an in-memory map with an entry per live request), since
celery 5.5/5.6 give ``task_failure`` no request there. Duplicate reports (5.7 sends ``task_failure`` twice for a
hard time limit) are harmless: the store counts a child once.
"""

from __future__ import annotations

import functools
import logging
import os
import queue
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from typing import Any

import psycopg
from billiard.exceptions import TimeLimitExceeded, WorkerLostError
from celery import Celery, chord, signals
from celery.canvas import _chain
from celery.exceptions import Ignore, Reject, Retry, SoftTimeLimitExceeded
from kombu.exceptions import EncodeError
from sqlalchemy.exc import SQLAlchemyError

from .. import retry
from ..codec import encode_result
from ..context import FanIn
from ..exceptions import FanInNotConfigured
from ..protocol import Marker
from ..store import batches
from ..store.reports import ReportConnection
from . import metrics, starts, successor_runs

logger = logging.getLogger("celery_fanin.hooks")

_installed = False
_install_lock = threading.Lock()


class _ReceivedMarkers:
    """task id -> marker for the fan-in messages the main process holds a request for.

    An entry lives as long as Celery's `Request` for the message: the main process needs the marker only while
    that request can still end in a main-process failure (hard time limit, lost pool process), and no signal
    fires in the main process when a child succeeds. A weak reference's callback drops the entry when Celery
    lets the request go, so the map holds the worker's reserved and running fan-in requests, not its history.
    The bound is a safety net for requests kept alive elsewhere; the oldest entry goes first.
    """

    def __init__(self, limit: int = 100_000) -> None:
        self._data: OrderedDict[str, tuple[Marker, weakref.ref[Any]]] = OrderedDict()
        self._limit = limit
        # Reentrant: a garbage collection can start at any allocation inside `add` and release a request whose
        # callback then runs on this thread, with the lock held.
        self._lock = threading.RLock()

    def add(self, task_id: str, marker: Marker, request: Any) -> None:
        def release(ref: weakref.ref[Any]) -> None:
            with self._lock:
                entry = self._data.get(task_id)
                if entry is not None and entry[1] is ref:  # a redelivery under the same id keeps its own entry
                    del self._data[task_id]

        with self._lock:
            self._data[task_id] = (marker, weakref.ref(request, release))
            if len(self._data) > self._limit:
                self._data.popitem(last=False)

    def get(self, task_id: str) -> Marker | None:
        with self._lock:
            entry = self._data.get(task_id)
        return entry[0] if entry is not None else None

    def pop(self, task_id: str) -> Marker | None:
        with self._lock:
            entry = self._data.pop(task_id, None)
        return entry[0] if entry is not None else None

    def __len__(self) -> int:
        return len(self._data)


_received = _ReceivedMarkers()


def _fanin_for(app: Celery | None) -> FanIn | None:
    return FanIn.find(app) if app is not None else None


# Reports a worker gave up on, and terminal reports the store refused (celery_fanin.metrics describes both).
REPORTS_GIVEN_UP = metrics.REPORTS_GIVEN_UP
_REFUSED = metrics.REPORTS_REFUSED


def _give_up(kind: str, what: str, exc: retry.GaveUp) -> None:
    REPORTS_GIVEN_UP.labels(kind=kind).inc()
    cause = exc.__cause__
    logger.error("gave up recording %s: %s (%s); child_timeout and reconciliation settle it", what, exc, cause)


def _report_with_retries(fanin: FanIn, what: str, fn: Callable[[ReportConnection], Any]) -> Any:
    """Send one of a child's reports with the same policy as above.

    Each report is a single statement in autocommit on the process's report connection: one round trip. The
    connection is dropped after an error, so each attempt after one reconnects.
    """
    return _send(fanin, "terminal", what, lambda: fn(fanin.reports))


def _send(fanin: FanIn, kind: str, what: str, once: Callable[[], Any]) -> Any:
    timeout = _report_timeout(fanin)
    if not getattr(_loop, "active", False):
        return _send_waiting(kind, what, once, timeout)
    # In the worker's event loop (a main-process signal): one attempt here; if the store is unreachable, the rest
    # of the retrying is done by a thread, since waiting here would stall the whole worker for the outage.
    try:
        return once()
    except Exception as exc:
        if not retry.is_transient(exc):
            _permanent(kind, what)
            return None
        logger.warning("cannot record %s now (%s); retrying off the event loop", what, retry.brief(exc))
        _background.submit(lambda: _send_waiting(kind, what, once, timeout))
        return None


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


class _BackgroundReports:
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
        self._pid: int | None = None

    def submit(self, job: Callable[[], Any]) -> None:
        with self._lock:
            if self._thread is None or self._pid != os.getpid() or not self._thread.is_alive():
                if self._pid != os.getpid():
                    self._queue = queue.Queue()  # a forked copy: the parent's queued reports are the parent's
                self._pid = os.getpid()
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
        if self._pid != os.getpid():
            return True  # nothing submitted in this process (a pool process inherits the parent's queue object)
        deadline = time.monotonic() + timeout
        jobs = self._queue
        with jobs.all_tasks_done:
            while jobs.unfinished_tasks:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                jobs.all_tasks_done.wait(left)
        return True


_background = _BackgroundReports()
_loop = threading.local()  # `active` while a main-process (event loop) signal handler runs


def _in_event_loop(handler: Callable[..., None]) -> Callable[..., None]:
    """Mark a handler of a signal that Celery sends in the worker's main process (see `_send`)."""

    @functools.wraps(handler)
    def marked(*args: Any, **kwargs: Any) -> None:
        _loop.active = True
        try:
            handler(*args, **kwargs)
        finally:
            _loop.active = False

    return marked


def _report_timeout(fanin: FanIn) -> float:
    return float(fanin.setting("report_timeout"))


def _exc_fields(exc: BaseException | None) -> tuple[str | None, str | None]:
    if exc is None:
        return None, None
    return type(exc).__name__, str(exc)[:2000]


def claim_of(marker: Marker) -> batches.Claim:
    """What a message says its child is, which the store checks before counting the report."""
    return batches.Claim(marker.batch_id, marker.index, marker.task_name)


# --- children ------------------------------------------------------------------------------------------------


def record_child(
    fanin: FanIn,
    task_id: str,
    marker: Marker,
    state: str,
    *,
    value: Any = None,
    has_value: bool = False,
    exc: BaseException | None = None,
    start: batches.Start | None = None,
) -> batches.TerminalRecord | None:
    result = None
    if has_value:
        try:
            result = encode_result(fanin.app, value)
        except EncodeError as err:  # the child succeeded; only its value cannot be kept
            logger.warning("result of task_id=%s cannot be encoded, stored as none: %s", task_id, err)
    exc_type, exc_message = _exc_fields(exc)
    claim = claim_of(marker)
    rec: batches.TerminalRecord | None = _report_with_retries(
        fanin,
        f"terminal outcome of task {task_id}",
        lambda reports: reports.record_terminal(
            task_id, state, result=result, exc_type=exc_type, exc_message=exc_message, start=start, claim=claim
        ),
    )
    extra = {"batch_id": marker.batch_id, "child_index": marker.index, "task_id": task_id, "state": state}
    if rec is None:
        return None
    if rec.counted:
        logger.debug("child done batch_id=%s index=%s task_id=%s state=%s remaining=%s", marker.batch_id,
                     marker.index, task_id, state, rec.remaining, extra=extra)  # fmt: skip
        if rec.successor_created:
            logger.info("batch complete batch_id=%s: successor created", marker.batch_id, extra=extra)
    elif rec.refused:
        _REFUSED.inc()
        why = "forged or misrouted message"
        what = (task_id, marker.index, marker.batch_id, marker.task_name, why)
        logger.warning("report refused: task_id=%s is not child %s of batch %s as task %s (%s)", *what, extra=extra)
    else:
        logger.info("late or repeated report not counted batch_id=%s index=%s task_id=%s state=%s",
                    marker.batch_id, marker.index, task_id, state, extra=extra)  # fmt: skip
    return rec


# --- successors ----------------------------------------------------------------------------------------------


def record_successor(
    fanin: FanIn,
    marker: Marker,
    state: str,
    exc: BaseException | None = None,
    value: Any = None,
    live: successor_runs.LiveRun | None = None,
) -> bool:
    """Record a successor's final state: fenced to `live`'s run, or unfenced from the main process."""
    exc_type, exc_message = _exc_fields(exc)
    result = None
    if state == "succeeded":
        try:
            result = encode_result(fanin.app, value)
        except EncodeError as err:
            logger.warning("result of the successor of batch_id=%s cannot be encoded: %s", marker.batch_id, err)
    if live is not None:
        return successor_runs.finish(live, state, result=result, exc_type=exc_type, exc_message=exc_message)
    done = _send(
        fanin,
        "successor",
        f"successor state of batch {marker.batch_id}",
        lambda: successor_runs.record_final(
            fanin, marker.batch_id, marker.step or "", state, result=result, exc_type=exc_type, exc_message=exc_message
        ),
    )
    return bool(done)


def admit_successor(fanin: FanIn, request: Any, task_id: str, marker: Marker) -> successor_runs.LiveRun | None:
    """Start a run of the successor for this execution (attached to its request), or None for a duplicate.

    A copy the relay republished starts at Celery retry count 0: the run resumes the successor's own count, so
    that `max_retries` bounds the retries of the successor, not of each copy.
    """
    retries = int(getattr(request, "retries", 0) or 0)
    live = successor_runs.admit(fanin, marker.batch_id, marker.step or "", task_id, retries)
    if live is None:
        return None
    successor_runs.attach(request, live)
    if live.run.attempt > retries:
        request.retries = live.run.attempt
    return live


def _guard(before_start: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a task's `before_start` so that a successor's body runs in one execution at a time, never after it
    ended for good (see `store.successors`).

    `before_start` runs inside the trace's exception handling, so the `Ignore` raised for a duplicate delivery
    ends that execution as IGNORED without running its body (and without touching the live run's state).
    """

    def before_start_guarded(self: Any, task_id: str, args: Any, kwargs: Any) -> Any:
        marker = Marker.from_mapping(self.request)
        fanin = _fanin_for(self.app) if marker is not None and marker.is_successor else None
        if (
            fanin is not None
            and marker is not None
            and successor_runs.request_run(self.request) is None
            and admit_successor(fanin, self.request, task_id, marker) is None
        ):
            logger.warning(
                "duplicate delivery of successor batch_id=%s step=%s task_id=%s: body not run",
                marker.batch_id,
                marker.step,
                task_id,
                extra={"batch_id": marker.batch_id, "step": marker.step, "task_id": task_id},
            )
            raise Ignore()
        return before_start(self, task_id, args, kwargs)

    before_start_guarded._fanin_guard = True  # type: ignore[attr-defined]
    return before_start_guarded


def _due_at(eta: datetime | None, countdown: float | None) -> datetime:
    if eta is not None:
        return eta if eta.tzinfo is not None else eta.replace(tzinfo=timezone.utc)
    return datetime.now(timezone.utc) + timedelta(seconds=float(countdown or 0))


@contextmanager
def _handed_over(
    live: successor_runs.LiveRun, state: str, ends: type[BaseException], due_at: datetime | None = None
) -> Iterator[None]:
    """Hand the run over for the call inside, which publishes the next delivery and ends with `ends`; if it
    raises anything else, nothing was handed on and the run is taken back."""
    successor_runs.hand_over(live, state, due_at)
    try:
        yield
    except ends:
        raise
    except BaseException:
        successor_runs.take_back(live)
        raise


def _retry_guard(retry: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap `Task.retry` so that a successor's run is handed over before Celery publishes the retry.

    Celery publishes the retry message inside `retry()`, before the attempt's `task_postrun`: without this the
    retry could be delivered while the attempt still holds the run, and be refused as a duplicate. If no retry is
    published (max_retries exceeded, or publishing failed), the run is taken back and the attempt goes on.
    """

    def retry_guarded(
        self: Any,
        args: Any = None,
        kwargs: Any = None,
        exc: BaseException | None = None,
        throw: bool = True,
        eta: datetime | None = None,
        countdown: float | None = None,
        max_retries: int | None = None,
        **options: Any,
    ) -> Any:
        live = successor_runs.request_run(self.request)
        if live is None or live.ended or self.request.is_eager:
            return retry(self, args, kwargs, exc, throw, eta, countdown, max_retries, **options)
        delay = countdown if countdown is not None or eta is not None else self.default_retry_delay
        with _handed_over(live, "retrying", Retry, _due_at(eta, delay)):
            return retry(self, args, kwargs, exc, throw, eta, countdown, max_retries, **options)

    retry_guarded._fanin_guard = True  # type: ignore[attr-defined]
    return retry_guarded


def _replace_guard(on_replace: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap `Task.on_replace` (called by `Task.replace`) so that the replacement carries the fan-in on.

    The replacement has the replaced task's id but none of its custom headers: it gets the fan-in headers, so a
    child is counted when its replacement ends, and a successor ends when its replacement does. A successor's run
    is handed over (`replaced`) before the replacement is published, so the replacement's delivery is admitted.
    """

    def on_replace_guarded(self: Any, sig: Any) -> Any:
        marker = Marker.from_mapping(self.request)
        if marker is None or self.request.is_eager:
            return on_replace(self, sig)
        carrier = _carrier(sig)
        carrier.options["headers"] = {**(carrier.options.get("headers") or {}), **marker.headers()}
        live = successor_runs.request_run(self.request) if marker.is_successor else None
        if live is None or live.ended:
            return on_replace(self, sig)
        with _handed_over(live, "replaced", Ignore):
            return on_replace(self, sig)

    on_replace_guarded._fanin_guard = True  # type: ignore[attr-defined]
    return on_replace_guarded


def _carrier(sig: Any) -> Any:
    """The task of a replacement that takes the replaced task's id, and so its place (`Task.replace` freezes the
    replacement with that id: a chain's last task, a chord's body)."""
    if isinstance(sig, _chain) and sig.tasks:
        return _carrier(sig.tasks[-1])
    if isinstance(sig, chord):
        return _carrier(sig.body)
    return sig


def guard_tasks(app: Celery) -> bool:
    """Give every task of `app` the successor run guard and the retry and replace hand-overs; True if any task
    was changed."""
    changed = False
    for task in app.tasks.values():
        cls = type(task)
        for method, around in (("before_start", _guard), ("retry", _retry_guard), ("on_replace", _replace_guard)):
            if not getattr(getattr(cls, method), "_fanin_guard", False):
                cls.add_around(method, around)  # Celery's own mechanism for wrapping task methods
                changed = True
    return changed


# --- signal handlers -------------------------------------------------------------------------------------------


def _on_postrun(sender: Any = None, task_id: str | None = None, task: Any = None, retval: Any = None,
                state: str | None = None, **_: Any) -> None:  # fmt: skip
    task = task or sender
    if task is None or task_id is None:
        return
    marker = Marker.from_mapping(task.request)
    if marker is None:
        return
    fanin = _fanin_for(task.app)
    if fanin is None:
        return
    if marker.is_successor:
        _successor_postrun(fanin, marker, successor_runs.request_run(task.request), state, retval)
        return
    child_id = marker.child_id(task_id)
    if state == "SUCCESS":
        if child_id != task_id:
            return  # a chain's earlier task: the worker publishes the next, and the last one reports
        start = starts.take_start(fanin, task_id)
        record_child(fanin, task_id, marker, "succeeded", value=retval, has_value=True, start=start)
    elif state == "FAILURE":
        exc = retval if isinstance(retval, BaseException) else None
        terminal = "time_limit" if isinstance(exc, SoftTimeLimitExceeded) else "failed"
        record_child(fanin, child_id, marker, terminal, exc=exc, start=starts.take_start(fanin, child_id))
    elif state == "REJECTED" and isinstance(retval, Reject) and not retval.requeue:
        record_child(fanin, child_id, marker, "rejected", exc=retval, start=starts.take_start(fanin, child_id))
    # RETRY, IGNORED, REJECTED with requeue: the child is not finished; another attempt reports.


def _successor_postrun(
    fanin: FanIn, marker: Marker, live: successor_runs.LiveRun | None, state: str | None, retval: Any
) -> None:
    """How an execution of a successor ended, as its run records it (see docs/concepts/terminal-outcomes.md)."""
    if live is None or live.ended:
        return  # a duplicate the guard refused, or a run already handed over (a retry, a replacement)
    exc = retval if isinstance(retval, BaseException) else None
    if state == "SUCCESS":
        record_successor(fanin, marker, "succeeded", value=retval, live=live)
    elif state == "FAILURE":
        record_successor(fanin, marker, "failed", exc, live=live)
    elif state == "RETRY":  # the retry hand-over was not installed (eager runs): the retry comes after this
        when = getattr(retval, "when", None)
        eta = when if isinstance(when, datetime) else None
        successor_runs.hand_over(live, "retrying", _due_at(eta, None if eta else float(when or 0)))
    elif state == "REJECTED" and isinstance(retval, Reject) and retval.requeue:
        successor_runs.hand_over(live, "requeued")  # Celery requeues the message after this returns
    elif state == "REJECTED":
        record_successor(fanin, marker, "failed", exc, live=live)
    elif state == "IGNORED":
        record_successor(fanin, marker, "ignored", live=live)
    else:  # no state: the pool process is being stopped; its lease lapses and the relay runs the successor again
        successor_runs.abandon(live)


def _on_prerun(sender: Any = None, task_id: str | None = None, task: Any = None, **_: Any) -> None:
    task = task or sender
    if task is None or task_id is None:
        return
    marker = Marker.from_mapping(task.request)
    if marker is None or marker.is_successor:
        return
    fanin = _fanin_for(task.app)
    if fanin is None or not fanin.setting("track_started"):
        return
    request = task.request
    child_id = marker.child_id(task_id)  # a chain child started when its first task did
    starts.note_start(fanin, child_id, int(getattr(request, "retries", 0) or 0), getattr(request, "hostname", None))


def _on_received(sender: Any = None, request: Any = None, **_: Any) -> None:
    if request is None:
        return
    marker = Marker.from_mapping(getattr(request, "request_dict", None))
    if marker is not None:
        _received.add(request.id, marker, request)


@_in_event_loop
def _on_failure(sender: Any = None, task_id: str | None = None, exception: BaseException | None = None,
                **_: Any) -> None:  # fmt: skip
    # Only the failures the main process detects; the pool child reports the others through task_postrun.
    if task_id is None or not isinstance(exception, (TimeLimitExceeded, WorkerLostError)):
        return
    # Celery 5.7 fires task_failure twice for a hard time limit, once without a request: keep the marker for the
    # repeat, which is then recorded as a late report; the entry still goes when Celery lets the request go.
    lookup = _received.get if isinstance(exception, TimeLimitExceeded) else _received.pop
    marker = lookup(task_id) or Marker.from_mapping(getattr(sender, "request", None))
    fanin = _fanin_for(getattr(sender, "app", None))
    if marker is None or fanin is None:
        return
    state = "time_limit" if isinstance(exception, TimeLimitExceeded) else "worker_lost"
    if marker.is_successor:
        record_successor(fanin, marker, "failed", exception)
    else:
        record_child(fanin, marker.child_id(task_id), marker, state, exc=exception)


@_in_event_loop
def _on_revoked(sender: Any = None, request: Any = None, terminated: bool = False, expired: bool = False,
                **_: Any) -> None:  # fmt: skip
    marker = Marker.from_mapping(request)
    fanin = _fanin_for(getattr(sender, "app", None))
    if marker is None or fanin is None or request is None:
        return
    _received.pop(request.id)
    reason = "expired" if expired else "terminated" if terminated else "revoked"
    exc = _Revoked(reason)
    if marker.is_successor:
        record_successor(fanin, marker, "revoked", exc)
    else:
        record_child(fanin, marker.child_id(request.id), marker, "revoked", exc=exc)


class _Revoked(Exception):
    """Stands for the reason a revoked task never ran to an end, as stored in the child's row."""


@_in_event_loop
def _on_unknown(sender: Any = None, message: Any = None, exc: BaseException | None = None, name: str | None = None,
                id: str | None = None, **_: Any) -> None:  # fmt: skip
    marker = Marker.from_mapping(getattr(message, "headers", None))
    fanin = _fanin_for(getattr(sender, "app", None))
    if marker is None or fanin is None or not id or _unverified(fanin, "unknown task", id, exc):
        return
    if marker.is_successor:
        record_successor(fanin, marker, "failed", exc)
    else:
        record_child(fanin, marker.child_id(id), marker, "unknown", exc=exc)


@_in_event_loop
def _on_rejected(sender: Any = None, message: Any = None, exc: BaseException | None = None, **_: Any) -> None:
    headers = getattr(message, "headers", None) or {}
    marker = Marker.from_mapping(headers)
    fanin = _fanin_for(getattr(sender, "app", None))
    task_id = headers.get("id")
    if marker is None or fanin is None or not task_id or _unverified(fanin, "rejected", task_id, exc):
        return
    if marker.is_successor:
        record_successor(fanin, marker, "failed", exc)
    else:
        record_child(fanin, marker.child_id(task_id), marker, "rejected", exc=exc)


def _unverified(fanin: FanIn, what: str, task_id: str, exc: BaseException | None) -> bool:
    """True, and logged, when the app signs its messages (``task_serializer = "auth"``) and this one's body was
    never verified (refused, undecodable, or for a task the worker does not know): its headers are anyone's, so
    it must not end the child it names. The genuine message, signed, still counts the child when it runs."""
    if fanin.app.conf.task_serializer != "auth":
        return False
    logger.warning("%s message for task_id=%s not counted: its signature was not verified (%s)", what, task_id, exc)
    return True


def _report_decode_errors() -> None:
    """Count a child whose body the worker cannot decode (corrupt, or not what its content type says) as rejected.

    Celery acks such a message in `Consumer.on_decode_error` and only logs it: unlike a content type it does not
    accept (`task_rejected`), no signal fires, and the child would wait for `child_timeout`. Its headers are
    readable, so the wrapper reports it as `task_rejected` would. Wrapped once per worker process, at `worker_init`.
    """
    from celery.worker.consumer.consumer import Consumer

    original = Consumer.on_decode_error
    if getattr(original, "_fanin_reports", False):
        return

    def on_decode_error(self: Any, message: Any, exc: BaseException) -> None:
        original(self, message, exc)  # logs and acks, as before
        _on_rejected(sender=self, message=message, exc=exc)

    on_decode_error._fanin_reports = True  # type: ignore[attr-defined]
    Consumer.on_decode_error = on_decode_error  # type: ignore[method-assign]


def _on_worker_init(sender: Any = None, **_: Any) -> None:
    app = getattr(sender, "app", None)
    fanin = _fanin_for(app)
    if fanin is not None:
        try:
            fanin.check_session_pooling()
        except FanInNotConfigured as exc:  # Celery logs and ignores a signal handler's Exception: stop the worker
            logger.critical("%s", exc)
            raise SystemExit(1) from exc
        guard_tasks(app)  # type: ignore[arg-type]
        _report_decode_errors()  # in workers only: a producer need not import Celery's worker modules


def _on_worker_shutdown(**_: Any) -> None:
    starts.flush_all(timeout=5.0)
    if not _background.flush(timeout=10.0):
        logger.warning("reports still waiting for the store at shutdown: reconciliation and child_timeout settle them")


def _on_worker_process_init(**_: Any) -> None:
    # A pool child started as a fresh interpreter (spawn) rebuilt its task classes: guard them and rebuild the
    # tracers, which read `before_start` once when they are built.
    from celery import current_app
    from celery.app.trace import build_tracer

    app = current_app._get_current_object()
    if _fanin_for(app) is not None and guard_tasks(app):
        for name, task in app.tasks.items():
            task.__trace__ = build_tracer(name, task, app.loader, app=app)


def install(app: Celery) -> None:
    """Connect the handlers once per process; they act only for apps wired with FanIn."""
    global _installed
    with _install_lock:
        if _installed:
            return
        signals.task_prerun.connect(_on_prerun, weak=False, dispatch_uid="celery_fanin.prerun")
        signals.task_postrun.connect(_on_postrun, weak=False, dispatch_uid="celery_fanin.postrun")
        signals.task_received.connect(_on_received, weak=False, dispatch_uid="celery_fanin.received")
        signals.task_failure.connect(_on_failure, weak=False, dispatch_uid="celery_fanin.failure")
        signals.task_revoked.connect(_on_revoked, weak=False, dispatch_uid="celery_fanin.revoked")
        signals.task_unknown.connect(_on_unknown, weak=False, dispatch_uid="celery_fanin.unknown")
        signals.task_rejected.connect(_on_rejected, weak=False, dispatch_uid="celery_fanin.rejected")
        signals.worker_init.connect(_on_worker_init, weak=False, dispatch_uid="celery_fanin.worker_init")
        signals.worker_shutdown.connect(_on_worker_shutdown, weak=False, dispatch_uid="celery_fanin.worker_shutdown")
        signals.worker_process_shutdown.connect(
            _on_worker_shutdown, weak=False, dispatch_uid="celery_fanin.worker_process_shutdown"
        )
        signals.worker_process_init.connect(
            _on_worker_process_init, weak=False, dispatch_uid="celery_fanin.worker_process_init"
        )
        _installed = True
