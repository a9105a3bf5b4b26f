"""The worker side: every Celery signal that ends a child or a successor's run, mapped to one report.

`WorkerHooks` has one method per signal it listens to (`install` connects them once per process); they act only for
apps wired with `FanIn(app)` and return before any database work for a task without the fan-in headers. A child's
terminal outcome is one statement on the process's report connection (`record_child`), a successor's end one update
fenced to its run (`record_successor`). Which signal fires where, per Celery version:
docs/concepts/terminal-outcomes.md.
"""

from __future__ import annotations

import functools
import logging
import threading
import traceback
import uuid
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from typing import Any

from billiard.exceptions import TimeLimitExceeded, WorkerLostError
from celery import Celery, Signature, chord, current_app, group, signals
from celery.app.trace import build_tracer
from celery.canvas import _chain
from celery.exceptions import Ignore, Reject, Retry, SoftTimeLimitExceeded
from celery.worker import state as worker_state
from celery.worker.consumer.consumer import Consumer
from kombu.exceptions import EncodeError
from prometheus_client import Counter

from ..codec import encode_result
from ..context import FanIn
from ..exceptions import FanInNotConfigured
from ..protocol import (
    BODY_CLAIM,
    HEADER_CARRIER,
    HEADER_CHORD,
    HEADER_PART_OF,
    THEN_CANVAS_TASK,
    ChildState,
    Marker,
    SuccessorState,
    body_claim,
    claim,
    put_claim,
    request_header,
    stamp_slot,
)
from ..store import batches
from ..store.outbox import OutboxRow
from . import report, starts, successor_runs

logger = logging.getLogger("celery_fanin.hooks")

# Reports refused: the message's batch, index or task name disagree with the child's row (the store's check), or its
# headers disagree with the claim in its body (the worker's, for children and successors).
_REFUSED = Counter(
    "fanin_worker_reports_refused", "Reports refused: headers that do not match the child or the body's fan-in claim."
)
# The claim `refuse` sends for a child: no child has index -1, so the store's report statement moves nothing and
# counts the refusal on the child the task id names (its batch's `refused_reports`), as for any refused report.
_NO_CHILD = batches.Claim("00000000-0000-0000-0000-000000000000", -1, None)


class ReceivedMarkers:
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

    def request(self, task_id: str) -> Any:
        """The main process's request for this task id's message, while Celery holds it (else None)."""
        with self._lock:
            entry = self._data.get(task_id)
        return entry[1]() if entry is not None else None

    def __len__(self) -> int:
        return len(self._data)


def _fanin_for(app: Celery | None) -> FanIn | None:
    return FanIn.find(app) if app is not None else None


def _exc_fields(exc: BaseException | None) -> tuple[str | None, str | None]:
    if exc is None:
        return None, None
    return type(exc).__name__, str(exc)[:2000]


TRACEBACK_LIMIT = 16_000  # characters kept of a traceback (its end: the error); the store bounds it the same


def format_traceback(exc: BaseException | None) -> str | None:
    """The traceback of a failure, as Python prints it, its last `TRACEBACK_LIMIT` characters; None without one
    (an error raised nowhere: a time limit or a lost process seen by the main process)."""
    if exc is None or exc.__traceback__ is None:
        return None
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return text if len(text) <= TRACEBACK_LIMIT else "...\n" + text[-(TRACEBACK_LIMIT - 4) :]


def _note_successor_traceback(fanin: FanIn, marker: Marker, exc: BaseException | None) -> None:
    """Keep the traceback of the error that failed the successor, after the statement that recorded the failure
    (a statement of its own: the success path is unchanged), if the error has one."""
    trace = format_traceback(exc)
    if trace is not None:
        report.send(
            fanin,
            "successor",
            f"traceback of the successor of batch {marker.batch_id}",
            lambda: fanin.reports.note_successor_traceback(marker.batch_id, marker.step or "", trace),
        )


def claim_of(marker: Marker) -> batches.Claim:
    """What a message says its child is, which the store checks before counting the report."""
    return batches.Claim(marker.batch_id, marker.index, marker.task_name)


class _Revoked(Exception):
    """Stands for the reason a revoked task never ran to an end, as stored in the child's row."""


def claim_refusal(fanin: FanIn, headers: Any, found: Any) -> str | None:
    """Why a fan-in message must not count (None: it may): its headers (a mapping, or a request with them as
    attributes) differ from the claim `found` in its body, or the app signs its messages and the body has none.

    Celery's signing covers the body, not the headers: without this a captured signed body, published again under
    another child's or successor's headers, would run and count as that one. Without signing a message with no
    claim (published by an earlier release, or by protocol 1) is still taken; one whose claim differs never is.
    """
    if found is None:
        if fanin.app.conf.task_serializer == "auth" and int(fanin.app.conf.task_protocol or 2) == 2:
            return "its signed body carries no fan-in claim"
        return None
    if found != claim(headers):
        return "its headers differ from the fan-in claim in its signed body"
    return None


def _unverified(fanin: FanIn, what: str, task_id: str, exc: BaseException | None) -> bool:
    """True, and logged, when the app signs its messages (``task_serializer = "auth"``) and this one's body was
    never verified (refused, undecodable, or for a task the worker does not know): its headers are anyone's, so
    it must not end the child it names. The genuine message, signed, still counts the child when it runs."""
    if fanin.app.conf.task_serializer != "auth":
        return False
    logger.warning("%s message for task_id=%s not counted: its signature was not verified (%s)", what, task_id, exc)
    return True


class WorkerHooks:
    """celery-fanin in a worker: one method per Celery signal it listens to, and the reports they map onto.

    Eager mode (`celery_fanin.producer.eager`) calls the same public methods for the tasks it runs inline.
    """

    # Publishes the successor a report of this process created, after its commit, given the rows the report
    # returned for it (`relay.outbox.publish_created_successor`, set by the wiring: this layer does not import the
    # relay's).
    publish_successor: Callable[[FanIn, uuid.UUID, Sequence[OutboxRow]], object] | None = None

    def __init__(self) -> None:
        self.received = ReceivedMarkers()
        self._installed = False
        self._install_lock = threading.Lock()

    def install(self) -> None:
        """Connect every signal method once per process."""
        with self._install_lock:
            if self._installed:
                return
            for signal, uid in _SIGNALS:
                getattr(signals, signal).connect(getattr(self, signal), weak=False, dispatch_uid=f"celery_fanin.{uid}")
            self._installed = True

    # --- the reports ------------------------------------------------------------------------------------------

    def record_child(
        self,
        fanin: FanIn,
        task_id: str,
        marker: Marker,
        state: str,
        *,
        value: Any = None,
        has_value: bool = False,
        exc: BaseException | None = None,
        start: batches.Start | None = None,
        unrun: bool = False,
    ) -> batches.TerminalRecord | None:
        """Record a child's terminal outcome: the one path from every hook (and eager mode) to the store.

        `unrun`: the outcome of a copy that never ran (the main process's revoke, expiry, unknown task or undecodable
        message), which ends the child only while no copy has started it (`fanin_report_unrun`)."""
        result = None
        if has_value:
            try:
                result = encode_result(fanin.app, value)
            except EncodeError as err:  # the child succeeded; only its value cannot be kept
                logger.warning("result of task_id=%s cannot be encoded, stored as none: %s", task_id, err)
        exc_type, exc_message = _exc_fields(exc)
        claim = claim_of(marker)
        rec: batches.TerminalRecord | None = report.send_terminal(
            fanin,
            f"terminal outcome of task {task_id}",
            lambda reports: reports.record_terminal(
                task_id,
                state,
                result=result,
                exc_type=exc_type,
                exc_message=exc_message,
                start=start,
                claim=claim,
                unrun=unrun,
            ),
            batch_id=marker.batch_id,
        )
        extra = {"batch_id": marker.batch_id, "child_index": marker.index, "task_id": task_id, "state": state}
        if rec is None:
            return None
        trace = format_traceback(exc) if rec.counted and state != ChildState.SUCCEEDED else None
        if trace is not None:  # the counted run's, kept in the database only (never in the successor's message)
            report.send_terminal(
                fanin, f"traceback of task {task_id}", lambda reports: reports.note_traceback(task_id, trace)
            )
        if rec.counted:
            logger.debug(
                "child done batch_id=%s index=%s task_id=%s state=%s remaining=%s",
                marker.batch_id,
                marker.index,
                task_id,
                state,
                rec.remaining,
                extra=extra,
            )
            if rec.successor_created:
                logger.info("batch complete batch_id=%s: successor created", marker.batch_id, extra=extra)
                self._publish_created(fanin, marker.batch_id, rec.handed_off or [])
        elif rec.refused:
            _REFUSED.inc()
            why = "forged or misrouted message"
            what = (task_id, marker.index, marker.batch_id, marker.task_name, why)
            logger.warning("report refused: task_id=%s is not child %s of batch %s as task %s (%s)", *what, extra=extra)
        elif unrun and not rec.late:
            logger.warning(
                "copy of task_id=%s that never ran (%s) not counted: another copy started child %s of batch %s",
                task_id,
                state,
                marker.index,
                marker.batch_id,
                extra=extra,
            )
        elif not rec.late:
            # No child has this task id in this database. A worker whose fanin_database_url differs from the
            # producer's meets every child this way, and nothing else would tell: say so loudly, once per report.
            logger.warning(
                "report for a batch this database does not know: batch_id=%s index=%s task_id=%s state=%s not "
                "counted. Is this worker on the producer's database (fanin_database_url / FANIN_DATABASE_URL)? "
                "Otherwise its batch was deleted (`fanin prune`).",
                marker.batch_id,
                marker.index,
                task_id,
                state,
                extra=extra,
            )
        else:
            logger.info(
                "late or repeated report not counted batch_id=%s index=%s task_id=%s state=%s",
                marker.batch_id,
                marker.index,
                task_id,
                state,
                extra=extra,
            )
        return rec

    def _publish_created(self, fanin: FanIn, batch_id: str, handed_off: Sequence[OutboxRow]) -> None:
        """The successor this report created goes out from here, unless the relay is to publish it (the setting
        off, or eager mode), or the report came from the worker's main process (then the relay is woken for it).
        `handed_off`: what the report returned of it ([]: not handed off, the publisher claims it). Nothing raises
        from here: a failure leaves the outbox row to the relay."""
        publish = self.publish_successor
        if publish is None or not fanin.worker_publishes_successors:
            return
        if report.in_event_loop_now():
            # A main-process report (a lost pool process, a revoke, a time limit) leaves it to the relay: a thread
            # publishing here would run while the pool forks the lost process's replacement, and a child forked
            # while the thread holds a lock (the engine's, the producer pool's) hangs on its first task. The report
            # sent no NOTIFY (the connection said the worker publishes), so the relay is woken here, one statement
            # that also makes the row due at once (it was handed to this worker, `fanin_successor_handoff`).
            report.wake_relay(fanin, batch_id)
            return
        try:
            job = functools.partial(publish, fanin, uuid.UUID(batch_id), handed_off)
        except ValueError:  # not a batch id: the store counted nothing for it, so this is unreachable
            return
        job()

    def refuse(self, fanin: FanIn, task_id: str, marker: Marker, why: str) -> None:
        """A message refused before it ran (`claim_refusal`): logged and counted like a report the store refused,
        on the child its task id names (`refused_reports`) or as a refused delivery of the successor
        (`duplicates`). Nothing else moves."""
        _REFUSED.inc()
        extra = {"batch_id": marker.batch_id, "task_id": task_id}
        if marker.is_successor:
            logger.warning(
                "report refused: task_id=%s as the successor of batch %s, step %s: %s (body not run)",
                task_id,
                marker.batch_id,
                marker.step,
                why,
                extra=extra,
            )
            report.send(
                fanin,
                "successor",
                f"refused delivery of the successor of batch {marker.batch_id}",
                lambda: successor_runs.count_refused(fanin, marker.batch_id, marker.step or ""),
            )
            return
        child_id = marker.child_id(task_id)
        what = (task_id, marker.index, marker.batch_id, marker.task_name, why)
        logger.warning(
            "report refused: task_id=%s as child %s of batch %s, task %s: %s (body not run)", *what, extra=extra
        )
        report.send_terminal(
            fanin,
            f"refused report of task {child_id}",
            lambda reports: reports.record_terminal(child_id, ChildState.REJECTED, claim=_NO_CHILD),
        )

    def record_successor(
        self,
        fanin: FanIn,
        marker: Marker,
        state: str,
        exc: BaseException | None = None,
        value: Any = None,
        live: successor_runs.LiveRun | None = None,
        task_id: str | None = None,
        ran_in: int | None = None,
        retries: int | None = None,
    ) -> bool:
        """Record a successor's final state: fenced to `live`'s run, or from the main process about one copy of its
        message (`task_id`): one that ran in pool process `ran_in`, or one that never ran (the marker's carrier and
        `retries` say which copy); such an event ends nothing another copy runs (`successor_runs.record_final`)."""
        exc_type, exc_message = _exc_fields(exc)
        result = None
        if state == SuccessorState.SUCCEEDED:
            try:
                result = encode_result(fanin.app, value)
            except EncodeError as err:
                logger.warning("result of the successor of batch_id=%s cannot be encoded: %s", marker.batch_id, err)
        if live is not None:
            finished = successor_runs.finish(live, state, result=result, exc_type=exc_type, exc_message=exc_message)
            if finished and state == SuccessorState.FAILED:
                _note_successor_traceback(fanin, marker, exc)
            return finished
        done = report.send(
            fanin,
            "successor",
            f"successor state of batch {marker.batch_id}",
            lambda: successor_runs.record_final(
                fanin,
                marker.batch_id,
                marker.step or "",
                state,
                task_id=task_id,
                result=result,
                exc_type=exc_type,
                exc_message=exc_message,
                carrier=marker.carrier,
                retries=retries,
                ran_in=ran_in,
            ),
        )
        return bool(done)

    def end_replacement(self, fanin: FanIn, marker: Marker, state: str, exc: BaseException | None) -> bool:
        """A part of a replaced successor's replacement (`marker.is_part`) failed, or was revoked, so its carrier
        will not be published: the successor ends with it, while it still waits for that carrier (never a run the
        carrier holds, nor a successor final already: `fanin_end_replacement`). True if this ended it."""
        if state not in (SuccessorState.FAILED, SuccessorState.REVOKED) or not marker.part_of or not marker.carrier:
            return False
        exc_type, exc_message = _exc_fields(exc)
        part_of, carrier = marker.part_of, marker.carrier
        ended = report.send(
            fanin,
            "successor",
            f"a part of the replacement of the successor of batch {marker.batch_id}",
            lambda: successor_runs.end_replacement(
                fanin, marker.batch_id, marker.step or "", part_of, carrier, state, exc_type, exc_message
            ),
        )
        if ended and state == SuccessorState.FAILED:
            _note_successor_traceback(fanin, marker, exc)
        return bool(ended)

    def admit_successor(
        self, fanin: FanIn, request: Any, task_id: str, marker: Marker
    ) -> successor_runs.LiveRun | None:
        """Start a run of the successor for this execution (attached to its request), or None for a duplicate.

        A copy the relay republished starts at Celery retry count 0: the run resumes the successor's own count, so
        that `max_retries` bounds the retries of the successor, not of each copy.
        """
        retries = int(getattr(request, "retries", 0) or 0)
        live = successor_runs.admit(fanin, marker.batch_id, marker.step or "", task_id, retries, marker.carrier)
        if live is None:
            return None
        successor_runs.attach(request, live)
        if live.run.attempt > retries:
            request.retries = live.run.attempt
        return live

    def _ended(
        self,
        fanin: FanIn,
        task_id: str,
        marker: Marker,
        child: ChildState,
        successor: SuccessorState,
        exc: BaseException | None,
        *,
        ran_in: int | None,
        retries: Any = None,
    ) -> None:
        """A main-process path ended one copy of the message: one that ran in pool process `ran_in`, or (None) one
        that never ran. Its child's terminal state, or its successor's final one, as far as that copy may end it."""
        if marker.is_part:
            self.end_replacement(fanin, marker, successor, exc)
        elif marker.is_successor:
            tries = int(retries) if isinstance(retries, int) or (isinstance(retries, str) and retries.isdigit()) else 0
            self.record_successor(
                fanin, marker, successor, exc, task_id=marker.successor_id(task_id), ran_in=ran_in, retries=tries
            )
        else:
            self.record_child(fanin, marker.child_id(task_id), marker, child, exc=exc, unrun=ran_in is None)

    # --- one method per signal ----------------------------------------------------------------------------------

    def before_task_publish(self, sender: Any = None, body: Any = None, headers: Any = None, **_: Any) -> None:
        """Bind a fan-in message's headers into the body Celery publishes (`protocol.claim`)."""
        # Every fan-in message Celery publishes itself: a chain's next task, a retry, a replacement, a child or
        # successor published one at a time. The fast path builds the claim into its own messages.
        if headers:
            put_claim(body, headers)
            stamp_slot(headers.get("task"), body)  # a scheduled fan-in, sent by beat: the time of its slot

    def task_received(self, sender: Any = None, request: Any = None, **_: Any) -> None:
        """Remember a fan-in message's marker while the main process holds its request (unless its claim refuses it)."""
        # A claim given as a header is dropped: the pool reads the claim from the request, to which Celery lifts the
        # headers and then the body's embed, so only the (signed) body's claim may reach it.
        if request is None:
            return
        data = getattr(request, "request_dict", None)
        if data is None:
            return
        data.pop(BODY_CLAIM, None)
        marker = Marker.from_mapping(data)
        if marker is None:
            return
        fanin = _fanin_for(getattr(sender, "app", None))
        if fanin is not None and claim_refusal(fanin, data, body_claim(getattr(request, "_payload", None))):
            return  # refused, logged and counted when the pool takes it (`_guard`); no main-process path counts it
        self.received.add(request.id, marker, request)

    def task_prerun(self, sender: Any = None, task_id: str | None = None, task: Any = None, **_: Any) -> None:
        """Queue a child's start, written off the child's path by `starts`."""
        task = task or sender
        if task is None or task_id is None:
            return
        marker = Marker.from_mapping(task.request)
        if marker is None or marker.is_successor:
            return
        fanin = _fanin_for(task.app)
        if fanin is None:
            return
        request = task.request
        if not fanin.settings.track_started and not getattr(request, "expires", None):
            # Off, but a child with `expires` is recorded still: the relay's expiry sweep takes a child with no start
            # for one no worker took (docs/concepts/terminal-outcomes.md).
            return
        if not request.is_eager and claim_refusal(fanin, request, getattr(request, BODY_CLAIM, None)):
            return  # refused by `_guard`, next: not started
        child_id = marker.child_id(task_id)  # a chain child started when its first task did
        starts.note_start(fanin, child_id, int(getattr(request, "retries", 0) or 0), getattr(request, "hostname", None))

    def task_postrun(
        self,
        sender: Any = None,
        task_id: str | None = None,
        task: Any = None,
        retval: Any = None,
        state: str | None = None,
        **_: Any,
    ) -> None:
        """Record how a child or a successor's run ended in the pool process (success, failure, rejection)."""
        task = task or sender
        if task is None or task_id is None:
            return
        marker = Marker.from_mapping(task.request)
        if marker is None:
            return
        fanin = _fanin_for(task.app)
        if fanin is None:
            return
        if marker.is_successor and not marker.is_part:
            self._successor_postrun(fanin, marker, successor_runs.request_run(task.request), state, retval)
            return
        if not task.request.is_eager and state in ("SUCCESS", "FAILURE", "REJECTED"):
            # `_guard` refused such a message before it ran (IGNORED); this catches a task it did not wrap.
            why = claim_refusal(fanin, task.request, getattr(task.request, BODY_CLAIM, None))
            if why is not None:
                self.refuse(fanin, task_id, marker, why)
                return
        if marker.is_part:
            self._part_postrun(fanin, task, marker, state, retval)
            return
        child_id = marker.child_id(task_id)
        if state == "SUCCESS":
            if child_id != task_id and marker.stands_for is None:
                return  # a chain's earlier task: the worker publishes the next, and the last one reports
            start = starts.take_start(fanin, child_id)
            self.record_child(fanin, child_id, marker, ChildState.SUCCEEDED, value=retval, has_value=True, start=start)
        elif state == "FAILURE":
            exc = retval if isinstance(retval, BaseException) else None
            terminal = ChildState.TIME_LIMIT if isinstance(exc, SoftTimeLimitExceeded) else ChildState.FAILED
            self.record_child(fanin, child_id, marker, terminal, exc=exc, start=starts.take_start(fanin, child_id))
        elif state == "REJECTED" and isinstance(retval, Reject) and not retval.requeue:
            start = starts.take_start(fanin, child_id)
            self.record_child(fanin, child_id, marker, ChildState.REJECTED, exc=retval, start=start)
        # RETRY, IGNORED, REJECTED with requeue: the child is not finished; another attempt reports.

    @report.in_event_loop
    def task_failure(
        self, sender: Any = None, task_id: str | None = None, exception: BaseException | None = None, **_: Any
    ) -> None:
        """Record a hard time limit or a lost pool process, the failures only the main process sees."""
        if task_id is None or not isinstance(exception, (TimeLimitExceeded, WorkerLostError)):
            return
        # Celery 5.7 fires task_failure twice for a hard time limit, once without a request: keep the marker for the
        # repeat, which is then recorded as a late report; the entry still goes when Celery lets the request go.
        held = self.received.request(task_id)
        lookup = self.received.get if isinstance(exception, TimeLimitExceeded) else self.received.pop
        marker = lookup(task_id) or Marker.from_mapping(getattr(sender, "request", None))
        fanin = _fanin_for(getattr(sender, "app", None))
        if marker is None or fanin is None:
            return
        state = ChildState.TIME_LIMIT if isinstance(exception, TimeLimitExceeded) else ChildState.WORKER_LOST
        # This copy ran in a pool process (a time limit, a lost process): that process's run, whichever it was.
        pid = _ran_in(held) or _ran_in(getattr(sender, "request", None)) or 0
        self._ended(fanin, task_id, marker, state, SuccessorState.FAILED, exception, ran_in=pid)

    @report.in_event_loop
    def task_revoked(
        self, sender: Any = None, request: Any = None, terminated: bool = False, expired: bool = False, **_: Any
    ) -> None:
        """Record a child or successor revoked before or while it ran (or expired unstarted)."""
        marker = Marker.from_mapping(request)
        fanin = _fanin_for(getattr(sender, "app", None))
        if marker is None or fanin is None or request is None:
            return
        self.received.pop(request.id)
        why = claim_refusal(fanin, getattr(request, "request_dict", request), _request_claim(request))
        if why is not None:  # not the message its headers say (revoked or expired before the pool saw it)
            if expired:
                # Celery put the task id in the worker's revoked set on this message's word (its `expires` header,
                # which signing does not cover) before any hook ran: taken out again, or the genuine message would
                # be discarded as revoked and its child counted `revoked`.
                worker_state.revoked.discard(request.id)
            self.refuse(fanin, request.id, marker, why)
            return
        reason = "expired" if expired else "terminated" if terminated else "revoked"
        if expired:
            # Celery put the id in this worker's revoked set for this copy's own expiry, not for a revoke: another
            # copy (a live run's retry, a redelivery) must still be judged on its own.
            worker_state.revoked.discard(request.id)
        # Only a terminated copy ran; an expired or revoked one was discarded before a pool process took it.
        ran_in = (_ran_in(request) or 0) if terminated else None
        retries = (getattr(request, "request_dict", None) or {}).get("retries")
        self._ended(
            fanin,
            request.id,
            marker,
            ChildState.REVOKED,
            SuccessorState.REVOKED,
            _Revoked(reason),
            ran_in=ran_in,
            retries=retries,
        )

    @report.in_event_loop
    def task_unknown(
        self,
        sender: Any = None,
        message: Any = None,
        exc: BaseException | None = None,
        name: str | None = None,
        id: str | None = None,
        **_: Any,
    ) -> None:
        """Record a message for a task this worker does not know."""
        marker = Marker.from_mapping(getattr(message, "headers", None))
        fanin = _fanin_for(getattr(sender, "app", None))
        if marker is None or fanin is None or not id or _unverified(fanin, "unknown task", id, exc):
            return
        retries = (getattr(message, "headers", None) or {}).get("retries")
        self._ended(fanin, id, marker, ChildState.UNKNOWN, SuccessorState.FAILED, exc, ran_in=None, retries=retries)

    @report.in_event_loop
    def task_rejected(
        self, sender: Any = None, message: Any = None, exc: BaseException | None = None, **_: Any
    ) -> None:
        """Record a message the worker refused (a content type it does not accept, or a body it cannot decode)."""
        headers = getattr(message, "headers", None) or {}
        marker = Marker.from_mapping(headers)
        fanin = _fanin_for(getattr(sender, "app", None))
        task_id = headers.get("id")
        if marker is None or fanin is None or not task_id or _unverified(fanin, "rejected", task_id, exc):
            return
        retries = headers.get("retries")
        self._ended(
            fanin, task_id, marker, ChildState.REJECTED, SuccessorState.FAILED, exc, ran_in=None, retries=retries
        )

    def worker_init(self, sender: Any = None, **_: Any) -> None:
        """Refuse bad settings, a pooled URL or an old schema; guard the app's tasks; count undecodable messages."""
        app = getattr(sender, "app", None)
        fanin = _fanin_for(app)
        if fanin is not None:
            try:
                fanin.check_settings()
                fanin.check_session_pooling()
                fanin.check_schema()
            except FanInNotConfigured as exc:  # Celery logs and ignores a signal handler's Exception: stop the worker
                logger.critical("%s", exc)
                raise SystemExit(1) from exc
            guard_tasks(app)  # type: ignore[arg-type]
            self._report_decode_errors()
            successor_runs.new_worker_key()  # before the pool starts: its processes inherit it

    def worker_process_init(self, **_: Any) -> None:
        """Guard the tasks of a pool process started as a fresh interpreter (spawn), and rebuild their tracers."""
        # The tracers read `before_start` once when they are built.
        app = current_app._get_current_object()
        if _fanin_for(app) is not None and guard_tasks(app):
            for name, task in app.tasks.items():
                task.__trace__ = build_tracer(name, task, app.loader, app=app)

    def worker_shutdown(self, **_: Any) -> None:
        """Give the starts and the reports still queued a few seconds to reach the store."""
        starts.flush_all(timeout=5.0)
        if not report.background.flush(timeout=10.0):
            logger.warning(
                "reports still waiting for the store at shutdown: reconciliation and child_timeout settle them"
            )

    def worker_process_shutdown(self, **_: Any) -> None:
        """The same as `worker_shutdown`, in a pool process."""
        self.worker_shutdown()

    # --- helpers -----------------------------------------------------------------------------------------------

    def _successor_postrun(
        self, fanin: FanIn, marker: Marker, live: successor_runs.LiveRun | None, state: str | None, retval: Any
    ) -> None:
        """How an execution of a successor ended, as its run records it (see docs/concepts/terminal-outcomes.md)."""
        if live is None or live.ended:
            return  # a duplicate the guard refused, or a run already handed over (a retry, a replacement)
        exc = retval if isinstance(retval, BaseException) else None
        if state == "SUCCESS":
            self.record_successor(fanin, marker, SuccessorState.SUCCEEDED, value=retval, live=live)
        elif state == "FAILURE":
            self.record_successor(fanin, marker, SuccessorState.FAILED, exc, live=live)
        elif state == "RETRY":  # the retry hand-over was not installed (eager runs): the retry comes after this
            when = getattr(retval, "when", None)
            eta = when if isinstance(when, datetime) else None
            successor_runs.hand_over(live, SuccessorState.RETRYING, _due_at(eta, None if eta else float(when or 0)))
        elif state == "REJECTED" and isinstance(retval, Reject) and retval.requeue:
            successor_runs.hand_over(live, SuccessorState.REQUEUED)  # Celery requeues the message after this returns
        elif state == "REJECTED":
            self.record_successor(fanin, marker, SuccessorState.FAILED, exc, live=live)
        elif state == "IGNORED":
            self.record_successor(fanin, marker, SuccessorState.IGNORED, live=live)
        else:  # no state: the pool process is being stopped; its lease lapses and the relay runs the successor again
            successor_runs.abandon(live)

    def _part_postrun(self, fanin: FanIn, task: Any, marker: Marker, state: str | None, retval: Any) -> None:
        """A part of a successor's replacement ended in a pool process: its failure (or a `Reject` without requeue)
        means the replacement's carrier will not be published, so the successor fails with the part's error; its
        success, a retry, an `Ignore` change nothing (the replacement goes on, or another attempt reports)."""
        requeued = isinstance(retval, Reject) and retval.requeue
        if state not in ("FAILURE", "REJECTED") or requeued or task.request.is_eager:
            return  # (its claim was checked by `task_postrun`, as a child's is)
        exc = retval if isinstance(retval, BaseException) else None
        if self.end_replacement(fanin, marker, SuccessorState.FAILED, exc):
            logger.info(
                "successor of batch_id=%s failed: task %s (task_id=%s) of its replacement failed, so its carrier "
                "will not come",
                marker.batch_id,
                task.name,
                task.request.id,
            )

    def _report_decode_errors(self) -> None:
        """Count a child whose body the worker cannot decode (corrupt, or not what its content type says) as
        rejected: Celery acks such a message in `Consumer.on_decode_error` and only logs it, no signal fires, and
        the child would wait for `child_timeout`. Its headers are readable, so it is reported as `task_rejected`
        would be. Wrapped once per worker process, at `worker_init`."""
        original = Consumer.on_decode_error
        if getattr(original, "_fanin_reports", False):
            return
        task_rejected = self.task_rejected

        def on_decode_error(consumer: Any, message: Any, exc: BaseException) -> None:
            original(consumer, message, exc)  # logs and acks, as before
            task_rejected(sender=consumer, message=message, exc=exc)

        on_decode_error._fanin_reports = True  # type: ignore[attr-defined]
        Consumer.on_decode_error = on_decode_error  # type: ignore[method-assign]


# The signals `WorkerHooks.install` connects, with the dispatch uid each had (`celery_fanin.<uid>`).
_SIGNALS = (
    ("task_prerun", "prerun"),
    ("task_postrun", "postrun"),
    ("task_received", "received"),
    ("before_task_publish", "claim"),  # protocol.CLAIM_RECEIVER: the fast path tells it from other receivers
    ("task_failure", "failure"),
    ("task_revoked", "revoked"),
    ("task_unknown", "unknown"),
    ("task_rejected", "rejected"),
    ("worker_init", "worker_init"),
    ("worker_shutdown", "worker_shutdown"),
    ("worker_process_shutdown", "worker_process_shutdown"),
    ("worker_process_init", "worker_process_init"),
)

worker_hooks = WorkerHooks()


def _ran_in(request: Any) -> int | None:
    """The pool process a main-process request ran in (prefork's `worker_pid`; the main process itself for the
    thread pools and solo), or None if none took it."""
    pid = getattr(request, "worker_pid", None)
    return pid if isinstance(pid, int) and pid > 0 else None


def _request_claim(request: Any) -> Any:
    """The claim in a request's body: a main-process `Request` holds the decoded body, a pool's context has the
    body's embed lifted onto it (and no header of that name: `task_received` dropped it)."""
    payload = getattr(request, "_payload", None)
    return body_claim(payload) if payload is not None else getattr(request, BODY_CLAIM, None)


def _guard(before_start: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a task's `before_start` so that a fan-in message whose headers differ from its body's claim never
    runs (see `claim_refusal`), and a successor's body runs in one execution at a time, never after it ended for
    good (see `store.successors`).

    `before_start` runs inside the trace's exception handling, so the `Ignore` raised for a refused message or a
    duplicate delivery ends that execution as IGNORED without running its body (and without touching the live
    run's state).
    """

    def before_start_guarded(self: Any, task_id: str, args: Any, kwargs: Any) -> Any:
        request = self.request
        marker = Marker.from_mapping(request)
        if marker is None and request.is_eager:  # eager: the headers stay in `request.headers`
            marker = Marker.from_mapping(request.headers)
        fanin = _fanin_for(self.app) if marker is not None else None
        if fanin is not None and marker is not None and not request.is_eager:
            why = claim_refusal(fanin, request, getattr(request, BODY_CLAIM, None))
            if why is not None:
                worker_hooks.refuse(fanin, task_id, marker, why)
                raise Ignore()
        if marker is not None and marker.is_part:
            return before_start(self, task_id, args, kwargs)  # not the successor: runs freely (`Marker.is_part`)
        if (
            fanin is not None
            and marker is not None
            and marker.is_successor
            and successor_runs.request_run(self.request) is None
            and worker_hooks.admit_successor(fanin, self.request, marker.successor_id(task_id), marker) is None
        ):
            logger.warning(
                "duplicate delivery of successor batch_id=%s step=%s task_id=%s: body not run",
                marker.batch_id,
                marker.step,
                task_id,
                extra={"batch_id": marker.batch_id, "step": marker.step, "task_id": task_id},
            )
            raise Ignore()
        if fanin is not None and marker is not None and marker.is_successor:
            why = request_header(request, HEADER_CHORD)
            if why:
                # A chord's body whose header did not all succeed: admitted (so this is its one run), failed here
                # instead of run, so Celery records the failure and calls the body's errbacks once, as it does
                # for a chord's body (`chord_error_from_stack`): a chain's or a group's, which `then_canvas`
                # carries inside its canvas, too.
                if self.name == THEN_CANVAS_TASK and isinstance(kwargs, dict):
                    request.errbacks = [*(request.errbacks or []), *_canvas_errbacks(kwargs.get("canvas"))]
                raise successor_runs.chord_failure(fanin, marker.batch_id, str(why))
        return before_start(self, task_id, args, kwargs)

    before_start_guarded._fanin_guard = True  # type: ignore[attr-defined]
    return before_start_guarded


def _canvas_errbacks(canvas: Any) -> list[Any]:
    """The errbacks Celery calls when a chord's body that is this canvas fails unrun: a chain's own, or each
    member's of a group (`Backend.chord_error_from_stack`, `_handle_group_chord_error`)."""
    if not isinstance(canvas, dict):
        return []
    if canvas.get("subtask_type") == "group":
        members = (canvas.get("kwargs") or {}).get("tasks") or []
        return [eb for m in members if isinstance(m, dict) for eb in (m.get("options") or {}).get("link_error") or []]
    return list((canvas.get("options") or {}).get("link_error") or [])


def _due_at(eta: datetime | None, countdown: float | None) -> datetime:
    if eta is not None:
        return eta if eta.tzinfo is not None else eta.replace(tzinfo=timezone.utc)
    return datetime.now(timezone.utc) + timedelta(seconds=float(countdown or 0))


@contextmanager
def _handed_over(
    live: successor_runs.LiveRun,
    state: str,
    ends: type[BaseException],
    due_at: datetime | None = None,
    carrier: str | None = None,
) -> Iterator[None]:
    """Hand the run over for the call inside, which publishes the next delivery and ends with `ends`; if it
    raises anything else, nothing was handed on and the run is taken back."""
    successor_runs.hand_over(live, state, due_at, carrier)
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
        with _handed_over(live, SuccessorState.RETRYING, Retry, _due_at(eta, delay)):
            return retry(self, args, kwargs, exc, throw, eta, countdown, max_retries, **options)

    retry_guarded._fanin_guard = True  # type: ignore[attr-defined]
    return retry_guarded


def _replace_guard(on_replace: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap `Task.on_replace` (called by `Task.replace`) so that the replacement carries the fan-in on.

    The replacement has the replaced task's id but none of its custom headers: its carrier (the task that takes
    that id) gets the fan-in headers, so a child is counted when its replacement ends, and a successor ends when its
    replacement does. Its other tasks (a chain's earlier tasks, a chord's header) get headers too, so that one that
    fails ends what the carrier would have (the carrier then never comes): for a child, each reports for it as a
    chain child's earlier task does; for a successor, each is a *part* (`Marker.is_part`), never admitted as a run.
    A successor's run is handed over (`replaced`) before the replacement is published, so the replacement's
    delivery is admitted. A child's replacement also keeps the ``ignore_result=True`` the library gave the child
    (Celery's `replace` does not carry it), so that its results stay out of the result backend too.
    """

    def on_replace_guarded(self: Any, sig: Any) -> Any:
        marker = Marker.from_mapping(self.request)
        if marker is None or self.request.is_eager:
            return on_replace(self, sig)
        carrier = _carrier(sig)
        tasks = [carrier, *_parts(sig, carrier)]
        rid = self.request.id
        replaced_id = marker.successor_id(rid) if marker.is_successor else marker.child_id(rid)
        if not marker.is_successor and getattr(self.request, "ignore_result", None) is True:
            fanin = _fanin_for(self.app)
            if fanin is not None and not fanin.settings.store_child_results_in_backend:
                # The carrier only: a part's result is stored under its own id, and a chord (a group replacement,
                # which Celery upgrades) reads its header's results from the result backend.
                carrier.options.setdefault("ignore_result", True)
        _add_headers(carrier, marker.headers())
        if not marker.is_part and (marker.is_successor or marker.chain is None):
            # A carrier frozen with a task id of its own (Celery keeps it) stands for the successor's or the
            # child's (`Marker.stands_for`); in a chain child, the chain's id names the child already.
            if carrier.options.get("task_id", replaced_id) != replaced_id:
                carrier.options["headers"][HEADER_PART_OF] = replaced_id
            else:
                carrier.options["headers"].pop(HEADER_PART_OF, None)
        live = successor_runs.request_run(self.request) if marker.is_successor and not marker.is_part else None
        if live is None or live.ended:
            if not marker.is_successor or marker.is_part:
                for part in tasks[1:]:
                    _add_headers(part, marker.part_headers(replaced_id, marker.carrier))
            return on_replace(self, sig)
        # From here on only the carrier is admitted: a copy of this message (a redelivery, the relay's, a stall
        # republish) has the same task id but not this token.
        token = uuid.uuid4().hex
        carrier.options["headers"][HEADER_CARRIER] = token
        for part in tasks[1:]:
            _add_headers(part, marker.part_headers(replaced_id, token))
        with _handed_over(live, SuccessorState.REPLACED, Ignore, carrier=token):
            return on_replace(self, sig)

    on_replace_guarded._fanin_guard = True  # type: ignore[attr-defined]
    return on_replace_guarded


def _add_headers(sig: Any, headers: dict[str, Any]) -> None:
    sig.options["headers"] = {**(sig.options.get("headers") or {}), **headers}


def _carrier(sig: Any) -> Any:
    """The task of a replacement that takes the replaced task's id, and so its place (`Task.replace` freezes the
    replacement with that id: a chain's last task, a chord's body)."""
    if isinstance(sig, _chain) and sig.tasks:
        return _carrier(sig.tasks[-1])
    if isinstance(sig, chord):
        return _carrier(sig.body)
    return sig


def _parts(sig: Any, carrier: Any) -> list[Any]:
    """The task signatures of a replacement other than its carrier: a chain's, a chord's header's and body's, a
    group's members, at any depth."""
    if sig is carrier:
        return []
    if isinstance(sig, chord):
        return [*_parts(sig.tasks, carrier), *_parts(sig.body, carrier)]
    if isinstance(sig, (_chain, group)):
        return [part for task in sig.tasks if isinstance(task, Signature) for part in _parts(task, carrier)]
    return [sig] if isinstance(sig, Signature) else []


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


def install(app: Celery) -> None:
    """Connect the worker hooks once per process; they act only for apps wired with FanIn."""
    worker_hooks.install()
