"""The reports a worker process makes: a child's terminal outcome, a successor's end, a refusal.

`Reporter` is the one path from Celery's signals, the task guards and eager mode to the store: a child's terminal
outcome is one statement on the process's report connection (`record_child`), a successor's end one update fenced
to its run (`record_successor`). Each worker process has one (`runtime.current.reporter`); a successor one of its
reports created is published from here, after that report's commit (`dispatch.successors`).
"""

from __future__ import annotations

import logging
import traceback
import uuid
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

from celery import Celery
from celery.exceptions import Reject, SoftTimeLimitExceeded
from kombu.exceptions import EncodeError
from prometheus_client import Counter

from ..codec import encode_result
from ..context import FanIn
from ..dispatch.successors import publish_created_successor
from ..protocol import BODY_CLAIM, ChildState, Marker, SuccessorState, claim
from ..store import batches, reports, successors
from ..store.outbox import OutboxRow
from . import batching, report, starts, successor_runs

logger = logging.getLogger("celery_fanin.hooks")

# Reports refused: the message's batch, index or task name disagree with the child's row (the store's check), or its
# headers disagree with the claim in its body (the worker's, for children and successors).
_REFUSED = Counter(
    "fanin_worker_reports_refused", "Reports refused: headers that do not match the child or the body's fan-in claim."
)
# The claim `refuse` sends for a child: no child has index -1, so the store's report statement moves nothing and
# counts the refusal on the child the task id names (its batch's `refused_reports`), as for any refused report.
_NO_CHILD = batches.Claim("00000000-0000-0000-0000-000000000000", -1, None)

# Publishes the successor a report created, after its commit, given the rows the report returned for it.
PublishSuccessor = Callable[[FanIn, uuid.UUID, Sequence[OutboxRow]], object]


def fanin_for(app: Celery | None) -> FanIn | None:
    """The fan-in of `app`, if it was wired with `FanIn(app)` (else the hooks leave its tasks alone)."""
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
            lambda: successors.note_traceback(fanin.reports, uuid.UUID(marker.batch_id), marker.step or "", trace),
        )


def claim_of(marker: Marker) -> batches.Claim:
    """What a message says its child is, which the store checks before counting the report."""
    return batches.Claim(marker.batch_id, marker.index, marker.task_name)


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


def unverified(fanin: FanIn, what: str, task_id: str, exc: BaseException | None) -> bool:
    """True, and logged, when the app signs its messages (``task_serializer = "auth"``) and this one's body was
    never verified (refused, undecodable, or for a task the worker does not know): its headers are anyone's, so
    it must not end the child it names. The genuine message, signed, still counts the child when it runs."""
    if fanin.app.conf.task_serializer != "auth":
        return False
    logger.warning("%s message for task_id=%s not counted: its signature was not verified (%s)", what, task_id, exc)
    return True


class Reporter:
    """A worker process's reports. `publish_successor` publishes a successor a report of this process created, after
    its commit (`dispatch.successors.publish_created_successor`; None: the relay publishes it)."""

    def __init__(self, publish_successor: PublishSuccessor | None = publish_created_successor) -> None:
        self.publish_successor = publish_successor

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
            lambda runner: reports.record_terminal(
                batching.runner(runner),  # a pool process of a worker that commits reports in groups: its batcher
                task_id,
                state,
                result=result,
                exc_type=exc_type,
                exc_message=exc_message,
                start=start,
                claim=claim,
                unrun=unrun,
                handoff=fanin.report_handoff,
            ),
            batch_id=marker.batch_id,
        )
        extra = {"batch_id": marker.batch_id, "child_index": marker.index, "task_id": task_id, "state": state}
        if rec is None:
            return None
        # The counted run's traceback, kept in the database only (never in the successor's message). A late report
        # may be this very run's, resent after its first copy was counted with the answer lost (a soft time limit
        # in the wait, a group's answer too late): the function writes it only onto a counted failure with this
        # error's type and text, so another copy's failure never gets this one's traceback.
        trace = format_traceback(exc) if (rec.counted or rec.late) and state != ChildState.SUCCEEDED else None
        if trace is not None:
            report.send_terminal(
                fanin,
                f"traceback of task {task_id}",
                lambda runner: reports.note_traceback(runner, task_id, trace, exc_type, exc_message),
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
            batch = uuid.UUID(batch_id)
        except ValueError:  # not a batch id: the store counted nothing for it, so this is unreachable
            return
        publish(fanin, batch, handed_off)

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
            lambda runner: reports.record_terminal(runner, child_id, ChildState.REJECTED, claim=_NO_CHILD),
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

    def copy_ended(
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

    def postrun(self, task: Any, task_id: str, retval: Any, state: str | None) -> None:
        """How a child's, a successor's or a replacement part's execution ended in a pool process (or inline in
        eager mode), from Celery's `task_postrun`: success, failure, rejection, or a hand-over of the run."""
        marker = Marker.from_mapping(task.request)
        if marker is None:
            return
        fanin = fanin_for(task.app)
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
            successor_runs.hand_over(
                live, SuccessorState.RETRYING, successor_runs.due_at(eta, None if eta else float(when or 0))
            )
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
