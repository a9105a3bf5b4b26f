"""`BatchOutcome`: a successor's view of its batch, and the children's results streamed from the store."""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from celery import Celery, current_app

from .codec import decode_result
from .context import FanIn
from .producer.result import FanInResult
from .protocol import BatchState, ChildState
from .sagas.driver import compensate_batch
from .store import queries
from .store.outcomes import failure_entry


@dataclass(frozen=True)
class ChildResult:
    index: int
    task_id: str
    state: str
    value: Any = None

    @property
    def ok(self) -> bool:
        return self.state == ChildState.SUCCEEDED


@dataclass(frozen=True)
class BatchOutcome:
    """A successor's view of its batch: counts, the listed failures, and every child's result on demand."""

    batch_id: str
    step: str
    planned: int
    succeeded: int
    failed: int
    failures: list[dict[str, Any]] = field(default_factory=list)
    failures_truncated: bool = False
    # "count" or "bytes": which of fanin_outcome_failures_limit and fanin_outcome_max_bytes cut the list short
    failures_truncated_by: str | None = None
    state: str = BatchState.COMPLETE.value
    partial: bool = False
    abandoned: int = 0
    unfinished: int = 0
    round: int = 1
    retry_of: str | None = None
    app: Celery | None = field(default=None, repr=False, compare=False)

    @classmethod
    def from_message(cls, outcome: Mapping[str, Any], app: Celery | None = None) -> BatchOutcome:
        try:
            return cls(
                batch_id=str(outcome["batch_id"]),
                step=str(outcome["step"]),
                planned=int(outcome["planned"]),
                succeeded=int(outcome["succeeded"]),
                failed=int(outcome["failed"]),
                failures=list(outcome.get("failures") or []),
                failures_truncated=bool(outcome.get("failures_truncated", False)),
                failures_truncated_by=outcome.get("failures_truncated_by") or None,
                state=str(outcome.get("state", BatchState.COMPLETE.value)),
                partial=bool(outcome.get("partial", False)),
                abandoned=int(outcome.get("abandoned", 0)),
                unfinished=int(outcome.get("unfinished", 0)),
                round=int(outcome.get("round") or 1),
                retry_of=str(outcome["retry_of"]) if outcome.get("retry_of") else None,
                app=app,
            )
        except (KeyError, TypeError, ValueError, OverflowError) as exc:  # OverflowError: int() of an infinity
            raise ValueError(f"not a celery-fanin outcome: {exc!r}") from exc

    @property
    def ok(self) -> bool:
        """True when every child succeeded."""
        return self.failed == 0 and self.succeeded == self.planned

    def _app(self) -> Celery:
        return self.app or current_app

    def results(self, fetch_size: int = 1000, rounds: str = "all") -> Iterator[ChildResult]:
        """Every child's terminal state and return value, in child order, streamed from Postgres.

        Values were stored with the app's result serializer by the worker that ran the child, so no Celery
        result backend is involved. Failed children yield `value=None`.

        In a retry round (`celery -A proj fanin retry-failed`; `round` > 1), `rounds="all"` (the default) yields
        every child of round 1, in its order, with its last outcome in the rounds up to this one: a successor that
        aggregates sees the whole batch, the children that succeeded in an earlier round included. `index` is then
        the child's in round 1, `task_id` the run's that gave its outcome. `rounds="this"`: this round's children
        only. A batch never retried is the same either way.
        """
        if rounds not in ("all", "this"):
            raise ValueError(f'rounds must be "all" or "this", not {rounds!r}')
        app = self._app()
        engine = FanIn.of(app).engine
        across = rounds == "all" and self.round > 1
        bid = uuid.UUID(self.batch_id)
        for idx, task_id, state, encoded in queries.child_results(engine, bid, fetch_size, across_rounds=across):
            value = decode_result(app, encoded) if encoded is not None else None
            yield ChildResult(idx, task_id, state, value)

    def values(self, rounds: str = "all") -> Iterator[Any]:
        """The return values of the children that succeeded, in child order (across retry rounds: `results`)."""
        return (r.value for r in self.results(rounds=rounds) if r.ok)

    def all_failures(self) -> list[dict[str, Any]]:
        """Every failed child, read from Postgres (the message lists at most `fanin_outcome_failures_limit`, and
        at most `fanin_outcome_max_bytes` of them), each with its `traceback` (kept in the database only: the
        entries in `failures` have none). For a batch with many failures, prefer `iter_failures`."""
        engine = FanIn.of(self._app()).engine
        with engine.connect() as conn:
            return [failure_entry(f, with_traceback=True) for f in queries.failures(conn, uuid.UUID(self.batch_id))]

    def iter_failures(self, after: int | None = None, fetch_size: int = 1000) -> Iterator[dict[str, Any]]:
        """Every failed child in child order, streamed from Postgres with a server-side cursor; `after`: only
        those past that child index (the last one listed in `failures`, to read on where the message stopped)."""
        engine = FanIn.of(self._app()).engine
        for row in queries.stream_failures(engine, uuid.UUID(self.batch_id), after, fetch_size):
            yield failure_entry(row, with_traceback=True)

    def compensate(self) -> FanInResult:
        """Roll back this batch's work: run the undo of every child created with `compensated(task.s(...),
        undo.s(...))` that succeeded (nested groups' children included), for a successor that finds the partial
        result unusable. Returns the handle of the compensation batch.

        Created once however often it is called (keyed by this batch); each undo gets a task id derived from the
        child it undoes and that child's task id as `task.request.fanin_undo_of`. Inside a saga, the step counts as
        failed: the saga waits for these undos, then compensates the earlier steps.
        """
        return compensate_batch(self._app(), self.batch_id)
