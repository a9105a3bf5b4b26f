"""Moving a saga on: each step's batch created once, settled when it finishes, and the rollback stage by stage.

Every move is made under the saga's row lock and only from the state it expects, and every batch is created
under a key, so each internal task, `kick` and the CLI can all be repeated or race: the saga moves once.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

from celery import Celery
from celery._state import _task_stack
from celery.canvas import Signature
from sqlalchemy import Connection
from sqlalchemy.exc import SQLAlchemyError

from ..codec import decode_signature, encode_signature
from ..context import FanIn
from ..exceptions import FanInDatabaseError, FanInDepthExceeded, InvalidFanIn, SagaNotFound, SagaStateError, summarise
from ..producer.group import FanInGroup
from ..producer.result import FanInResult
from ..protocol import (
    BATCH_ACTIVE,
    COMPENSATION_DONE_TASK,
    HEADER_UNDO,
    HEADER_UNDO_OF,
    SAGA_STEP_DONE_TASK,
    ChildState,
    CompensationState,
    OnLost,
    SagaState,
    SagaStepState,
)
from ..store import batches, queries
from ..store import sagas as store
from .status import SagaStatus, parse_saga_id, read_status

logger = logging.getLogger("celery_fanin.sagas")

# Compensation task ids are derived from the original's identity and the attempt, in this namespace.
_TASK_ID_NAMESPACE = uuid.UUID("5d0a8c4e-7f1b-4e57-9a43-6b2f0c1d9e8a")


def undo_of_signature(sig: Signature) -> dict[str, Any] | None:
    """The undo a child was given with `compensated`, as a signature dict (None if it has none)."""
    headers = sig.options.get("headers") or {}
    undo = headers.get(HEADER_UNDO) if isinstance(headers, dict) else None
    return dict(undo) if isinstance(undo, dict) else None


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
            undo = undo_of_signature(decode_signature(app, child.message))
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
        if row.state == SagaState.RUNNING:
            moved = _drive_step(fanin, row)
        elif row.state == SagaState.COMPENSATING:
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
        sig = decode_signature(app, step.definition)
        then = app.signature(SAGA_STEP_DONE_TASK, args=(str(row.id), position))
        group = FanInGroup([sig], then=then, app=app, key=f"saga:{row.id}:step:{position}")
        try:
            with _detached():
                handle = group.apply_async()
        except (InvalidFanIn, FanInDepthExceeded) as exc:  # a step that cannot start has failed for good
            return settle_step(fanin, row.id, position, error=exc)
        batch_id = uuid.UUID(handle.batch_id)
        with fanin.engine.begin() as conn:
            store.start_step(conn, row.id, position, batch_id)
        logger.info(
            "saga_id=%s step %d started: batch_id=%s",
            row.id,
            position,
            batch_id,
            extra={"saga_id": str(row.id), "batch_id": str(batch_id)},
        )
    with fanin.engine.connect() as conn:
        state = store.batch_state(conn, batch_id)
    if state is None or state in BATCH_ACTIVE:
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
        if row is None or row.state != SagaState.RUNNING or row.current_step != position:
            return False
        steps = store.get_steps(conn, saga_id)
        step = steps[position - 1]
        if error is not None:
            exc_type, exc_message = type(error).__name__, str(error)
        else:
            if step.batch_id is None:
                return False
            state = store.batch_state(conn, step.batch_id)
            if state is None or state in BATCH_ACTIVE:
                return False
            child = store.first_child(conn, step.batch_id)
            unit = _unit_of(conn, step)
            rejected = (
                step.kind == "group"
                and unit is not None
                and batches.find_by_key(conn, row.app_name, compensation_key(str(unit), 1)) is not None
            )
            if child is not None and child.state == ChildState.SUCCEEDED and not rejected:
                store.finish_step(conn, saga_id, position, SagaStepState.SUCCEEDED)
                if position == row.steps:
                    store.set_state(conn, saga_id, SagaState.SUCCEEDED, finished=True)
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
        store.finish_step(conn, saga_id, position, SagaStepState.FAILED, exc_type, exc_message)
        plan = _plan(app, conn, row, steps, position)
        store.start_rollback(conn, saga_id, position, exc_type, exc_message, plan)
    logger.warning(
        "saga_id=%s step %d failed for good (%s: %s): %d compensations planned",
        saga_id,
        position,
        exc_type,
        exc_message,
        len(plan),
        extra={"saga_id": str(saga_id)},
    )
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
                plan.append(
                    store.NewCompensation(
                        f"manual:{position}", position, stage, 0, "manual", manual_text=step.manual_text
                    )
                )
                stage += 1
            continue
        unit = _unit_of(conn, step)
        if unit is None:
            continue
        if position < failed and step.undo is not None:
            batch = queries.batch(conn, unit)
            if batch is not None:
                undo_of = batch.successor_task_id
                sig = undo_signature(app, dict(decode_signature(app, step.undo)), undo_of, 1)
                plan.append(_compensation(app, undo_of, position, stage, 0, "step", f"{unit}:then", sig))
                stage += 1
        children = unit_children(app, conn, unit)
        for ordinal, (undo_of, undo) in enumerate(children):
            sig = undo_signature(app, undo, undo_of, 1)
            plan.append(_compensation(app, undo_of, position, stage, ordinal, "child", str(unit), sig))
        if children:
            stage += 1
    return plan


def _compensation(
    app: Celery, undo_of: str, position: int, stage: int, ordinal: int, kind: str, unit: str, sig: Signature
) -> store.NewCompensation:
    return store.NewCompensation(
        undo_of,
        position,
        stage,
        ordinal,
        kind,
        unit,
        sig.task,
        encode_signature(app, sig),
        task_id=sig.options["task_id"],
    )


def _drive_stage(fanin: FanIn, row: store.SagaRow) -> bool:
    """Run the current stage of the rollback: ask for its manual actions, create its compensation batch (once:
    keyed by its unit and attempt), settle it if it has finished; or finish the rollback after the last stage."""
    stage = row.current_stage
    with fanin.engine.begin() as conn:
        locked = store.get_saga(conn, row.id, lock=True)
        if locked is None or (locked.state, locked.current_stage) != (SagaState.COMPENSATING, stage):
            return False
        comps = store.get_compensations(conn, row.id, stage)
        if not comps:
            pending = store.manual_pending(conn, row.id)
            store.set_state(
                conn, row.id, SagaState.MANUAL_ACTION_REQUIRED if pending else SagaState.COMPENSATED, finished=True
            )
            logger.info(
                "saga_id=%s rolled back%s",
                row.id,
                f"; {pending} manual actions required" if pending else "",
                extra={"saga_id": str(row.id)},
            )
            return True
        asked = store.request_manual(conn, row.id, stage)
        if asked:
            store.set_step_states(conn, row.id, asked, SagaStepState.MANUAL_ACTION_REQUIRED, [SagaStepState.SUCCEEDED])
            for comp in comps:
                if comp.kind == "manual" and comp.position in asked:
                    logger.warning(
                        "saga_id=%s step %d needs a manual action: %s",
                        row.id,
                        comp.position,
                        comp.manual_text,
                        extra={"saga_id": str(row.id)},
                    )
        todo = [c for c in comps if c.kind != "manual" and c.state != CompensationState.SUCCEEDED]
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
            store.set_step_states(
                conn,
                row.id,
                {c.position for c in todo if c.position != row.failed_step},
                SagaStepState.COMPENSATING,
                [SagaStepState.SUCCEEDED, SagaStepState.COMPENSATION_FAILED],
            )
    assert batch_id is not None
    with fanin.engine.connect() as conn:
        state = store.batch_state(conn, batch_id)
    if state in BATCH_ACTIVE:
        return False
    return settle_stage(fanin, row.id, stage)


def _create_compensation_batch(fanin: FanIn, row: store.SagaRow, todo: Sequence[store.CompensationRow]) -> uuid.UUID:
    app = fanin.app
    unit = todo[0].unit or ""
    attempt = max(c.attempt for c in todo)
    sigs = [decode_signature(app, c.message) for c in todo if c.message is not None]
    options: dict[str, Any] = {"on_lost": OnLost.REDRIVE, "max_redrives": row.compensation_redrives}
    if row.compensation_timeout is not None:
        options["child_timeout"] = row.compensation_timeout
    key = compensation_key(unit, attempt)
    group = FanInGroup(
        sigs, then=app.signature(COMPENSATION_DONE_TASK), step="compensation", app=app, key=key, **options
    )
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
        logger.warning(
            "saga_id=%s: compensation batch %s (key %r) has other children than planned; using it",
            row.id,
            found[0],
            key,
            extra={"saga_id": str(row.id)},
        )
        return found[0]


def settle_stage(fanin: FanIn, saga_id: uuid.UUID, stage: int) -> bool:
    """A stage's compensation batch finished: record each compensation's outcome; move to the next stage, or stop
    the rollback at the first that failed for good. False if not finished yet, or someone else already did."""
    with fanin.engine.begin() as conn:
        row = store.get_saga(conn, saga_id, lock=True)
        if row is None or (row.state, row.current_stage) != (SagaState.COMPENSATING, stage):
            return False
        outcomes = [
            o
            for o in store.stage_outcomes(conn, saga_id, stage)
            if o.state in (CompensationState.PENDING, CompensationState.RUNNING)
        ]
        for batch_id in {o.batch_id for o in outcomes}:
            state = store.batch_state(conn, batch_id) if batch_id is not None else None
            if state is None or state in BATCH_ACTIVE:
                return False
        failed: list[store.StageOutcome] = []
        for o in outcomes:
            if o.child_state == ChildState.SUCCEEDED:
                store.finish_compensation(conn, saga_id, o.undo_of, CompensationState.SUCCEEDED)
            else:
                exc_type = o.exc_type or (o.child_state if o.child_state else "NotRun")
                exc_message = o.exc_message or (
                    "it was not part of the compensation batch" if o.child_state is None else o.child_state
                )
                store.finish_compensation(conn, saga_id, o.undo_of, CompensationState.FAILED, exc_type, exc_message)
                failed.append(o)
        done = {o.position for o in outcomes} - {row.failed_step}
        if failed:
            named = "; ".join(
                f"step {o.position}: {o.task_name} (task {o.task_id}, undoing {o.undo_of}) "
                f"ended {o.child_state or 'not run'}: {o.exc_type or ''}: {o.exc_message or ''}"
                for o in failed
            )
            store.set_state(conn, saga_id, SagaState.COMPENSATION_FAILED, finished=True, failed_compensation=named)
            store.set_step_states(
                conn,
                saga_id,
                {o.position for o in failed} - {row.failed_step},
                SagaStepState.COMPENSATION_FAILED,
                [SagaStepState.COMPENSATING],
            )
            logger.error("saga_id=%s rollback stopped: %s", saga_id, named, extra={"saga_id": str(saga_id)})
            return True
        # A step is compensated once none of its compensations is left to run (it may span two stages).
        remaining = {
            c.position
            for c in store.get_compensations(conn, saga_id)
            if c.kind != "manual" and c.state != CompensationState.SUCCEEDED
        }
        store.set_step_states(
            conn,
            saga_id,
            done - remaining,
            SagaStepState.COMPENSATED,
            [SagaStepState.COMPENSATING, SagaStepState.SUCCEEDED],
        )
        store.set_stage(conn, saga_id, stage + 1)
    return True


def _stop(fanin: FanIn, saga_id: uuid.UUID, stage: int, reason: str) -> bool:
    with fanin.engine.begin() as conn:
        row = store.get_saga(conn, saga_id, lock=True)
        if row is None or (row.state, row.current_stage) != (SagaState.COMPENSATING, stage):
            return False
        store.set_state(conn, saga_id, SagaState.COMPENSATION_FAILED, finished=True, failed_compensation=reason)
    logger.error("saga_id=%s rollback stopped: %s", saga_id, reason, extra={"saga_id": str(saga_id)})
    return True


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
            if row.state == SagaState.COMPENSATION_FAILED:
                retried = set()
                for comp in store.get_compensations(conn, sid, row.current_stage):
                    if comp.kind == "manual" or comp.state == CompensationState.SUCCEEDED or comp.message is None:
                        continue
                    attempt = comp.attempt + 1
                    sig = undo_signature(app, dict(decode_signature(app, comp.message)), comp.undo_of, attempt)
                    store.retry_compensation(
                        conn, sid, comp.undo_of, attempt, sig.options["task_id"], encode_signature(app, sig)
                    )
                    retried.add(comp.position)
                store.set_step_states(
                    conn, sid, retried, SagaStepState.COMPENSATING, [SagaStepState.COMPENSATION_FAILED]
                )
                store.mark_resumed(conn, sid)
            elif row.state not in (SagaState.RUNNING, SagaState.COMPENSATING):
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
                raise SagaStateError(
                    f"step {position} of saga {sid} is not waiting for a manual action (step state: {state})"
                )
            if row.state == SagaState.MANUAL_ACTION_REQUIRED and store.manual_pending(conn, sid) == 0:
                store.set_state(conn, sid, SagaState.COMPENSATED, finished=True)
    except SQLAlchemyError as exc:
        raise FanInDatabaseError(f"could not acknowledge step {step} of saga {sid}: {summarise(exc)}") from exc
    logger.info(
        "saga_id=%s step %s manual action acknowledged by %s",
        sid,
        step,
        by or "an operator",
        extra={"saga_id": str(sid)},
    )
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
    group = FanInGroup(
        sigs,
        then=app.signature(COMPENSATION_DONE_TASK),
        step="compensation",
        app=app,
        key=compensation_key(str(bid), 1),
        on_lost=OnLost.REDRIVE,
    )
    with _detached():
        handle = group.apply_async()
    logger.info(
        "batch_id=%s: %d compensations started (batch %s)",
        bid,
        len(sigs),
        handle.batch_id,
        extra={"batch_id": str(bid)},
    )
    return handle
