"""A saga as the store holds it now (`SagaStatus`), and the handle that reads it (`SagaResult`)."""

from __future__ import annotations

import uuid
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

from celery import Celery
from sqlalchemy.exc import SQLAlchemyError

from ..context import FanIn
from ..exceptions import FanInDatabaseError, SagaNotFound, summarise
from ..producer.result import poll_until_finished
from ..protocol import SAGA_FINAL
from ..store import sagas as store


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
        return self.state in SAGA_FINAL

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
