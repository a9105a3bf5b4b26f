"""The handle a fan-in returns (`FanInResult`) and the status it reads (`BatchStatus`): every call reads the store."""

from __future__ import annotations

import builtins
import time
import uuid
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any, TypeVar

from celery import Celery, current_app, states
from celery.backends.base import DisabledBackend
from celery.exceptions import TaskRevokedError
from celery.exceptions import TimeoutError as CeleryTimeoutError
from celery.result import AsyncResult, EagerResult
from celery.utils.serialization import create_exception_cls
from sqlalchemy.exc import SQLAlchemyError

from ..codec import decode_result, decode_signature
from ..context import FanIn
from ..exceptions import BatchNotFound, ChordHeaderFailed, FanInDatabaseError, summarise
from ..protocol import (
    BATCH_ENDED_WITHOUT_SUCCESSOR,
    CHORD_OPTION,
    RUN_GROUP_TASK,
    SUCCESSOR_FINAL,
    THEN_CANVAS_TASK,
    SuccessorKind,
    SuccessorState,
)
from ..relay import reruns
from ..store import admin, batches, queries
from ..store.outcomes import failure_entry
from . import actions


@dataclass(frozen=True)
class BatchStatus:
    """A batch as the store sees it now."""

    batch_id: str
    step: str
    state: str
    planned: int
    remaining: int
    succeeded: int
    failed: int
    published: int
    created_at: datetime
    completed_at: datetime | None
    successor_task_id: str
    successor_name: str
    successor_state: str | None  # None until the last child's terminal outcome creates the successor
    successor_runs: int
    successor_duplicates: int
    # Reports refused because their message's batch, index or task name disagreed with the child's row, or its
    # headers with the fan-in claim in its body (docs/concepts/trust.md).
    refused_reports: int = 0

    @property
    def finished(self) -> bool:
        """True once the successor has run to a final state."""
        return self.successor_state in SUCCESSOR_FINAL

    @property
    def done(self) -> bool:
        """True once nothing more will happen: the successor has finished, or the batch ended with nothing to run
        (`expired` by an abandoned deadline, or `cancelled`, without `on_expire`: the row that runs `on_expire` is
        created in the same transaction as that state, so none will come later)."""
        return self.finished or (self.state in BATCH_ENDED_WITHOUT_SUCCESSOR and self.successor_state is None)

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["created_at"] = self.created_at.isoformat()
        data["completed_at"] = self.completed_at.isoformat() if self.completed_at else None
        return data


def read_status(fanin: FanIn, batch_id: str | uuid.UUID) -> BatchStatus:
    bid = parse_batch_id(batch_id)
    try:
        with fanin.engine.connect() as conn:
            batch = queries.batch(conn, bid)
            if batch is None:
                raise BatchNotFound(f"no fan-in batch with id {bid}")
            succ = queries.successor(conn, bid, batch.step)
            leaves, leaf_succeeded, leaf_failed = queries.unfinished_leaves(conn, bid)
    except SQLAlchemyError as exc:
        raise FanInDatabaseError(f"could not read batch {bid}: {summarise(exc)}") from exc
    return BatchStatus(
        batch_id=str(batch.id),
        step=batch.step,
        state=batch.state,
        planned=batch.planned,
        # In children, whatever the shape: a tree's root counts leaves, and an open batch holds a token.
        remaining=batch.planned - batch.succeeded - leaf_succeeded - batch.failed - leaf_failed,
        succeeded=batch.succeeded + leaf_succeeded,
        failed=batch.failed + leaf_failed,
        published=batch.published_upto,
        created_at=batch.created_at,
        completed_at=batch.completed_at,
        successor_task_id=batch.successor_task_id,
        successor_name=batch.successor_name,
        successor_state=succ.state if succ else None,
        successor_runs=succ.runs if succ else 0,
        successor_duplicates=succ.duplicates if succ else 0,
        refused_reports=batch.refused_reports,
    )


def parse_batch_id(batch_id: str | uuid.UUID) -> uuid.UUID:
    if isinstance(batch_id, uuid.UUID):
        return batch_id
    try:
        return uuid.UUID(str(batch_id))
    except ValueError:
        raise BatchNotFound(f"{batch_id!r} is not a batch id (batch ids are UUIDs)") from None


S = TypeVar("S")


def poll_until_finished(
    read: Callable[[], S],
    finished: Callable[[S], bool],
    timeout: float | None,
    interval: float,
    describe: Callable[[S], str],
) -> S:
    """Read until `finished`; `celery.exceptions.TimeoutError` (with `describe`) after `timeout` seconds.

    `FanInDatabaseError` while waiting is retried until then: a database restart or failover should not end a wait.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        try:
            status = read()
        except FanInDatabaseError:
            if deadline is not None and time.monotonic() >= deadline:
                raise
        else:
            if finished(status):
                return status
            if deadline is not None and time.monotonic() >= deadline:
                raise CeleryTimeoutError(describe(status))
        time.sleep(interval)


class FanInResult(AsyncResult):  # type: ignore[misc]  # Celery's AsyncResult is untyped
    """The handle of a fan-in: a Celery result of its successor, read from the store (no result backend needed).

    `id` is the successor's task id, and `get`/`wait`, `result`/`info`, `state`/`status`, `ready`, `successful`,
    `failed`, `traceback`, `date_done`, `name` and `revoke` mean what they mean for that task's `AsyncResult`, as
    a chord's result does for its body; `parent` is the children's view, as a chord's header is its `GroupResult`.
    The batch's own: `batch_id`, `batch_status()` (the counts now), `wait_batch()` (them once final), `cancel()`,
    `seal()`. A handle holds no worker and no connection: every call reads PostgreSQL.
    """

    def __init__(self, app: Celery, batch_id: str | uuid.UUID, successor_task_id: str | None = None) -> None:
        """A handle on a batch; `FanInResult(app, batch_id)` rebuilds one from a stored id (it reads the
        successor's id, and raises `BatchNotFound` for an unknown batch). `freeze` gives both ids, before the
        batch exists."""
        batch = str(parse_batch_id(batch_id))
        if successor_task_id is None:
            successor_task_id = read_status(FanIn.of(app), batch).successor_task_id
        super().__init__(successor_task_id, app=app)
        self.batch_id = batch

    @classmethod
    def restore(cls, batch_id: str | uuid.UUID, app: Celery | None = None) -> FanInResult:
        """The handle of a stored batch id, as `GroupResult.restore` is of a saved group id."""
        return cls(app or current_app, batch_id)

    @property
    def successor_task_id(self) -> str:
        return str(self.id)

    def __repr__(self) -> str:
        return f"<FanInResult batch_id={self.batch_id} successor={self.id}>"

    def __reduce__(self) -> tuple[Any, ...]:
        return _restore_handle, (self.batch_id, str(self.id))

    def _status_or_none(self) -> BatchStatus | None:
        """The status, or None while the batch does not exist yet (frozen, its message not yet run)."""
        try:
            return self.batch_status()
        except BatchNotFound:
            return None

    # --- the batch ------------------------------------------------------------------------------------------------

    def batch_status(self) -> BatchStatus:
        """The batch as the store sees it now: its counts, state and successor (`celery -A proj fanin status`)."""
        return read_status(FanIn.of(self.app), self.batch_id)

    def wait_batch(self, timeout: float | None = None, interval: float = 0.1) -> BatchStatus:
        """Block until the batch has reached its final state; returns that status (`get` returns the value).

        Final: the successor (or `on_failure`/`on_expire`) has finished (succeeded, failed or revoked), or the
        batch ended with nothing to run (`expired` or `cancelled` without `on_expire`; `successor_state` is then
        None). Raises `celery.exceptions.TimeoutError` if it has not within `timeout` seconds. Database errors
        while waiting are retried until then (a restart or failover should not end a wait), and a frozen handle
        whose batch does not exist yet waits for it.
        """
        return self._wait(timeout, interval, follow_parents=False)

    def _wait(self, timeout: float | None, interval: float, follow_parents: bool) -> BatchStatus:
        """`wait_batch`; with `follow_parents`, while the batch does not exist yet, a failed task before the fan-in
        in a chain raises its error (Celery's `follow_parents`): the chain stopped there, so the batch never will."""

        def fetch() -> BatchStatus | None:
            status = self._status_or_none()
            if status is None and follow_parents:
                self._parents_failed()
            return status

        status = poll_until_finished(
            fetch,
            lambda st: st is not None and st.done,
            timeout,
            interval,
            lambda st: (
                f"batch {self.batch_id} not finished after {timeout}s: "
                + (
                    "not created yet"
                    if st is None
                    else f"state={st.state} remaining={st.remaining} successor={st.successor_state}"
                )
            ),
        )
        assert status is not None
        return status

    def _parents_failed(self) -> None:
        """Raise the error of the first task before the fan-in in its chain that failed (Celery's
        `_maybe_reraise_parent_error`). A task's state needs the app's result backend: without one there is
        nothing to read, and the wait goes on."""
        for node in reversed(list(self._parents())):
            if isinstance(getattr(node, "backend", None), DisabledBackend):
                return  # no result backend configured
            node.maybe_throw()

    # --- the successor, as Celery's AsyncResult has it --------------------------------------------------------------

    @property
    def state(self) -> str:
        """The successor's state as Celery names it: PENDING until it runs (and while the children do), STARTED,
        RETRY, SUCCESS, FAILURE, REVOKED (also a batch that ended with nothing to run), IGNORED."""
        status = self._status_or_none()
        if status is None:
            return states.PENDING
        if status.successor_state is None:
            return states.REVOKED if status.done else states.PENDING
        return _CELERY_STATES.get(status.successor_state, states.PENDING)

    @property
    def status(self) -> _State:
        """`state`, as Celery's alias. Calling it (`handle.status()`, the batch's status before 0.1) still returns
        `batch_status()`, with a DeprecationWarning."""
        return _State(self.state, self.batch_status)

    def ready(self) -> bool:
        status = self._status_or_none()
        return status is not None and status.done

    def successful(self) -> bool:
        return self.state == states.SUCCESS

    def failed(self) -> bool:
        return self.state == states.FAILURE

    def get(  # type: ignore[override]
        self,
        timeout: float | None = None,
        propagate: bool = True,
        interval: float = 0.1,
        follow_parents: bool = True,
        **_: Any,
    ) -> Any:
        """The successor's return value once it has finished (as `AsyncResult.get`), read from the store.

        Raises its error if it failed (with `propagate`; else returns it), `TaskRevokedError` if it was revoked or
        the batch ended with nothing to run, `celery.exceptions.TimeoutError` after `timeout` seconds. A frozen
        handle whose batch does not exist yet waits for it. A batch retried with `fanin retry-failed` answers with
        its last round's successor (waiting for it, within the same `timeout`). With `follow_parents` and
        `propagate` (Celery's defaults), a failed task before the fan-in in a chain raises its error while the batch
        does not exist yet (read from the result backend; without one the wait goes on). Other keyword arguments of
        Celery's (`callback`, `disable_sync_subtasks`, ...) are accepted and ignored."""
        deadline = None if timeout is None else time.monotonic() + timeout
        status = self._wait(timeout, interval, follow_parents and propagate)
        latest = self._latest_round()
        if latest is not None:  # retried (`fanin retry-failed`): the last round's successor is the answer
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            return latest.get(left, propagate, interval)
        value, exc = self._outcome(status)
        if exc is None and status.successor_name == RUN_GROUP_TASK and self._body_is_a_chord():
            # chord(header, chord(...)): as Celery's, the handle answers with the inner chord's body.
            following = self.next_stage()
            if following is None:
                raise CeleryTimeoutError(f"chord {self.batch_id}'s body, a chord, was not written")
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            return following.get(left, propagate, interval)
        if exc is None and status.successor_name == THEN_CANVAS_TASK and isinstance(value, dict):
            # then=group(...) (a chord's body that is a group): the group's values, from the stage it was written
            # as; none for a group Celery ran (`then_canvas`), whose value is the group's already.
            following = self.next_stage()
            if following is not None and value == {"batch_id": following.batch_id}:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                return following.get(left, propagate, interval)
        if exc is None:
            return value
        if propagate:
            raise exc
        return exc

    def _body_is_a_chord(self) -> bool:
        """Whether this batch is a chord whose body is a chord (its stored body is marked `CHORD_OPTION`)."""
        with FanIn.of(self.app).engine.connect() as conn:
            row = queries.batch(conn, parse_batch_id(self.batch_id))
        if row is None or row.successor_message is None:
            return False
        return bool(decode_signature(self.app, row.message_for(SuccessorKind.THEN)).options.get(CHORD_OPTION))

    def wait(  # type: ignore[override]
        self, timeout: float | None = None, propagate: bool = True, interval: float = 0.1, **kwargs: Any
    ) -> Any:
        """`get`, as Celery's alias (before 0.1 this returned the batch's status: `wait_batch()` does now)."""
        return self.get(timeout, propagate, interval, **kwargs)

    def _latest_round(self) -> FanInResult | None:
        """The handle of this batch's last retry round (`fanin retry-failed`), if one came after this batch's."""
        bid = parse_batch_id(self.batch_id)
        with FanIn.of(self.app).engine.connect() as conn:
            node = admin.node(conn, bid)
            latest = admin.latest_round(conn, node.retry_of or node.id) if node is not None else None
            later = node is not None and latest is not None and latest != bid
            found = admin.node(conn, latest) if later and latest is not None else None
        if found is None or node is None or found.round <= node.round:
            return None
        return FanInResult(self.app, str(found.id))

    def _outcome(self, status: BatchStatus) -> tuple[Any, BaseException | None]:
        """(value, None) for a successor that succeeded; (None, its error) for one that did not, or none ran."""
        fanin = FanIn.of(self.app)
        bid = parse_batch_id(self.batch_id)
        with fanin.engine.connect() as conn:
            succ = queries.successor(conn, bid, status.step)
            encoded = queries.successor_result(conn, bid, status.step)
            if succ is not None and succ.state == SuccessorState.FAILED:
                exc = rebuilt_exception(succ.exc_type, succ.exc_message)
                if isinstance(exc, ChordHeaderFailed):  # a chord's body not run: name its failed children
                    exc.batch_id = self.batch_id
                    limit = int(fanin.settings.outcome_failures_limit)
                    exc.failures = [failure_entry(r) for r in queries.failures(conn, bid, limit=limit)]
                return None, exc
        if succ is None or succ.state == SuccessorState.REVOKED:
            return None, TaskRevokedError(
                f"batch {self.batch_id} ended {status.state}"
                + (" with its successor revoked" if succ is not None else " with no successor run")
            )
        return (decode_result(self.app, encoded) if encoded is not None else None), None

    @property
    def result(self) -> Any:
        """As Celery's: the successor's return value once it succeeded, its error once it failed or was revoked,
        None until then (it does not wait: `get` does). After `fanin retry-failed`, the last round's, as `get`."""
        status = self._status_or_none()
        if status is None or not status.done:
            return None
        latest = self._latest_round()
        if latest is not None:
            return latest.result
        value, exc = self._outcome(status)
        return value if exc is None else exc

    @property
    def info(self) -> Any:
        """`result`, as Celery's alias."""
        return self.result

    @property
    def traceback(self) -> str | None:
        """The successor's traceback as Celery gives it: None unless it failed; then the traceback its run raised
        (kept in PostgreSQL, its last 16,000 characters), or ``Type: message`` for a failure that raised nothing
        in its code (a lost worker, a time limit seen by the main process)."""
        status = self._status_or_none()
        if status is None or status.successor_state != SuccessorState.FAILED:
            return None
        with FanIn.of(self.app).engine.connect() as conn:
            succ = queries.successor(conn, parse_batch_id(self.batch_id), status.step)
        if succ is None:
            return None
        return succ.traceback or f"{succ.exc_type or 'Exception'}: {succ.exc_message or ''}"

    @property
    def date_done(self) -> datetime | None:
        """When the successor finished (or the batch ended with nothing to run); None until then."""
        status = self._status_or_none()
        if status is None or not status.done:
            return None
        fanin = FanIn.of(self.app)
        with fanin.engine.connect() as conn:
            succ = queries.successor(conn, parse_batch_id(self.batch_id), status.step)
        if succ is not None and succ.finished_at is not None:
            return succ.finished_at
        return status.completed_at

    @property
    def name(self) -> str | None:
        """The successor's task name (the `then=` signature's, or `on_failure`'s or `on_expire`'s once it runs)."""
        status = self._status_or_none()
        return None if status is None else status.successor_name

    @property
    def parent(self) -> FanInChildren:
        """The children, as a chord result's `parent` is its header's `GroupResult`: `completed_count()`,
        `revoke()`, `ready()`, `len()`. Their own `parent` is what Celery set as this result's (the task before the
        fan-in in a chain), so Celery's walk up a chain's results goes on through them, as through a chord's."""
        return FanInChildren(self.app, self.batch_id, self._previous)

    @parent.setter
    def parent(self, value: Any) -> None:
        self._previous = value

    def as_tuple(self) -> Any:
        """What Celery stores of this result (a task that returns the handle, `GroupResult.save`): its id and the
        result before the fan-in in a chain, as `AsyncResult.as_tuple` (never the children, which are rows)."""
        previous = self._previous
        return (self.id, previous.as_tuple() if previous is not None else None), None

    def forget(self) -> None:
        """Forget the successor's result in Celery's result backend, if one is configured (nothing else to do
        without one). The batch's rows stay, with the successor's result, until `celery -A proj fanin prune`."""
        self._cache = None
        if self._previous is not None:
            self._previous.forget()
        if not isinstance(self.backend, DisabledBackend):
            self.backend.remove_pending_result(self)
            self.backend.forget(self.id)

    # --- the batch's operations -----------------------------------------------------------------------------------

    def cancel(self, proceed: bool = False) -> BatchStatus:
        """End the batch now, as `celery -A proj fanin cancel` does: unfinished children are abandoned and revoked;
        the batch ends `cancelled` (only `on_expire` runs) or, with `proceed`, `partial` with its successor run.
        Raises `BatchNotOpen` if it has already ended."""
        actions.cancel_batch(FanIn.of(self.app), parse_batch_id(self.batch_id), proceed=proceed)
        return self.batch_status()

    def rerun(self, step: str | None = None, requested_by: str | None = None) -> reruns.Rerun:
        """Run this batch's failed or revoked successor again, once its bug is fixed, as `celery -A proj fanin
        rerun` does: under a new task id and the next run number, recorded (who, when, what it replaced).
        `get()` then waits for the rerun. Raises `SuccessorNotRerunnable` if it succeeded or has not finished."""
        return reruns.rerun(FanIn.of(self.app), parse_batch_id(self.batch_id), step=step, requested_by=requested_by)

    def seal(self) -> BatchStatus:
        """Seal an open (streaming) batch now, as `celery -A proj fanin seal` does: it takes no more children and
        finishes when the ones it has do. Raises `BatchNotOpen` if it is not open."""
        actions.seal_batch(FanIn.of(self.app), parse_batch_id(self.batch_id))
        return self.batch_status()

    def next_stage(self) -> FanInResult | None:
        """The batch a `then=fan_in_group(...)` pipeline stage started when this one finished, if any."""
        status = self.batch_status()
        fanin = FanIn.of(self.app)
        with fanin.engine.connect() as conn:
            found = batches.find_by_key(conn, self.app.main or "", f"then:{self.batch_id}:{status.step}")
        return FanInResult(self.app, str(found[0])) if found else None

    def final(self, timeout: float | None = None) -> Any:
        """The last stage's result: follows a pipeline from this first handle to its end (within `timeout`)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        handle: FanInResult = self
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            status = handle.wait_batch(left)
            if status.successor_name != RUN_GROUP_TASK:
                value, _ = handle._outcome(status)
                return value
            following = handle.next_stage()
            if following is None:
                raise CeleryTimeoutError(f"pipeline stage {handle.batch_id} finished but started no next stage")
            handle = following

    def successor(self) -> AsyncResult:
        """The successor's Celery result (needs a result backend; the store has its state without one)."""
        return self.app.AsyncResult(self.successor_task_id)


class _State(str):
    """A Celery state name (`FanInResult.status`) that, called, is the batch's status with a DeprecationWarning:
    `handle.status()` meant that before `status` became Celery's alias of `state`."""

    _batch_status: Callable[[], BatchStatus]

    def __new__(cls, value: str, batch_status: Callable[[], BatchStatus]) -> _State:
        self = super().__new__(cls, value)
        self._batch_status = batch_status
        return self

    def __call__(self) -> BatchStatus:
        warnings.warn(
            "FanInResult.status is Celery's state now; call batch_status() for the batch's status",
            DeprecationWarning,
            stacklevel=2,
        )
        return self._batch_status()


class FanInChildren:
    """A fan-in's children as a chord's header `GroupResult` offers them (`FanInResult.parent`), read from the
    store: no result backend needed."""

    def __init__(self, app: Celery, batch_id: str, parent: Any = None) -> None:
        self.app = app
        self.id = batch_id
        self.parent = parent  # the result before the fan-in in a chain, as Celery set it; else None

    def __repr__(self) -> str:
        return f"<FanInChildren batch_id={self.id}>"

    def __bool__(self) -> bool:
        # Truth is whether a result comes before the fan-in in a chain, never the store's (`len` reads it): Celery
        # walks parents `while node:`, and sets a result's parent only `if not prev_res.parent` (5.5+), so a
        # handle with no parent yet must read as having none, or a chain's earlier results are never linked.
        return self.parent is not None

    def maybe_throw(self, callback: Any = None, propagate: bool = True) -> None:
        """Nothing: a child's failure does not fail the fan-in (its successor decides), unlike a chord header's."""

    def as_tuple(self) -> Any:
        """What Celery serialises of a chain's results: the results before the fan-in (the children are rows)."""
        return self.parent.as_tuple() if self.parent is not None else None

    def _status(self) -> BatchStatus:
        return read_status(FanIn.of(self.app), self.id)

    def __len__(self) -> int:
        return self._status().planned

    def completed_count(self) -> int:
        """Children that succeeded, as `GroupResult.completed_count()` counts them."""
        return self._status().succeeded

    def finished_count(self) -> int:
        """Children with a terminal outcome, whatever it was (`succeeded + failed`)."""
        status = self._status()
        return status.succeeded + status.failed

    def ready(self) -> bool:
        """Whether every child has its terminal outcome."""
        return self._status().remaining == 0

    def waiting(self) -> bool:
        return not self.ready()

    def successful(self) -> bool:
        """Whether every child succeeded (all of them ended)."""
        status = self._status()
        return status.remaining == 0 and status.failed == 0

    def failed(self) -> bool:
        """Whether a child ended other than in success."""
        return self._status().failed > 0

    def revoke(self, terminate: bool = False, signal: str | None = None) -> list[str]:
        """Revoke every unfinished child, as `GroupResult.revoke` does: a queued copy is discarded and counted
        `revoked`; with `terminate`, a running one is killed (`signal`, default SIGTERM) and counted `revoked` too.
        The batch goes on: its successor runs with them among its failures (`FanInResult.cancel` ends the batch
        instead). Returns the revoked task ids."""
        fanin = FanIn.of(self.app)
        with fanin.engine.connect() as conn:
            task_ids = [row.task_id for row in queries.unfinished_children(conn, parse_batch_id(self.id))]
        for start in range(0, len(task_ids), 1000):
            options: dict[str, Any] = {"terminate": terminate}
            if signal is not None:
                options["signal"] = signal
            self.app.control.revoke(task_ids[start : start + 1000], **options)
        return task_ids

    def forget(self) -> None:
        """Forget the results before the fan-in in a chain (Celery's `forget` goes up the parents); the children's
        own results are the batch's rows (`fanin prune` deletes them)."""
        if self.parent is not None:
            self.parent.forget()


def _restore_handle(batch_id: str, successor_task_id: str) -> FanInResult:
    return FanInResult(current_app, batch_id, successor_task_id)


_CELERY_STATES: dict[str, str] = {
    SuccessorState.PENDING: states.PENDING,
    SuccessorState.SENT: states.PENDING,
    SuccessorState.REQUEUED: states.PENDING,
    SuccessorState.RUNNING: states.STARTED,
    SuccessorState.REPLACED: states.STARTED,
    SuccessorState.RETRYING: states.RETRY,
    SuccessorState.SUCCEEDED: states.SUCCESS,
    SuccessorState.FAILED: states.FAILURE,
    SuccessorState.REVOKED: states.REVOKED,
    SuccessorState.IGNORED: states.IGNORED,
}


def rebuilt_exception(exc_type: str | None, exc_message: str | None) -> BaseException:
    """A successor's (or a child's) error as the store has it (its type's name and its text), as the caller can
    catch it: a built-in exception type is itself; any other is the one exception class of that name loaded in this
    process (the producer imports the tasks that raise it, so `except MyError:` around `get()` works, as it does
    with a result backend); with none, or several of that name, one is made by name, as Celery's result backends
    make one they cannot import."""
    name = exc_type or "Exception"
    if name == ChordHeaderFailed.__name__:  # the library's own: a chord's body that did not run
        return ChordHeaderFailed(exc_message or "")
    cls = getattr(builtins, name, None)
    if not (isinstance(cls, type) and issubclass(cls, Exception)):
        cls = _loaded_exception(name) or create_exception_cls(name, "celery_fanin.remote")
    try:
        return cls(exc_message or "")
    except Exception:  # noqa: BLE001 - a class whose constructor wants more: a stand-in of its name
        return create_exception_cls(name, "celery_fanin.remote")(exc_message or "")


def _loaded_exception(name: str) -> type[Exception] | None:
    """The one subclass of Exception named `name` among the classes loaded now, or None (none, or ambiguous)."""
    found: set[type[Exception]] = set()
    stack: list[type[Exception]] = [Exception]
    while stack:
        cls = stack.pop()
        for sub in cls.__subclasses__():
            if sub.__name__ == name and not sub.__module__.startswith("celery_fanin.remote"):
                found.add(sub)
            stack.append(sub)
    return found.pop() if len(found) == 1 else None


class EagerFanInResult(FanInResult):
    """The handle of a fan-in run eagerly: its successor has run (or the batch is still open, see the module)."""

    def __init__(self, app: Celery, batch_id: str, successor_result: EagerResult | None = None) -> None:
        super().__init__(app, batch_id)
        self.successor_result = successor_result

    def successor(self) -> Any:
        """The successor's `EagerResult` (its return value is `.result`), if it ran in this process."""
        if self.successor_result is not None:
            return self.successor_result
        return super().successor()
