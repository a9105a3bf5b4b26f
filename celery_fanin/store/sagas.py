"""The statements behind sagas: the saga and its steps, the compensations a failure generates, and the reads of
fan-in batches that tell which work completed.

Every transition of a saga happens with its row locked (`get_saga(..., lock=True)`, `SELECT ... FOR UPDATE`), so
the worker that finishes a step, the worker that finishes a compensation stage and an operator's `resume` or `ack`
are serialised: each re-reads the saga under the lock and acts only if it is still in the state it expects. The
compensations' primary key `(saga_id, undo_of)` makes generating them twice create them once.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import Connection

from ..protocol import SagaStepState
from .batches import Encoded
from .statements import q

# The task that stands for a nested fan-in child (celery_fanin.nesting.TASK_NAME; repeated so store/ imports
# nothing above it).
RUN_GROUP_TASK = "celery_fanin.run_group"


@dataclass(frozen=True)
class NewSaga:
    id: uuid.UUID
    app_name: str
    key: str | None
    steps: int
    compensation_timeout: timedelta | None
    compensation_redrives: int


@dataclass(frozen=True)
class NewStep:
    position: int
    kind: str  # task | group
    name: str
    definition: Encoded
    manual_text: str | None = None
    undo: Encoded | None = None


@dataclass(frozen=True)
class NewCompensation:
    undo_of: str
    position: int
    stage: int
    ordinal: int
    kind: str  # child | step | manual
    unit: str | None = None
    task_name: str | None = None
    message: Encoded | None = None
    manual_text: str | None = None
    task_id: str | None = None


@dataclass(frozen=True)
class SagaRow:
    id: uuid.UUID
    app_name: str
    key: str | None
    state: str
    steps: int
    current_step: int
    failed_step: int | None
    exc_type: str | None
    exc_message: str | None
    current_stage: int
    resumes: int
    failed_compensation: str | None
    compensation_timeout: timedelta | None
    compensation_redrives: int
    created_at: datetime
    state_at: datetime
    finished_at: datetime | None


@dataclass(frozen=True)
class StepRow:
    position: int
    kind: str
    name: str
    manual_text: str | None
    definition: Encoded
    undo: Encoded | None
    state: str
    batch_id: uuid.UUID | None
    exc_type: str | None
    exc_message: str | None
    started_at: datetime | None
    finished_at: datetime | None


@dataclass(frozen=True)
class CompensationRow:
    undo_of: str
    position: int
    stage: int
    ordinal: int
    kind: str
    unit: str | None
    task_name: str | None
    message: Encoded | None
    manual_text: str | None
    state: str
    attempt: int
    task_id: str | None
    batch_id: uuid.UUID | None
    exc_type: str | None
    exc_message: str | None
    acked_at: datetime | None
    acked_by: str | None
    finished_at: datetime | None


@dataclass(frozen=True)
class ChildRow:
    """A fan-in child as a compensation scan sees it."""

    task_id: str
    batch_id: uuid.UUID
    idx: int
    task_name: str
    state: str
    exc_type: str | None
    exc_message: str | None
    message: Encoded


@dataclass(frozen=True)
class StageOutcome:
    """One compensation of a stage and how its task ended (child_state None: it was never part of a batch)."""

    undo_of: str
    position: int
    task_id: str | None
    task_name: str | None
    state: str
    batch_id: uuid.UUID | None
    child_state: str | None
    exc_type: str | None
    exc_message: str | None


def _encoded(body: bytes | None, content_type: str | None, content_encoding: str | None) -> Encoded | None:
    if body is None:
        return None
    return Encoded(content_type or "", content_encoding or "", bytes(body))


# --- sagas and steps ---------------------------------------------------------------------------------------------


def create_saga(conn: Connection, saga: NewSaga, steps: Sequence[NewStep]) -> bool:
    """Write the saga and every step in one transaction; False (nothing written) if its key is already taken."""
    row = conn.execute(
        q("create_saga_1").text,
        {
            "id": saga.id,
            "app_name": saga.app_name,
            "key": saga.key,
            "steps": saga.steps,
            "timeout": saga.compensation_timeout,
            "redrives": saga.compensation_redrives,
        },
    ).first()
    if row is None:
        return False
    conn.execute(
        q("create_saga_2").text,
        [
            {
                "saga_id": saga.id,
                "position": s.position,
                "kind": s.kind,
                "name": s.name,
                "manual_text": s.manual_text,
                "definition": s.definition.body,
                "ct": s.definition.content_type,
                "ce": s.definition.content_encoding,
                "undo": s.undo.body if s.undo else None,
                "uct": s.undo.content_type if s.undo else None,
                "uce": s.undo.content_encoding if s.undo else None,
            }
            for s in steps
        ],
    )
    return True


def find_saga(conn: Connection, app_name: str, key: str) -> uuid.UUID | None:
    row = conn.execute(q("find_saga").text, {"a": app_name, "k": key}).first()
    return None if row is None else row[0]


def get_saga(conn: Connection, saga_id: uuid.UUID, *, lock: bool = False) -> SagaRow | None:
    """The saga; with `lock`, its row stays locked until the transaction ends (every transition takes it)."""
    row = conn.execute(q("get_saga_locked" if lock else "get_saga").text, {"id": saga_id}).first()
    return None if row is None else SagaRow(*row)


def get_steps(conn: Connection, saga_id: uuid.UUID) -> list[StepRow]:
    rows = conn.execute(
        q("get_steps").text,
        {"id": saga_id},
    )
    return [
        StepRow(
            r.position,
            r.kind,
            r.name,
            r.manual_text,
            Encoded(r.content_type, r.content_encoding, bytes(r.definition)),
            _encoded(r.undo_message, r.undo_content_type, r.undo_content_encoding),
            r.state,
            r.batch_id,
            r.exc_type,
            r.exc_message,
            r.started_at,
            r.finished_at,
        )
        for r in rows
    ]


def start_step(conn: Connection, saga_id: uuid.UUID, position: int, batch_id: uuid.UUID) -> None:
    """Record the step's batch (the same one, whoever created it: its key is derived from the step)."""
    conn.execute(
        q("start_step").text,
        {"id": saga_id, "p": position, "b": batch_id},
    )


def finish_step(
    conn: Connection,
    saga_id: uuid.UUID,
    position: int,
    state: str,
    exc_type: str | None = None,
    exc_message: str | None = None,
) -> None:
    conn.execute(
        q("finish_step").text,
        {"id": saga_id, "p": position, "state": state, "et": exc_type, "em": exc_message},
    )


def set_step_states(
    conn: Connection, saga_id: uuid.UUID, positions: Iterable[int], state: str, only_from: Sequence[str]
) -> None:
    """Move the given steps to `state`, those still in one of `only_from`."""
    conn.execute(
        q("set_step_states").text,
        {"id": saga_id, "ps": sorted(set(positions)), "state": state, "from": list(only_from)},
    )


def advance(conn: Connection, saga_id: uuid.UUID, next_step: int) -> None:
    conn.execute(
        q("advance").text,
        {"id": saga_id, "n": next_step},
    )


def set_state(
    conn: Connection, saga_id: uuid.UUID, state: str, *, finished: bool, failed_compensation: str | None = None
) -> None:
    conn.execute(
        q("set_state").text,
        {"id": saga_id, "state": state, "finished": finished, "fc": failed_compensation},
    )


def start_rollback(
    conn: Connection,
    saga_id: uuid.UUID,
    failed_step: int,
    exc_type: str | None,
    exc_message: str | None,
    compensations: Sequence[NewCompensation],
) -> None:
    """The step failed for good: write its compensations (once: the primary key is the original's identity) and
    turn the saga to `compensating` from stage 0. Steps after it never ran; completed steps with nothing to undo
    say so."""
    if compensations:
        conn.execute(
            q("start_rollback_1").text,
            [
                {
                    "saga_id": saga_id,
                    "undo_of": c.undo_of,
                    "position": c.position,
                    "stage": c.stage,
                    "ordinal": c.ordinal,
                    "kind": c.kind,
                    "unit": c.unit,
                    "task_name": c.task_name,
                    "message": c.message.body if c.message else None,
                    "ct": c.message.content_type if c.message else None,
                    "ce": c.message.content_encoding if c.message else None,
                    "manual_text": c.manual_text,
                    "task_id": c.task_id,
                }
                for c in compensations
            ],
        )
    conn.execute(
        q("start_rollback_2").text,
        {"id": saga_id, "p": failed_step, "et": exc_type, "em": exc_message},
    )
    conn.execute(
        q("start_rollback_3").text,
        {"id": saga_id, "p": failed_step},
    )
    conn.execute(
        q("start_rollback_4").text,
        {"id": saga_id, "p": failed_step},
    )


# --- compensations -----------------------------------------------------------------------------------------------


def get_compensations(conn: Connection, saga_id: uuid.UUID, stage: int | None = None) -> list[CompensationRow]:
    """A saga's compensations in the order they run (one stage, or all of them)."""
    rows = conn.execute(
        q("get_compensations").text,
        {"id": saga_id, "stage": stage},
    )
    return [
        CompensationRow(
            r.undo_of,
            r.position,
            r.stage,
            r.ordinal,
            r.kind,
            r.unit,
            r.task_name,
            _encoded(r.message, r.content_type, r.content_encoding),
            r.manual_text,
            r.state,
            r.attempt,
            r.task_id,
            r.batch_id,
            r.exc_type,
            r.exc_message,
            r.acked_at,
            r.acked_by,
            r.finished_at,
        )
        for r in rows
    ]


def set_stage(conn: Connection, saga_id: uuid.UUID, stage: int) -> None:
    conn.execute(
        q("set_stage").text,
        {"id": saga_id, "s": stage},
    )


def request_manual(conn: Connection, saga_id: uuid.UUID, stage: int) -> list[int]:
    """The rollback reached these manual steps: ask an operator (it does not wait for them). Returns their
    positions."""
    rows = conn.execute(
        q("request_manual").text,
        {"id": saga_id, "s": stage},
    )
    return [r[0] for r in rows]


def set_stage_batch(conn: Connection, saga_id: uuid.UUID, undo_ofs: Sequence[str], batch_id: uuid.UUID) -> None:
    """Record the compensation batch that runs these compensations' current attempt."""
    conn.execute(
        q("set_stage_batch").text,
        {"id": saga_id, "u": list(undo_ofs), "b": batch_id},
    )


def stage_outcomes(conn: Connection, saga_id: uuid.UUID, stage: int) -> list[StageOutcome]:
    """The automated compensations of a stage, each with the terminal state of its current attempt's task."""
    rows = conn.execute(
        q("stage_outcomes").text,
        {"id": saga_id, "s": stage},
    )
    return [StageOutcome(*r) for r in rows]


def finish_compensation(
    conn: Connection,
    saga_id: uuid.UUID,
    undo_of: str,
    state: str,
    exc_type: str | None = None,
    exc_message: str | None = None,
) -> None:
    conn.execute(
        q("finish_compensation").text,
        {"id": saga_id, "u": undo_of, "state": state, "et": exc_type, "em": exc_message},
    )


def retry_compensation(
    conn: Connection, saga_id: uuid.UUID, undo_of: str, attempt: int, task_id: str, message: Encoded
) -> None:
    """A new attempt of a compensation that did not succeed: its own task id (the undo's identity, the original's,
    is unchanged), no batch yet."""
    conn.execute(
        q("retry_compensation").text,
        {
            "id": saga_id,
            "u": undo_of,
            "a": attempt,
            "t": task_id,
            "m": message.body,
            "ct": message.content_type,
            "ce": message.content_encoding,
        },
    )


def mark_resumed(conn: Connection, saga_id: uuid.UUID) -> None:
    conn.execute(
        q("mark_resumed").text,
        {"id": saga_id},
    )


def waiting_on(conn: Connection, batch_id: uuid.UUID) -> list[tuple[uuid.UUID, int]]:
    """The (saga, stage) pairs whose compensations a compensation batch runs."""
    rows = conn.execute(q("waiting_on").text, {"b": batch_id})
    return [(r[0], r[1]) for r in rows]


def acknowledge(conn: Connection, saga_id: uuid.UUID, position: int, by: str | None) -> bool:
    """An operator did the manual undo of a step; False if no manual action was pending for it."""
    row = conn.execute(
        q("acknowledge").text,
        {"id": saga_id, "p": position, "by": by},
    ).first()
    if row is None:
        return False
    set_step_states(conn, saga_id, [position], SagaStepState.ACKNOWLEDGED, [SagaStepState.MANUAL_ACTION_REQUIRED])
    return True


def manual_pending(conn: Connection, saga_id: uuid.UUID) -> int:
    """Manual actions an operator has been asked for and not yet acknowledged."""
    return int(
        conn.execute(
            q("manual_pending").text,
            {"id": saga_id},
        ).scalar_one()
    )


# --- what completed: reads of the fan-in batches -------------------------------------------------------------------


def batch_state(conn: Connection, batch_id: uuid.UUID) -> str | None:
    return conn.execute(q("sagas_batch_state").text, {"id": batch_id}).scalar_one_or_none()


def first_child(conn: Connection, batch_id: uuid.UUID) -> ChildRow | None:
    """A step batch's one child (a task step's task, or the nested child standing for a group step)."""
    rows = _children(conn, "first_child", {"b": batch_id})
    return rows[0] if rows else None


def nested_batch(conn: Connection, parent_task_id: str) -> uuid.UUID | None:
    """The batch a nested fan-in child created (`celery_fanin.run_group` as a child), if it did."""
    return conn.execute(
        q("nested_batch").text,
        {"t": parent_task_id},
    ).scalar_one_or_none()


def leaves(conn: Connection, batch_id: uuid.UUID) -> list[uuid.UUID]:
    """The leaf batches of a wide batch (a tree of counters)."""
    return list(conn.execute(q("leaves").text, {"b": batch_id}).scalars())


def succeeded_children_marked(conn: Connection, batch_ids: Sequence[uuid.UUID], marker: bytes) -> list[ChildRow]:
    """Children of these batches that succeeded and whose stored message contains `marker` (a cheap filter for the
    ones carrying a compensation; the caller decodes them to be sure), in child order."""
    return _children(conn, "succeeded_children_marked", {"bs": list(batch_ids), "m": marker})


def nested_batches(conn: Connection, batch_ids: Sequence[uuid.UUID]) -> list[uuid.UUID]:
    """The batches nested fan-in children of these batches created, whatever those children ended in (the inner
    children that succeeded did their work even when the inner successor failed)."""
    rows = conn.execute(
        q("nested_batches").text,
        {"bs": list(batch_ids), "run_group": RUN_GROUP_TASK},
    )
    return [r[0] for r in rows]


def _children(conn: Connection, statement: str, params: dict[str, object]) -> list[ChildRow]:
    rows = conn.execute(q(statement).text, params)
    return [
        ChildRow(
            r.task_id,
            r.batch_id,
            r.idx,
            r.task_name,
            r.state,
            r.exc_type,
            r.exc_message,
            Encoded(r.content_type, r.content_encoding, bytes(r.message)),
        )
        for r in rows
    ]
