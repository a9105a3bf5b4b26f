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

A child's start is only queued by ``task_prerun`` (a thread writes starts in batches: `celery_fanin.starts`); its
terminal outcome is one statement on the process's report connection (`store.reports`), the only round trip on the
child's own path. Tasks without the fan-in headers return from every hook before any database work. The main
process learns a child's headers from ``task_received`` (an in-memory map with an entry per live request), since
celery 5.5/5.6 give ``task_failure`` no request there. Duplicate reports (5.7 sends ``task_failure`` twice for a
hard time limit) are harmless: the store counts a child once.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import psycopg
from billiard.exceptions import TimeLimitExceeded, WorkerLostError
from celery import Celery, signals
from celery.exceptions import Ignore, Reject, SoftTimeLimitExceeded
from kombu.exceptions import EncodeError
from sqlalchemy import Connection
from sqlalchemy.exc import SQLAlchemyError

from . import starts
from .extension import FanIn
from .publish import HEADER_BATCH, HEADER_INDEX, HEADER_STEP, HEADER_SUCCESSOR, encode_result
from .store import batches
from .store.reports import ReportConnection

logger = logging.getLogger("celery_fanin.hooks")

_installed = False
_install_lock = threading.Lock()


# --- what a message says about itself ------------------------------------------------------------------------


class _Marker:
    """The fan-in headers of one task message: a child (batch + index) or a successor (batch + step)."""

    __slots__ = ("batch_id", "index", "step")

    def __init__(self, batch_id: str, index: int | None, step: str | None) -> None:
        self.batch_id = batch_id
        self.index = index
        self.step = step

    @property
    def is_successor(self) -> bool:
        return self.step is not None

    @classmethod
    def from_mapping(cls, data: Any) -> _Marker | None:
        if not data:
            return None
        get = data.get if hasattr(data, "get") else (lambda k, d=None: getattr(data, k, d))
        successor = get(HEADER_SUCCESSOR, None)
        if successor:
            return cls(str(successor), None, str(get(HEADER_STEP, "")))
        batch_id = get(HEADER_BATCH, None)
        if batch_id:
            index = get(HEADER_INDEX, None)
            return cls(str(batch_id), int(index) if index is not None else None, None)
        return None


class _ReceivedMarkers:
    """task id -> marker for the fan-in messages the main process holds a request for.

    An entry lives as long as Celery's `Request` for the message: the main process needs the marker only while
    that request can still end in a main-process failure (hard time limit, lost pool process), and no signal
    fires in the main process when a child succeeds. A weak reference's callback drops the entry when Celery
    lets the request go, so the map holds the worker's reserved and running fan-in requests, not its history.
    The bound is a safety net for requests kept alive elsewhere; the oldest entry goes first.
    """

    def __init__(self, limit: int = 100_000) -> None:
        self._data: OrderedDict[str, tuple[_Marker, weakref.ref[Any]]] = OrderedDict()
        self._limit = limit
        # Reentrant: a garbage collection can start at any allocation inside `add` and release a request whose
        # callback then runs on this thread, with the lock held.
        self._lock = threading.RLock()

    def add(self, task_id: str, marker: _Marker, request: Any) -> None:
        def release(ref: weakref.ref[Any]) -> None:
            with self._lock:
                entry = self._data.get(task_id)
                if entry is not None and entry[1] is ref:  # a redelivery under the same id keeps its own entry
                    del self._data[task_id]

        with self._lock:
            self._data[task_id] = (marker, weakref.ref(request, release))
            if len(self._data) > self._limit:
                self._data.popitem(last=False)

    def get(self, task_id: str) -> _Marker | None:
        with self._lock:
            entry = self._data.get(task_id)
        return entry[0] if entry is not None else None

    def pop(self, task_id: str) -> _Marker | None:
        with self._lock:
            entry = self._data.pop(task_id, None)
        return entry[0] if entry is not None else None

    def __len__(self) -> int:
        return len(self._data)


_received = _ReceivedMarkers()


def _fanin_for(app: Celery | None) -> FanIn | None:
    return FanIn.find(app) if app is not None else None


def _with_retries(fanin: FanIn, what: str, fn: Callable[[Connection], Any]) -> Any:
    """Run a store transaction, retrying connection errors with backoff; gives up to reconciliation after the last."""
    attempts = max(1, int(fanin.setting("record_attempts")))
    for attempt in range(1, attempts + 1):
        try:
            with fanin.engine.begin() as conn:
                return fn(conn)
        except SQLAlchemyError:
            if attempt == attempts:
                logger.exception("gave up recording %s after %d attempts", what, attempts)
                return None
            time.sleep(min(5.0, 0.2 * 2**attempt))
    return None


def _report_with_retries(fanin: FanIn, what: str, fn: Callable[[ReportConnection], Any]) -> Any:
    """Send one of a child's reports (its start, its terminal outcome) with the same retry policy as above.

    Each report is a single statement in autocommit on the process's report connection: one round trip.
    """
    attempts = max(1, int(fanin.setting("record_attempts")))
    for attempt in range(1, attempts + 1):
        try:
            return fn(fanin.reports)
        except psycopg.Error:
            if attempt == attempts:
                logger.exception("gave up recording %s after %d attempts", what, attempts)
                return None
            time.sleep(min(5.0, 0.2 * 2**attempt))
    return None


def _exc_fields(exc: BaseException | None) -> tuple[str | None, str | None]:
    if exc is None:
        return None, None
    return type(exc).__name__, str(exc)[:2000]


# --- children ------------------------------------------------------------------------------------------------


def record_child(
    fanin: FanIn,
    task_id: str,
    marker: _Marker,
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
    rec: batches.TerminalRecord | None = _report_with_retries(
        fanin,
        f"terminal outcome of task {task_id}",
        lambda reports: reports.record_terminal(
            task_id, state, result=result, exc_type=exc_type, exc_message=exc_message, start=start
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
    else:
        logger.info("late or repeated report not counted batch_id=%s index=%s task_id=%s state=%s",
                    marker.batch_id, marker.index, task_id, state, extra=extra)  # fmt: skip
    return rec


# --- successors ----------------------------------------------------------------------------------------------


def record_successor(
    fanin: FanIn, marker: _Marker, state: str, exc: BaseException | None = None, value: Any = None
) -> None:
    exc_type, exc_message = _exc_fields(exc)
    result = None
    if state == "succeeded":
        try:
            result = encode_result(fanin.app, value)
        except EncodeError as err:
            logger.warning("result of the successor of batch_id=%s cannot be encoded: %s", marker.batch_id, err)
    _with_retries(
        fanin,
        f"successor state of batch {marker.batch_id}",
        lambda conn: batches.record_successor_state(
            conn, uuid.UUID(marker.batch_id), marker.step or "", state, result=result, exc_type=exc_type,
            exc_message=exc_message,
        ),
    )  # fmt: skip


# Successor runs under way in this process: task id -> (the connection holding the run lock, its marker).
_running: dict[str, tuple[Connection, _Marker]] = {}


def _guard(before_start: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a task's `before_start` so that a successor's body runs once per (batch, step) and attempt.

    `before_start` runs inside the trace's exception handling, so the `Ignore` raised for a duplicate delivery
    ends the task as IGNORED without running its body (and without touching the first run's stored result).
    The run lock stays held on its own connection until `task_postrun` (or the process's death) releases it.
    """

    def before_start_guarded(self: Any, task_id: str, args: Any, kwargs: Any) -> Any:
        marker = _Marker.from_mapping(self.request)
        fanin = _fanin_for(self.app) if marker is not None and marker.is_successor else None
        if fanin is not None and marker is not None:
            retries = int(getattr(self.request, "retries", 0) or 0)
            if not _claim_run(fanin, task_id, marker, retries):
                logger.warning(
                    "duplicate delivery of successor batch_id=%s step=%s task_id=%s: body not run",
                    marker.batch_id, marker.step, task_id,
                    extra={"batch_id": marker.batch_id, "step": marker.step, "task_id": task_id},
                )  # fmt: skip
                raise Ignore()
        return before_start(self, task_id, args, kwargs)

    before_start_guarded._fanin_guard = True  # type: ignore[attr-defined]
    return before_start_guarded


def _claim_run(fanin: FanIn, task_id: str, marker: _Marker, retries: int) -> bool:
    attempts = max(1, int(fanin.setting("record_attempts")))
    for attempt in range(1, attempts + 1):
        conn = None
        try:
            conn = fanin.engine.connect()
            if batches.claim_successor_run(conn, uuid.UUID(marker.batch_id), marker.step or "", retries):
                _running[task_id] = (conn, marker)
                return True
            conn.close()
            return False
        except SQLAlchemyError:
            if conn is not None:
                conn.invalidate()
                conn.close()
            if attempt == attempts:
                # Without the store the guard cannot tell a duplicate from a first run: refuse rather than risk
                # running twice; the message was taken off the queue, so reconciliation reports the successor.
                logger.exception("cannot reach the store to start successor batch_id=%s", marker.batch_id)
                return False
            time.sleep(min(5.0, 0.2 * 2**attempt))
    return False


def _release_run(task_id: str) -> None:
    held = _running.pop(task_id, None)
    if held is None:
        return
    conn, marker = held
    try:
        batches.release_successor_run(conn, uuid.UUID(marker.batch_id), marker.step or "")
        conn.close()
    except SQLAlchemyError:
        conn.invalidate()  # closing the session releases the lock
        conn.close()


def guard_tasks(app: Celery) -> bool:
    """Give every task of `app` the successor start guard; True if any task was changed."""
    changed = False
    for task in app.tasks.values():
        cls = type(task)
        if not getattr(cls.before_start, "_fanin_guard", False):
            cls.add_around("before_start", _guard)  # Celery's own mechanism for wrapping task methods
            changed = True
    return changed


# --- signal handlers -------------------------------------------------------------------------------------------


def _on_postrun(sender: Any = None, task_id: str | None = None, task: Any = None, retval: Any = None,
                state: str | None = None, **_: Any) -> None:  # fmt: skip
    task = task or sender
    if task is None or task_id is None:
        return
    marker = _Marker.from_mapping(task.request)
    if marker is None:
        return
    fanin = _fanin_for(task.app)
    if fanin is None:
        return
    if marker.is_successor:
        if task_id not in _running:
            return  # a duplicate delivery the guard refused: the run that holds the lock reports
        if state == "SUCCESS":
            record_successor(fanin, marker, "succeeded", value=retval)
        elif state == "FAILURE":
            record_successor(fanin, marker, "failed", retval if isinstance(retval, BaseException) else None)
        elif state == "RETRY":
            record_successor(fanin, marker, "retrying")
        elif state == "REJECTED" and isinstance(retval, Reject) and not retval.requeue:
            record_successor(fanin, marker, "failed", retval)
        _release_run(task_id)  # after the state is recorded, so no duplicate can slip in between
        return
    if state == "SUCCESS":
        start = starts.take_start(fanin, task_id)
        record_child(fanin, task_id, marker, "succeeded", value=retval, has_value=True, start=start)
    elif state == "FAILURE":
        exc = retval if isinstance(retval, BaseException) else None
        terminal = "time_limit" if isinstance(exc, SoftTimeLimitExceeded) else "failed"
        record_child(fanin, task_id, marker, terminal, exc=exc, start=starts.take_start(fanin, task_id))
    elif state == "REJECTED" and isinstance(retval, Reject) and not retval.requeue:
        record_child(fanin, task_id, marker, "rejected", exc=retval, start=starts.take_start(fanin, task_id))
    # RETRY, IGNORED, REJECTED with requeue: the child is not finished; another attempt reports.


def _on_prerun(sender: Any = None, task_id: str | None = None, task: Any = None, **_: Any) -> None:
    task = task or sender
    if task is None or task_id is None:
        return
    marker = _Marker.from_mapping(task.request)
    if marker is None or marker.is_successor:
        return
    fanin = _fanin_for(task.app)
    if fanin is None or not fanin.setting("track_started"):
        return
    request = task.request
    starts.note_start(fanin, task_id, int(getattr(request, "retries", 0) or 0), getattr(request, "hostname", None))


def _on_received(sender: Any = None, request: Any = None, **_: Any) -> None:
    if request is None:
        return
    marker = _Marker.from_mapping(getattr(request, "request_dict", None))
    if marker is not None:
        _received.add(request.id, marker, request)


def _on_failure(sender: Any = None, task_id: str | None = None, exception: BaseException | None = None,
                **_: Any) -> None:  # fmt: skip
    # Only the failures the main process detects; the pool child reports the others through task_postrun.
    if task_id is None or not isinstance(exception, (TimeLimitExceeded, WorkerLostError)):
        return
    # Celery 5.7 fires task_failure twice for a hard time limit, once without a request: keep the marker for the
    # repeat, which is then recorded as a late report; the entry still goes when Celery lets the request go.
    lookup = _received.get if isinstance(exception, TimeLimitExceeded) else _received.pop
    marker = lookup(task_id) or _Marker.from_mapping(getattr(sender, "request", None))
    fanin = _fanin_for(getattr(sender, "app", None))
    if marker is None or fanin is None:
        return
    state = "time_limit" if isinstance(exception, TimeLimitExceeded) else "worker_lost"
    if marker.is_successor:
        record_successor(fanin, marker, "failed", exception)
    else:
        record_child(fanin, task_id, marker, state, exc=exception)


def _on_revoked(sender: Any = None, request: Any = None, terminated: bool = False, expired: bool = False,
                **_: Any) -> None:  # fmt: skip
    marker = _Marker.from_mapping(request)
    fanin = _fanin_for(getattr(sender, "app", None))
    if marker is None or fanin is None or request is None:
        return
    _received.pop(request.id)
    reason = "expired" if expired else "terminated" if terminated else "revoked"
    exc = _Revoked(reason)
    if marker.is_successor:
        record_successor(fanin, marker, "revoked", exc)
    else:
        record_child(fanin, request.id, marker, "revoked", exc=exc)


class _Revoked(Exception):
    """Stands for the reason a revoked task never ran to an end, as stored in the child's row."""


def _on_unknown(sender: Any = None, message: Any = None, exc: BaseException | None = None, name: str | None = None,
                id: str | None = None, **_: Any) -> None:  # fmt: skip
    marker = _Marker.from_mapping(getattr(message, "headers", None))
    fanin = _fanin_for(getattr(sender, "app", None))
    if marker is None or fanin is None or not id:
        return
    if marker.is_successor:
        record_successor(fanin, marker, "failed", exc)
    else:
        record_child(fanin, id, marker, "unknown", exc=exc)


def _on_rejected(sender: Any = None, message: Any = None, exc: BaseException | None = None, **_: Any) -> None:
    headers = getattr(message, "headers", None) or {}
    marker = _Marker.from_mapping(headers)
    fanin = _fanin_for(getattr(sender, "app", None))
    task_id = headers.get("id")
    if marker is None or fanin is None or not task_id:
        return
    if marker.is_successor:
        record_successor(fanin, marker, "failed", exc)
    else:
        record_child(fanin, task_id, marker, "rejected", exc=exc)


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
    if _fanin_for(app) is not None:
        guard_tasks(app)  # type: ignore[arg-type]
        _report_decode_errors()  # in workers only: a producer need not import Celery's worker modules


def _on_worker_shutdown(**_: Any) -> None:
    starts.flush_all(timeout=5.0)


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
