"""The handle a fan-in returns (`FanInResult`) and the status it reads (`BatchStatus`): every call reads the store."""

from __future__ import annotations

import builtins
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any, TypeVar

from celery import Celery, current_app, states
from celery.exceptions import TaskRevokedError
from celery.exceptions import TimeoutError as CeleryTimeoutError
from celery.result import AsyncResult, EagerResult
from celery.utils.serialization import create_exception_cls
from sqlalchemy.exc import SQLAlchemyError

from ..codec import decode_result
from ..context import FanIn
from ..exceptions import BatchNotFound, FanInDatabaseError, summarise
from ..protocol import BATCH_ENDED_WITHOUT_SUCCESSOR, RUN_GROUP_TASK, SUCCESSOR_FINAL, SuccessorState
from ..relay import maintenance
from ..store import batches, queries


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

    `id` is the successor's task id, and `get`, `ready`, `successful`, `failed` and `state` mean what they mean
    for that task's `AsyncResult`; `batch_id`, `status()`, `wait()` and `result()` are the batch's. A handle
    holds no worker and no connection: every call reads PostgreSQL.
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
            return self.status()
        except BatchNotFound:
            return None

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
        **_: Any,
    ) -> Any:
        """The successor's return value once it has finished (as `AsyncResult.get`), read from the store.

        Raises its error if it failed (with `propagate`; else returns it), `TaskRevokedError` if it was revoked or
        the batch ended with nothing to run, `celery.exceptions.TimeoutError` after `timeout` seconds. A frozen
        handle whose batch does not exist yet waits for it."""
        status = self.wait(timeout, interval)
        fanin = FanIn.of(self.app)
        bid = parse_batch_id(self.batch_id)
        with fanin.engine.connect() as conn:
            succ = queries.successor(conn, bid, status.step)
            encoded = queries.successor_result(conn, bid, status.step)
        if succ is None or succ.state == SuccessorState.REVOKED:
            exc: BaseException = TaskRevokedError(
                f"batch {self.batch_id} ended {status.state}"
                + (" with its successor revoked" if succ is not None else " with no successor run")
            )
        elif succ.state == SuccessorState.FAILED:
            exc = _exception(succ.exc_type, succ.exc_message)
        else:
            return decode_result(self.app, encoded) if encoded is not None else None
        if propagate:
            raise exc
        return exc

    def status(self) -> BatchStatus:
        return read_status(FanIn.of(self.app), self.batch_id)

    def wait(self, timeout: float | None = None, interval: float = 0.1) -> BatchStatus:  # type: ignore[override]
        """Block until the batch has reached its final state; returns that status (`get` returns the value).

        Final: the successor (or `on_failure`/`on_expire`) has finished (succeeded, failed or revoked), or the
        batch ended with nothing to run (`expired` or `cancelled` without `on_expire`; `successor_state` is then
        None). Raises `celery.exceptions.TimeoutError` if it has not within `timeout` seconds. Database errors
        while waiting are retried until then (a restart or failover should not end a wait), and a frozen handle
        whose batch does not exist yet waits for it.
        """
        status = poll_until_finished(
            self._status_or_none,
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

    def result(self, timeout: float | None = None) -> Any:
        """The successor's return value, from the store (no result backend needed); waits for it first.

        None when the batch ended with nothing to run (`expired` or `cancelled` without `on_expire`), and when the
        successor failed: `wait().state` and `successor_state` tell those apart."""
        status = self.wait(timeout)
        fanin = FanIn.of(self.app)
        with fanin.engine.connect() as conn:
            encoded = queries.successor_result(conn, parse_batch_id(self.batch_id), status.step)
        return decode_result(self.app, encoded) if encoded is not None else None

    def cancel(self, proceed: bool = False) -> BatchStatus:
        """End the batch now, as `celery -A proj fanin cancel` does: unfinished children are abandoned and revoked;
        the batch ends `cancelled` (only `on_expire` runs) or, with `proceed`, `partial` with its successor run.
        Raises `BatchNotOpen` if it has already ended."""
        maintenance.cancel_batch(FanIn.of(self.app), parse_batch_id(self.batch_id), proceed=proceed)
        return self.status()

    def seal(self) -> BatchStatus:
        """Seal an open (streaming) batch now, as `celery -A proj fanin seal` does: it takes no more children and
        finishes when the ones it has do. Raises `BatchNotOpen` if it is not open."""
        maintenance.seal_batch(FanIn.of(self.app), parse_batch_id(self.batch_id))
        return self.status()

    def next_stage(self) -> FanInResult | None:
        """The batch a `then=fan_in_group(...)` pipeline stage started when this one finished, if any."""
        status = self.status()
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
            status = handle.wait(left)
            if status.successor_name != RUN_GROUP_TASK:
                return handle.result(left)
            following = handle.next_stage()
            if following is None:
                raise CeleryTimeoutError(f"pipeline stage {handle.batch_id} finished but started no next stage")
            handle = following

    def successor(self) -> AsyncResult:
        """The successor's Celery result (needs a result backend; the store has its state without one)."""
        return self.app.AsyncResult(self.successor_task_id)


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


def _exception(exc_type: str | None, exc_message: str | None) -> BaseException:
    """The successor's error as the store has it (its type's name and its text): a built-in exception type is
    itself, any other is rebuilt by name, as Celery's result backends rebuild an exception they cannot import."""
    name = exc_type or "Exception"
    cls = getattr(builtins, name, None)
    if not (isinstance(cls, type) and issubclass(cls, Exception)):
        cls = create_exception_cls(name, "celery_fanin.remote")
    return cls(exc_message or "")


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
