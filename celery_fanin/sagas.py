"""Sagas: steps that run one after another on the fan-in machinery, and compensations when one fails for good.

``saga(step, step, ...).apply_async()`` records the saga and its steps in Postgres, then starts step 1. Each
step is a fan-in batch of one child under the key ``saga:<id>:step:<n>`` (so creating it twice creates it once):
a task step's child is the task, a `fan_in_group` step's child is that group, nested (see `nesting`), which
finishes when the group's own successor does. The batch's successor, ``celery_fanin.saga_step_done``, runs once
(the successor guard) and advances the saga: on success it creates the next step's batch; when the step failed
for good (its task failed after its retries, the group's successor failed, or it called `outcome.compensate()`)
it writes the rollback plan in the same transaction that marks the step failed.

The plan lists, in reverse order of the work, one compensation per completed piece of work, keyed by that
work's identity (the original child's task id; the group successor's for `compensated(group, undo)`):

- for each child created with ``compensated(task.s(...), undo.s(...))`` that succeeded, in any step's batch
  (nested groups and wide batches' leaves included), its undo; a plain step's task is such a child;
- for a step given as ``compensated(fan_in_group(...), undo.s(...))`` that completed, the undo of the whole group,
  before its children's;
- for a step given as ``manual(sig, "text")``, a request to an operator (`manual_action_required`), which the
  rollback does not wait for: ``saga ack`` records that it was done.

Compensations run stage by stage (a step's children's undos together, as one fan-in batch keyed
``compensate:<unit>:<attempt>``, whose successor ``celery_fanin.compensation_done`` moves the saga to the next
stage). Each undo task gets a task id derived from the original's identity and the attempt, and the header
``fanin_undo_of`` (``task.request.fanin_undo_of``): the original's task id, the key an idempotent undo records
its effect under, so that running it twice undoes once. A compensation that fails for good stops the rollback
(`compensation_failed`, naming it); ``saga resume`` runs it again, as a new attempt, once the cause is fixed.

Every move is made under the saga's row lock and only from the state it expects, and every batch is created
under a key, so each internal task, `kick` and the CLI can all be repeated or race: the saga moves once.
"""

from __future__ import annotations

import logging
import threading
import uuid
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta
from types import SimpleNamespace
from typing import Any

from celery import Celery, current_app
from celery.canvas import Signature
from kombu.exceptions import EncodeError
from sqlalchemy import Connection
from sqlalchemy.exc import InterfaceError, OperationalError, SQLAlchemyError

from . import nesting, publish
from .canvas import FanInGroup, FanInResult, poll_until_finished
from .exceptions import FanInDatabaseError, FanInDepthExceeded, FanInError, InvalidFanIn, summarise
from .extension import FanIn
from .store import batches, queries
from .store import sagas as store

logger = logging.getLogger("celery_fanin.sagas")

STEP_DONE_TASK = "celery_fanin.saga_step_done"
COMPENSATION_DONE_TASK = "celery_fanin.compensation_done"
# On a child created with `compensated(sig, undo)`: the undo's signature, stored with the child's message.
HEADER_UNDO = "fanin_undo"
# On a compensation task: the task id of the work it undoes (`task.request.fanin_undo_of`), its idempotency key.
HEADER_UNDO_OF = "fanin_undo_of"
# Compensation task ids are derived from the original's identity and the attempt, in this namespace.
_TASK_ID_NAMESPACE = uuid.UUID("5d0a8c4e-7f1b-4e57-9a43-6b2f0c1d9e8a")

# Saga states after which nothing happens without an operator (`wait()` returns on them).
FINAL_STATES = frozenset({"succeeded", "compensated", "compensation_failed", "manual_action_required"})
_OPEN_BATCH_STATES = ("open", "running")
# Database errors worth retrying an internal task for (a restart, a failover), not bugs.
_RETRYABLE = (OperationalError, InterfaceError, FanInDatabaseError)


class InvalidSaga(InvalidFanIn):
    """`saga` was given something it cannot run; raised before anything is written."""


class SagaNotFound(FanInError, LookupError):
    """No saga with that id exists in the store."""


class SagaStateError(FanInError):
    """The saga is not in a state that allows the operation (`resume` of a finished saga, `ack` of a step that
    waits for nothing)."""


# --- building a saga ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Compensated:
    """A `fan_in_group` step with an undo for the whole group (run before its children's own undos)."""

    action: FanInGroup
    undo: Signature


@dataclass(frozen=True)
class Manual:
    """A step nothing can undo mechanically: on rollback, an operator is asked to do `text`."""

    action: Signature | FanInGroup
    text: str


def _plain(value: object, what: str) -> Signature:
    if not isinstance(value, Signature) or type(value) is not Signature:
        kind = type(value).__name__
        raise InvalidSaga(f"{what} must be a plain task signature (task.s(...)), not {kind}")
    return value


def undo_of_signature(sig: Signature) -> dict[str, Any] | None:
    """The undo a child was given with `compensated`, as a signature dict (None if it has none)."""
    headers = sig.options.get("headers") or {}
    undo = headers.get(HEADER_UNDO) if isinstance(headers, dict) else None
    return dict(undo) if isinstance(undo, dict) else None


def compensated(action: Signature | FanInGroup, undo: Signature) -> Any:
    """Pair work with the task that undoes it.

    ``compensated(task.s(...), undo.s(...))`` returns a copy of the task signature carrying its undo (in a
    message header), so it can be a saga step or a child of any `fan_in_group`: the undo runs for it only if it
    succeeded, when a saga rolls back or its batch's successor calls `outcome.compensate()`.
    ``compensated(fan_in_group(...), undo.s(...))`` is a saga step whose undo reverses the group as a whole (its
    children may carry their own).
    """
    undo_sig = _plain(undo, "the undo")
    if undo_of_signature(undo_sig) is not None:
        raise InvalidSaga("the undo itself carries an undo; compensations are not compensated")
    if isinstance(action, FanInGroup):
        return Compensated(action, undo_sig)
    sig = _plain(action, "the compensated work")
    clone = sig.clone()
    clone.options["headers"] = {**(sig.options.get("headers") or {}), HEADER_UNDO: dict(undo_sig)}
    return clone


def manual(action: Signature | FanInGroup, text: str) -> Manual:
    """A saga step that nothing can undo mechanically (an email sent, a transfer to a partner with no reversal):
    if a later step fails, the saga asks an operator to do `text` and records their `saga ack`."""
    if not isinstance(text, str) or not text.strip():
        raise InvalidSaga("manual() needs the text an operator reads to undo the step")
    if isinstance(action, Compensated) or (isinstance(action, Signature) and undo_of_signature(action) is not None):
        raise InvalidSaga("a manual step has no mechanical undo: give it compensated() or manual(), not both")
    if not isinstance(action, FanInGroup):
        _plain(action, "the manual step")
    return Manual(action, text.strip())


class Saga:
    """An ordered list of steps; `apply_async` records it and starts the first."""

    def __init__(
        self,
        steps: Sequence[Any],
        *,
        key: str | None = None,
        app: Celery | None = None,
        compensation_timeout: timedelta | float | None = None,
        compensation_redrives: int = 3,
    ) -> None:
        self.steps = list(steps)
        self.key = key
        self._app = app
        self.compensation_timeout = compensation_timeout
        self.compensation_redrives = compensation_redrives

    @property
    def app(self) -> Celery:
        if self._app is not None:
            return self._app
        for step in self.steps:
            action = step.action if isinstance(step, (Manual, Compensated)) else step
            if isinstance(action, FanInGroup):
                return action.app
            if isinstance(action, Signature) and action._app is not None:
                return action._app
        return current_app

    def _validate(self, app: Celery) -> tuple[list[store.NewStep], timedelta | None]:
        if not self.steps:
            raise InvalidSaga("a saga needs at least one step")
        if self.key is not None and (not isinstance(self.key, str) or not self.key or len(self.key) > 400):
            raise InvalidSaga("key must be a non-empty string of at most 400 characters")
        redrives = self.compensation_redrives
        if not isinstance(redrives, int) or isinstance(redrives, bool) or redrives < 0:
            raise InvalidSaga(f"compensation_redrives must be a whole number >= 0, not {redrives!r}")
        timeout = self.compensation_timeout
        if timeout is not None and not isinstance(timeout, timedelta):
            if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
                raise InvalidSaga(f"compensation_timeout must be a timedelta or seconds > 0, not {timeout!r}")
            timeout = timedelta(seconds=timeout)
        return [self._step(app, position, item) for position, item in enumerate(self.steps, 1)], timeout

    @staticmethod
    def _step(app: Celery, position: int, item: Any) -> store.NewStep:
        what = f"step {position}"
        manual_text = None
        if isinstance(item, Manual):
            manual_text, item = item.text, item.action
        undo = None
        if isinstance(item, Compensated):
            undo, item = item.undo, item.action
        if isinstance(item, FanInGroup):
            try:
                sig = nesting.as_signature(app, item, what)
            except InvalidFanIn as exc:
                raise InvalidSaga(str(exc)) from exc
            then = item.then
            then_name = then.task if isinstance(then, Signature) else "fan_in_group"
            name = f"fan_in_group({len(list(item.children))} children, then={then_name})"
            kind = "group"
        elif isinstance(item, Signature):
            sig = _plain(item, what)
            name, kind = sig.task, "task"
        else:
            raise InvalidSaga(f"{what} must be a task signature, a fan_in_group, compensated(...) or manual(...), "
                              f"not {type(item).__name__}")  # fmt: skip
        try:
            definition = publish.encode_signature(app, sig)
            encoded_undo = publish.encode_signature(app, undo) if undo is not None else None
        except EncodeError as exc:
            raise InvalidSaga(f"{what}: its arguments cannot be encoded with the app's serializer: {exc}") from exc
        return store.NewStep(position, kind, name, definition, manual_text, encoded_undo)

    def apply_async(self) -> SagaResult:
        """Record the saga and its steps in one transaction, then start step 1; returns at once with the handle.

        With `key`, a second call returns the existing saga (and starts whatever it was waiting to start).
        """
        app = self.app
        fanin = FanIn.of(app)
        steps, timeout = self._validate(app)
        new = store.NewSaga(uuid.uuid4(), app.main or "", self.key, len(steps), timeout, self.compensation_redrives)
        try:
            with fanin.engine.begin() as conn:
                saga_id = new.id if store.create_saga(conn, new, steps) else None
                if saga_id is None:
                    found = store.find_saga(conn, new.app_name, self.key or "")
                    row = store.get_saga(conn, found) if found else None
                    if row is None:
                        raise FanInDatabaseError(f"the saga holding key {self.key!r} disappeared; try again")
                    if row.steps != len(steps):
                        raise InvalidSaga(f"key {self.key!r} is taken by saga {row.id} with {row.steps} steps, "
                                          f"not {len(steps)}; use another key")  # fmt: skip
                    saga_id = row.id
        except SQLAlchemyError as exc:
            raise FanInDatabaseError(f"could not record the saga; nothing was started: {summarise(exc)}") from exc
        if saga_id == new.id:
            logger.info("created saga_id=%s steps=%d", saga_id, len(steps), extra={"saga_id": str(saga_id)})
        try:
            kick(fanin, saga_id)
        except Exception:
            logger.warning("saga_id=%s is recorded but could not be started; `celery -A %s fanin saga resume %s` "
                           "starts it", saga_id, app.main, saga_id, exc_info=True)  # fmt: skip
        return SagaResult(app, str(saga_id))

    __call__ = apply_async


def saga(
    *steps: Any,
    key: str | None = None,
    app: Celery | None = None,
    compensation_timeout: timedelta | float | None = None,
    compensation_redrives: int = 3,
) -> Saga:
    """Run `steps` one after another; if one fails for good, undo the completed ones in reverse order.

    Each step is a task signature or a `fan_in_group`, optionally wrapped in `compensated(step, undo)` or
    `manual(step, "text")`; children of a group step may be `compensated(...)` too. `key` makes creation
    idempotent (per app). A compensation whose task has not finished `compensation_timeout` after it started
    (default: `fanin_child_timeout`) is published again, up to `compensation_redrives` times, then counts as
    failed: compensations must be idempotent (key their effect on `task.request.fanin_undo_of`).
    """
    return Saga(steps, key=key, app=app, compensation_timeout=compensation_timeout,
                compensation_redrives=compensation_redrives)  # fmt: skip


# --- status ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepStatus:
    position: int
    name: str
    kind: str
    state: str
    manual_text: str | None
    batch_id: str | None
    exc_type: str | None
    exc_message: str | None


@dataclass(frozen=True)
class CompensationStatus:
    position: int
    stage: int
    kind: str  # child | step | manual
    undo_of: str
    task_name: str | None
    task_id: str | None
    state: str
    attempt: int
    batch_id: str | None
    exc_type: str | None
    exc_message: str | None
    manual_text: str | None
    acked_at: datetime | None
    acked_by: str | None


@dataclass(frozen=True)
class SagaStatus:
    saga_id: str
    state: str
    current_step: int
    failed_step: int | None
    exc_type: str | None
    exc_message: str | None
    failed_compensation: str | None
    resumes: int
    created_at: datetime
    finished_at: datetime | None
    steps: list[StepStatus] = field(default_factory=list)
    compensations: list[CompensationStatus] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        """True once nothing more happens without an operator (succeeded, rolled back, or stopped)."""
        return self.state in FINAL_STATES

    def step(self, position: int) -> StepStatus:
        return self.steps[position - 1]

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for key in ("created_at", "finished_at"):
            data[key] = data[key].isoformat() if data[key] else None
        for comp in data["compensations"]:
            comp["acked_at"] = comp["acked_at"].isoformat() if comp["acked_at"] else None
        return data


def read_status(fanin: FanIn, saga_id: str | uuid.UUID) -> SagaStatus:
    sid = parse_saga_id(saga_id)
    try:
        with fanin.engine.connect() as conn:
            row = store.get_saga(conn, sid)
            if row is None:
                raise SagaNotFound(f"no saga with id {sid}")
            steps = store.get_steps(conn, sid)
            comps = store.get_compensations(conn, sid)
    except SQLAlchemyError as exc:
        raise FanInDatabaseError(f"could not read saga {sid}: {summarise(exc)}") from exc
    return SagaStatus(
        saga_id=str(row.id), state=row.state, current_step=row.current_step, failed_step=row.failed_step,
        exc_type=row.exc_type, exc_message=row.exc_message, failed_compensation=row.failed_compensation,
        resumes=row.resumes, created_at=row.created_at, finished_at=row.finished_at,
        steps=[StepStatus(s.position, s.name, s.kind, s.state, s.manual_text, str(s.batch_id) if s.batch_id else None,
                          s.exc_type, s.exc_message) for s in steps],
        compensations=[CompensationStatus(c.position, c.stage, c.kind, c.undo_of, c.task_name, c.task_id, c.state,
                                          c.attempt, str(c.batch_id) if c.batch_id else None, c.exc_type,
                                          c.exc_message, c.manual_text, c.acked_at, c.acked_by) for c in comps],
    )  # fmt: skip


def parse_saga_id(saga_id: str | uuid.UUID) -> uuid.UUID:
    if isinstance(saga_id, uuid.UUID):
        return saga_id
    try:
        return uuid.UUID(str(saga_id))
    except ValueError:
        raise SagaNotFound(f"{saga_id!r} is not a saga id (saga ids are UUIDs)") from None


class SagaResult:
    """The handle `apply_async` returns; every call reads the store. `SagaResult(app, saga_id)` rebuilds one."""

    def __init__(self, app: Celery, saga_id: str) -> None:
        self.app = app
        self.saga_id = str(parse_saga_id(saga_id))

    @property
    def id(self) -> str:
        return self.saga_id

    def __repr__(self) -> str:
        return f"<SagaResult saga_id={self.saga_id}>"

    def status(self) -> SagaStatus:
        return read_status(FanIn.of(self.app), self.saga_id)

    def wait(self, timeout: float | None = None, interval: float = 0.2) -> SagaStatus:
        """Block until the saga succeeded, was rolled back, or stopped for an operator; returns that status.

        Raises `celery.exceptions.TimeoutError` after `timeout` seconds. Database errors are retried until then.
        """
        return poll_until_finished(
            self.status,
            lambda st: st.finished,
            timeout,
            interval,
            lambda st: f"saga {self.saga_id} not finished after {timeout}s: state={st.state}",
        )


# --- moving a saga on --------------------------------------------------------------------------------------------


class _NotATask:
    """Stands on Celery's task stack while a saga creates a batch from inside one of its own tasks.

    A fan-in created inside a fan-in child or successor is one level deeper than its batch (`fanin_max_depth`
    bounds runaway recursion); a saga's steps and compensations are created from the previous step's successor,
    so without this a saga of ten steps would be ten levels deep. A saga's length is fixed when it is created, so
    its batches start at depth 0. `called_directly` makes Celery's own lookups skip this entry.
    """

    request = SimpleNamespace(called_directly=True)


_NOT_A_TASK = _NotATask()


@contextmanager
def _detached() -> Iterator[None]:
    from celery._state import _task_stack

    _task_stack.push(_NOT_A_TASK)
    try:
        yield
    finally:
        _task_stack.pop()


def compensation_key(unit: str, attempt: int) -> str:
    return f"compensate:{unit}:{attempt}"


def compensation_task_id(undo_of: str, attempt: int) -> str:
    """Derived, not random: every path that generates this compensation generates the same task."""
    return str(uuid.uuid5(_TASK_ID_NAMESPACE, f"{undo_of}:{attempt}"))


def undo_signature(app: Celery, undo: dict[str, Any], undo_of: str, attempt: int) -> Signature:
    """The compensation task for `undo_of`: the undo as given, with its derived task id and `fanin_undo_of`."""
    data = dict(undo)
    options = dict(data.get("options") or {})
    options["task_id"] = compensation_task_id(undo_of, attempt)
    options["headers"] = {**(options.get("headers") or {}), HEADER_UNDO_OF: undo_of}
    data["options"] = options
    return app.signature(data)


def unit_children(app: Celery, conn: Connection, batch_id: uuid.UUID) -> list[tuple[str, dict[str, Any]]]:
    """(original task id, undo) for every child of the batch, its leaves and nested batches, that succeeded and
    carries an undo; latest first. The same list whoever asks, so a compensation batch built from it has the same
    children (and key) whether the saga or `outcome.compensate()` creates it."""
    found: list[tuple[str, dict[str, Any]]] = []
    frontier, seen = [batch_id], {batch_id}
    marker = HEADER_UNDO.encode()
    while frontier:
        level = list(frontier)
        for b in frontier:
            level.extend(store.leaves(conn, b))
        for child in store.succeeded_children_marked(conn, level, marker):
            undo = undo_of_signature(publish.decode_signature(app, child.message))
            if undo is not None:
                found.append((child.task_id, undo))
        frontier = [n for n in store.nested_batches(conn, level) if n not in seen]
        seen.update(frontier)
    found.reverse()
    return found


def kick(fanin: FanIn, saga_id: uuid.UUID) -> None:
    """Make sure whatever the saga waits for exists, and settle what has finished; safe to repeat from anywhere.

    Bounded: each pass either moves the saga on or returns.
    """
    previous: tuple[Any, ...] | None = None
    for _ in range(10_000):
        with fanin.engine.connect() as conn:
            row = store.get_saga(conn, saga_id)
        if row is None:
            raise SagaNotFound(f"no saga with id {saga_id}")
        mark = (row.state, row.current_step, row.current_stage, row.resumes)
        if mark == previous:
            return
        previous = mark
        if row.state == "running":
            moved = _drive_step(fanin, row)
        elif row.state == "compensating":
            moved = _drive_stage(fanin, row)
        else:
            return
        if not moved:
            return


def _drive_step(fanin: FanIn, row: store.SagaRow) -> bool:
    """Create the current step's batch (once: its key is the step's) and settle it if it has finished."""
    app = fanin.app
    position = row.current_step
    with fanin.engine.connect() as conn:
        step = store.get_steps(conn, row.id)[position - 1]
    batch_id = step.batch_id
    if batch_id is None:
        sig = publish.decode_signature(app, step.definition)
        then = app.signature(STEP_DONE_TASK, args=(str(row.id), position))
        group = FanInGroup([sig], then=then, app=app, key=f"saga:{row.id}:step:{position}")
        try:
            with _detached():
                handle = group.apply_async()
        except (InvalidFanIn, FanInDepthExceeded) as exc:  # a step that cannot start has failed for good
            return settle_step(fanin, row.id, position, error=exc)
        batch_id = uuid.UUID(handle.batch_id)
        with fanin.engine.begin() as conn:
            store.start_step(conn, row.id, position, batch_id)
        logger.info("saga_id=%s step %d started: batch_id=%s", row.id, position, batch_id,
                    extra={"saga_id": str(row.id), "batch_id": str(batch_id)})  # fmt: skip
    with fanin.engine.connect() as conn:
        state = store.batch_state(conn, batch_id)
    if state is None or state in _OPEN_BATCH_STATES:
        return False
    return settle_step(fanin, row.id, position)


def _unit_of(conn: Connection, step: store.StepRow) -> uuid.UUID | None:
    """The batch whose children are this step's work: the step's batch, or for a group step the group's own."""
    if step.batch_id is None:
        return None
    if step.kind == "task":
        return step.batch_id
    child = store.first_child(conn, step.batch_id)
    return store.nested_batch(conn, child.task_id) if child is not None else None


def settle_step(fanin: FanIn, saga_id: uuid.UUID, position: int, *, error: BaseException | None = None) -> bool:
    """The step's batch finished (or the step could not start: `error`): advance, or fail it and write the
    rollback plan, in one transaction under the saga's lock. False if someone else already did."""
    app = fanin.app
    with fanin.engine.begin() as conn:
        row = store.get_saga(conn, saga_id, lock=True)
        if row is None or row.state != "running" or row.current_step != position:
            return False
        steps = store.get_steps(conn, saga_id)
        step = steps[position - 1]
        if error is not None:
            exc_type, exc_message = type(error).__name__, str(error)
        else:
            if step.batch_id is None:
                return False
            state = store.batch_state(conn, step.batch_id)
            if state is None or state in _OPEN_BATCH_STATES:
                return False
            child = store.first_child(conn, step.batch_id)
            unit = _unit_of(conn, step)
            rejected = (
                step.kind == "group" and unit is not None
                and batches.find_by_key(conn, row.app_name, compensation_key(str(unit), 1)) is not None
            )  # fmt: skip
            if child is not None and child.state == "succeeded" and not rejected:
                store.finish_step(conn, saga_id, position, "succeeded")
                if position == row.steps:
                    store.set_state(conn, saga_id, "succeeded", finished=True)
                else:
                    store.advance(conn, saga_id, position + 1)
                logger.info("saga_id=%s step %d succeeded", saga_id, position, extra={"saga_id": str(saga_id)})
                return True
            if rejected:
                exc_type, exc_message = "CompensationRequested", "the group's successor called outcome.compensate()"
            elif child is None:
                exc_type, exc_message = "StepLost", "the step's batch has no child"
            else:
                exc_type, exc_message = child.exc_type or child.state, child.exc_message or child.state
        store.finish_step(conn, saga_id, position, "failed", exc_type, exc_message)
        plan = _plan(app, conn, row, steps, position)
        store.start_rollback(conn, saga_id, position, exc_type, exc_message, plan)
    logger.warning("saga_id=%s step %d failed for good (%s: %s): %d compensations planned", saga_id, position,
                   exc_type, exc_message, len(plan), extra={"saga_id": str(saga_id)})  # fmt: skip
    return True


def _plan(
    app: Celery, conn: Connection, row: store.SagaRow, steps: Sequence[store.StepRow], failed: int
) -> list[store.NewCompensation]:
    """The compensations of everything completed before (and within) the failed step, latest first, one stage
    per unit of work: a group's own undo, then its children's undos (together), step by step backwards."""
    plan: list[store.NewCompensation] = []
    stage = 0
    for position in range(failed, 0, -1):
        step = steps[position - 1]
        if step.manual_text is not None:
            if position < failed:  # the failed step did nothing to undo
                plan.append(store.NewCompensation(f"manual:{position}", position, stage, 0, "manual",
                                                  manual_text=step.manual_text))  # fmt: skip
                stage += 1
            continue
        unit = _unit_of(conn, step)
        if unit is None:
            continue
        if position < failed and step.undo is not None:
            batch = queries.batch(conn, unit)
            if batch is not None:
                undo_of = batch.successor_task_id
                sig = undo_signature(app, dict(publish.decode_signature(app, step.undo)), undo_of, 1)
                plan.append(_compensation(app, undo_of, position, stage, 0, "step", f"{unit}:then", sig))
                stage += 1
        children = unit_children(app, conn, unit)
        for ordinal, (undo_of, undo) in enumerate(children):
            sig = undo_signature(app, undo, undo_of, 1)
            plan.append(_compensation(app, undo_of, position, stage, ordinal, "child", str(unit), sig))
        if children:
            stage += 1
    return plan


def _compensation(app: Celery, undo_of: str, position: int, stage: int, ordinal: int, kind: str, unit: str,
                  sig: Signature) -> store.NewCompensation:  # fmt: skip
    return store.NewCompensation(undo_of, position, stage, ordinal, kind, unit, sig.task,
                                 publish.encode_signature(app, sig), task_id=sig.options["task_id"])  # fmt: skip


def _drive_stage(fanin: FanIn, row: store.SagaRow) -> bool:
    """Run the current stage of the rollback: ask for its manual actions, create its compensation batch (once:
    keyed by its unit and attempt), settle it if it has finished; or finish the rollback after the last stage."""
    stage = row.current_stage
    with fanin.engine.begin() as conn:
        locked = store.get_saga(conn, row.id, lock=True)
        if locked is None or (locked.state, locked.current_stage) != ("compensating", stage):
            return False
        comps = store.get_compensations(conn, row.id, stage)
        if not comps:
            pending = store.manual_pending(conn, row.id)
            store.set_state(conn, row.id, "manual_action_required" if pending else "compensated", finished=True)
            logger.info("saga_id=%s rolled back%s", row.id, f"; {pending} manual actions required" if pending else "",
                        extra={"saga_id": str(row.id)})  # fmt: skip
            return True
        asked = store.request_manual(conn, row.id, stage)
        if asked:
            store.set_step_states(conn, row.id, asked, "manual_action_required", ["succeeded"])
            for comp in comps:
                if comp.kind == "manual" and comp.position in asked:
                    logger.warning("saga_id=%s step %d needs a manual action: %s", row.id, comp.position,
                                   comp.manual_text, extra={"saga_id": str(row.id)})  # fmt: skip
        todo = [c for c in comps if c.kind != "manual" and c.state != "succeeded"]
        if not todo:
            store.set_stage(conn, row.id, stage + 1)
            return True
    if all(c.batch_id is not None for c in todo) and len({c.batch_id for c in todo}) == 1:
        batch_id = todo[0].batch_id
    else:
        try:
            batch_id = _create_compensation_batch(fanin, row, todo)
        except (InvalidFanIn, FanInDepthExceeded) as exc:
            return _stop(fanin, row.id, stage, f"stage {stage} could not be started: {exc}")
        with fanin.engine.begin() as conn:
            store.set_stage_batch(conn, row.id, [c.undo_of for c in todo], batch_id)
            store.set_step_states(conn, row.id, {c.position for c in todo if c.position != row.failed_step},
                                  "compensating", ["succeeded", "compensation_failed"])  # fmt: skip
    assert batch_id is not None
    with fanin.engine.connect() as conn:
        state = store.batch_state(conn, batch_id)
    if state in _OPEN_BATCH_STATES:
        return False
    return settle_stage(fanin, row.id, stage)


def _create_compensation_batch(fanin: FanIn, row: store.SagaRow, todo: Sequence[store.CompensationRow]) -> uuid.UUID:
    app = fanin.app
    unit = todo[0].unit or ""
    attempt = max(c.attempt for c in todo)
    sigs = [publish.decode_signature(app, c.message) for c in todo if c.message is not None]
    options: dict[str, Any] = {"on_lost": "redrive", "max_redrives": row.compensation_redrives}
    if row.compensation_timeout is not None:
        options["child_timeout"] = row.compensation_timeout
    key = compensation_key(unit, attempt)
    group = FanInGroup(sigs, then=app.signature(COMPENSATION_DONE_TASK), step="compensation", app=app, key=key,
                       **options)  # fmt: skip
    try:
        with _detached():
            return uuid.UUID(group.apply_async().batch_id)
    except InvalidFanIn:
        # `outcome.compensate()` created this unit's batch with other children (some finished after it was
        # called, under a deadline): run that one; settling it reports what it did not include, for `resume`.
        with fanin.engine.connect() as conn:
            found = batches.find_by_key(conn, app.main or "", key)
        if found is None:
            raise
        logger.warning("saga_id=%s: compensation batch %s (key %r) has other children than planned; using it",
                       row.id, found[0], key, extra={"saga_id": str(row.id)})  # fmt: skip
        return found[0]


def settle_stage(fanin: FanIn, saga_id: uuid.UUID, stage: int) -> bool:
    """A stage's compensation batch finished: record each compensation's outcome; move to the next stage, or stop
    the rollback at the first that failed for good. False if not finished yet, or someone else already did."""
    with fanin.engine.begin() as conn:
        row = store.get_saga(conn, saga_id, lock=True)
        if row is None or (row.state, row.current_stage) != ("compensating", stage):
            return False
        outcomes = [o for o in store.stage_outcomes(conn, saga_id, stage) if o.state in ("pending", "running")]
        for batch_id in {o.batch_id for o in outcomes}:
            state = store.batch_state(conn, batch_id) if batch_id is not None else None
            if state is None or state in _OPEN_BATCH_STATES:
                return False
        failed: list[store.StageOutcome] = []
        for o in outcomes:
            if o.child_state == "succeeded":
                store.finish_compensation(conn, saga_id, o.undo_of, "succeeded")
            else:
                exc_type = o.exc_type or (o.child_state if o.child_state else "NotRun")
                exc_message = o.exc_message or ("it was not part of the compensation batch"
                                                if o.child_state is None else o.child_state)  # fmt: skip
                store.finish_compensation(conn, saga_id, o.undo_of, "failed", exc_type, exc_message)
                failed.append(o)
        done = {o.position for o in outcomes} - {row.failed_step}
        if failed:
            named = "; ".join(f"step {o.position}: {o.task_name} (task {o.task_id}, undoing {o.undo_of}) "
                              f"ended {o.child_state or 'not run'}: {o.exc_type or ''}: {o.exc_message or ''}"
                              for o in failed)  # fmt: skip
            store.set_state(conn, saga_id, "compensation_failed", finished=True, failed_compensation=named)
            store.set_step_states(conn, saga_id, {o.position for o in failed} - {row.failed_step},
                                  "compensation_failed", ["compensating"])  # fmt: skip
            logger.error("saga_id=%s rollback stopped: %s", saga_id, named, extra={"saga_id": str(saga_id)})
            return True
        # A step is compensated once none of its compensations is left to run (it may span two stages).
        remaining = {c.position for c in store.get_compensations(conn, saga_id)
                     if c.kind != "manual" and c.state != "succeeded"}  # fmt: skip
        store.set_step_states(conn, saga_id, done - remaining, "compensated", ["compensating", "succeeded"])
        store.set_stage(conn, saga_id, stage + 1)
    return True


def _stop(fanin: FanIn, saga_id: uuid.UUID, stage: int, reason: str) -> bool:
    with fanin.engine.begin() as conn:
        row = store.get_saga(conn, saga_id, lock=True)
        if row is None or (row.state, row.current_stage) != ("compensating", stage):
            return False
        store.set_state(conn, saga_id, "compensation_failed", finished=True, failed_compensation=reason)
    logger.error("saga_id=%s rollback stopped: %s", saga_id, reason, extra={"saga_id": str(saga_id)})
    return True


# --- operators -----------------------------------------------------------------------------------------------------


def resume(fanin: FanIn, saga_id: str | uuid.UUID) -> SagaStatus:
    """Retry a stopped rollback from the compensation that failed (each failed one as a new attempt, with a new
    task id and the same `fanin_undo_of`); on a saga still running or compensating, start whatever it waits for
    (after a producer died before step 1, or an internal task gave up on the database)."""
    sid = parse_saga_id(saga_id)
    app = fanin.app
    try:
        with fanin.engine.begin() as conn:
            row = store.get_saga(conn, sid, lock=True)
            if row is None:
                raise SagaNotFound(f"no saga with id {sid}")
            if row.state == "compensation_failed":
                retried = set()
                for comp in store.get_compensations(conn, sid, row.current_stage):
                    if comp.kind == "manual" or comp.state == "succeeded" or comp.message is None:
                        continue
                    attempt = comp.attempt + 1
                    sig = undo_signature(app, dict(publish.decode_signature(app, comp.message)), comp.undo_of,
                                         attempt)  # fmt: skip
                    store.retry_compensation(conn, sid, comp.undo_of, attempt, sig.options["task_id"],
                                             publish.encode_signature(app, sig))  # fmt: skip
                    retried.add(comp.position)
                store.set_step_states(conn, sid, retried, "compensating", ["compensation_failed"])
                store.mark_resumed(conn, sid)
            elif row.state not in ("running", "compensating"):
                raise SagaStateError(f"saga {sid} is {row.state}: there is nothing to resume")
        kick(fanin, sid)
    except SQLAlchemyError as exc:
        raise FanInDatabaseError(f"could not resume saga {sid}: {summarise(exc)}") from exc
    return read_status(fanin, sid)


def acknowledge(fanin: FanIn, saga_id: str | uuid.UUID, step: str | int, by: str | None = None) -> SagaStatus:
    """Record that an operator did a manual step's undo; the saga is `compensated` once none is left."""
    sid = parse_saga_id(saga_id)
    try:
        with fanin.engine.begin() as conn:
            row = store.get_saga(conn, sid, lock=True)
            if row is None:
                raise SagaNotFound(f"no saga with id {sid}")
            steps = store.get_steps(conn, sid)
            position = _resolve_step(steps, step, sid)
            if not store.acknowledge(conn, sid, position, by):
                state = steps[position - 1].state
                raise SagaStateError(f"step {position} of saga {sid} is not waiting for a manual action "
                                     f"(step state: {state})")  # fmt: skip
            if row.state == "manual_action_required" and store.manual_pending(conn, sid) == 0:
                store.set_state(conn, sid, "compensated", finished=True)
    except SQLAlchemyError as exc:
        raise FanInDatabaseError(f"could not acknowledge step {step} of saga {sid}: {summarise(exc)}") from exc
    logger.info("saga_id=%s step %s manual action acknowledged by %s", sid, step, by or "an operator",
                extra={"saga_id": str(sid)})  # fmt: skip
    return read_status(fanin, sid)


def _resolve_step(steps: Sequence[store.StepRow], step: str | int, saga_id: uuid.UUID) -> int:
    """A step number (1-based), or a step's name if exactly one step has it."""
    text = str(step).strip()
    if text.isdigit():
        position = int(text)
        if 1 <= position <= len(steps):
            return position
        raise SagaStateError(f"saga {saga_id} has steps 1 to {len(steps)}, not {position}")
    named = [s.position for s in steps if s.name == text]
    if len(named) == 1:
        return named[0]
    if not named:
        raise SagaStateError(f"saga {saga_id} has no step named {text!r}")
    raise SagaStateError(f"saga {saga_id} has several steps named {text!r}: give its number ({named})")


# --- outcome.compensate() ------------------------------------------------------------------------------------------


def compensate_batch(app: Celery, batch_id: str | uuid.UUID) -> FanInResult:
    """Start the undos of a batch's succeeded `compensated(...)` children, once however often it is called.

    Keyed `compensate:<batch_id>:1`: a saga rolling back the same step finds (and waits for) this batch rather
    than creating another, and a saga step whose successor called this counts as failed.
    """
    fanin = FanIn.of(app)
    bid = uuid.UUID(str(batch_id))
    try:
        with fanin.engine.connect() as conn:
            children = unit_children(app, conn, bid)
    except SQLAlchemyError as exc:
        raise FanInDatabaseError(f"could not read batch {bid}: {summarise(exc)}") from exc
    sigs = [undo_signature(app, undo, undo_of, 1) for undo_of, undo in children]
    group = FanInGroup(sigs, then=app.signature(COMPENSATION_DONE_TASK), step="compensation", app=app,
                       key=compensation_key(str(bid), 1), on_lost="redrive")  # fmt: skip
    with _detached():
        handle = group.apply_async()
    logger.info("batch_id=%s: %d compensations started (batch %s)", bid, len(sigs), handle.batch_id,
                extra={"batch_id": str(bid)})  # fmt: skip
    return handle


# --- the internal tasks --------------------------------------------------------------------------------------------

_registered: weakref.WeakSet[Celery] = weakref.WeakSet()
_register_lock = threading.Lock()


def register(app: Celery) -> None:
    """Define `celery_fanin.saga_step_done` and `celery_fanin.compensation_done` on the app (once). Lazy, like any
    `@app.task`: it does not finalize the app. Workers that run sagas need it (producers do not)."""
    with _register_lock:
        if app in _registered:
            return
        _registered.add(app)

    @app.task(name=STEP_DONE_TASK, bind=True, shared=False, autoretry_for=_RETRYABLE, retry_backoff=True,
              retry_backoff_max=60, max_retries=20)  # fmt: skip
    def saga_step_done(self: Any, outcome: dict[str, Any], saga_id: str, position: int) -> dict[str, Any]:
        """The successor of every saga step's batch: advance the saga, or start its rollback."""
        fanin = FanIn.of(self.app)
        sid = uuid.UUID(saga_id)
        settle_step(fanin, sid, position)
        kick(fanin, sid)
        return {"saga_id": saga_id, "step": position, "succeeded": outcome.get("succeeded"),
                "failed": outcome.get("failed")}  # fmt: skip

    @app.task(name=COMPENSATION_DONE_TASK, bind=True, shared=False, autoretry_for=_RETRYABLE, retry_backoff=True,
              retry_backoff_max=60, max_retries=20)  # fmt: skip
    def compensation_done(self: Any, outcome: dict[str, Any]) -> dict[str, Any]:
        """The successor of every compensation batch: move each saga waiting on it to its next stage."""
        fanin = FanIn.of(self.app)
        with fanin.engine.connect() as conn:
            waiting = store.waiting_on(conn, uuid.UUID(outcome["batch_id"]))
        for saga_id, stage in waiting:
            settle_stage(fanin, saga_id, stage)
            kick(fanin, saga_id)
        return {"succeeded": outcome.get("succeeded"), "failed": outcome.get("failed"),
                "sagas": [str(s) for s, _ in waiting]}  # fmt: skip
