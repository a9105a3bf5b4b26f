"""`BatchOutcome`: what a successor receives, and child results streamed from the store."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from celery import Celery, current_app
from sqlalchemy import Connection

from .extension import FanIn
from .publish import decode_result
from .store import queries

if TYPE_CHECKING:
    from .canvas import FanInResult


def build_outcome(
    conn: Connection, batch: queries.BatchRow, failures_limit: int, *, max_bytes: int | None = None
) -> dict[str, Any]:
    """The JSON-serialisable mapping a successor gets as its first argument.

    Built when the successor is published, after the transaction that saw zero committed, so every child's
    terminal row is visible. Failures are listed in child order up to `failures_limit` entries and `max_bytes`
    bytes of JSON (a child's arguments can be large), whichever comes first; the full list stays in Postgres
    (`BatchOutcome.iter_failures` streams it).
    """
    succeeded, failed_count = batch.succeeded, batch.failed
    if batch.state == "complete":
        # Every child reached a terminal state by being counted (none abandoned: that is the deadline's path), so
        # there is nothing unfinished to count, and failures to list only if some were counted: the common case
        # costs no scan of the batch's children.
        counts: dict[str, int] = {}
        failed = queries.failures(conn, batch.id, limit=failures_limit + 1) if batch.failed else []
    else:
        counts = queries.child_counts(conn, batch.id)
        failed = queries.failures(conn, batch.id, limit=failures_limit + 1)
        # Finished early, a tree's root has not yet heard of the successes of leaves still counting: the child
        # rows say what happened, for a flat batch and a tree alike.
        succeeded = counts.get("succeeded", 0)
        failed_count = sum(n for state, n in counts.items() if state not in ("pending", "started", "succeeded"))
    listed, truncated_by = _listed_failures(failed, failures_limit, max_bytes)
    return {
        "batch_id": str(batch.id),
        "step": batch.step,
        # complete | partial (deadline passed, on_deadline="proceed", or cancelled --proceed) | failed_threshold
        # | expired | cancelled
        "state": batch.state,
        "partial": batch.state in PARTIAL_STATES,
        "planned": batch.planned,
        "succeeded": succeeded,
        "failed": failed_count,
        "abandoned": counts.get("abandoned", 0),
        "unfinished": counts.get("pending", 0) + counts.get("started", 0),
        "failures": listed,
        "failures_truncated": truncated_by is not None,
        # why the list stops short: "count" (fanin_outcome_failures_limit) or "bytes" (fanin_outcome_max_bytes)
        "failures_truncated_by": truncated_by,
        # 1, or the number of a retry round (`celery -A proj fanin retry-failed`) and the batch of round 1
        "round": batch.round,
        "retry_of": str(batch.retry_of) if batch.retry_of else None,
    }


def _listed_failures(
    rows: list[queries.FailureRow], limit: int, max_bytes: int | None
) -> tuple[list[dict[str, Any]], str | None]:
    """The first failures, in child order, that fit both budgets, and which budget stopped the list (or None).

    The list is a prefix, so a successor that wants the rest can read on from the last listed index. An entry is
    measured as the JSON it adds to the message (its separator included).
    """
    listed: list[dict[str, Any]] = []
    used = 2  # the list's brackets
    for row in rows:
        if len(listed) == limit:
            return listed, "count"
        entry = failure_entry(row)
        if max_bytes is not None:
            size = len(json.dumps(entry, default=str).encode()) + (2 if listed else 0)
            if used + size > max_bytes:
                return listed, "bytes"
            used += size
        listed.append(entry)
    return listed, None


# Batch states in which the successor runs before every child has finished.
PARTIAL_STATES = frozenset({"partial", "failed_threshold", "expired", "cancelled"})


def failure_entry(row: queries.FailureRow) -> dict[str, Any]:
    """One failed child as the outcome lists it: which child (index, task, its arguments) and why it failed.

    Arguments are included when the child was encoded as JSON, so the entry stays JSON-serialisable whatever
    serializer the successor uses; other serializers' arguments stay in Postgres only.
    """
    entry: dict[str, Any] = {
        "index": row.index,
        "task_id": row.task_id,
        "task_name": row.task_name,
        "state": row.state,
        "exc_type": row.exc_type,
        "exc_message": row.exc_message,
        "attempts": row.attempts,
    }
    if row.late_state is not None:
        entry["late_state"] = row.late_state
    if row.message.content_type == "application/json":
        try:
            sig = json.loads(row.message.body)
            entry["args"] = sig.get("args", [])
            entry["kwargs"] = sig.get("kwargs", {})
        except (ValueError, AttributeError):  # a hand-edited row: leave the arguments out rather than fail
            pass
    return entry


@dataclass(frozen=True)
class ChildResult:
    index: int
    task_id: str
    state: str
    value: Any = None

    @property
    def ok(self) -> bool:
        return self.state == "succeeded"


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
    state: str = "complete"
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
                state=str(outcome.get("state", "complete")),
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

    def results(self, fetch_size: int = 1000) -> Iterator[ChildResult]:
        """Every child's terminal state and return value, in child order, streamed from Postgres.

        Values were stored with the app's result serializer by the worker that ran the child, so no Celery
        result backend is involved. Failed children yield `value=None`.
        """
        app = self._app()
        engine = FanIn.of(app).engine
        for idx, task_id, state, encoded in queries.child_results(engine, uuid.UUID(self.batch_id), fetch_size):
            value = decode_result(app, encoded) if encoded is not None else None
            yield ChildResult(idx, task_id, state, value)

    def values(self) -> Iterator[Any]:
        """The return values of the children that succeeded, in child order."""
        return (r.value for r in self.results() if r.ok)

    def all_failures(self) -> list[dict[str, Any]]:
        """Every failed child, read from Postgres (the message lists at most `fanin_outcome_failures_limit`, and
        at most `fanin_outcome_max_bytes` of them). For a batch with many failures, prefer `iter_failures`."""
        engine = FanIn.of(self._app()).engine
        with engine.connect() as conn:
            return [failure_entry(f) for f in queries.failures(conn, uuid.UUID(self.batch_id))]

    def iter_failures(self, after: int | None = None, fetch_size: int = 1000) -> Iterator[dict[str, Any]]:
        """Every failed child in child order, streamed from Postgres with a server-side cursor; `after`: only
        those past that child index (the last one listed in `failures`, to read on where the message stopped)."""
        engine = FanIn.of(self._app()).engine
        for row in queries.stream_failures(engine, uuid.UUID(self.batch_id), after, fetch_size):
            yield failure_entry(row)

    def compensate(self) -> FanInResult:
        """Roll back this batch's work: run the undo of every child created with `compensated(task.s(...),
        undo.s(...))` that succeeded (nested groups' children included), for a successor that finds the partial
        result unusable. Returns the handle of the compensation batch.

        Created once however often it is called (keyed by this batch); each undo gets a task id derived from the
        child it undoes and that child's task id as `task.request.fanin_undo_of`. Inside a saga, the step counts as
        failed: the saga waits for these undos, then compensates the earlier steps.
        """
        from .sagas import compensate_batch

        return compensate_batch(self._app(), self.batch_id)
