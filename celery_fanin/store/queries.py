"""Read-only statements: batch status, the successor's outcome, child results, failures."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, Engine

from ..protocol import SuccessorKind
from .batches import Encoded
from .statements import q


@dataclass(frozen=True)
class BatchRow:
    id: uuid.UUID
    step: str
    state: str
    planned: int
    remaining: int
    succeeded: int
    failed: int
    published_upto: int
    successor_task_id: str
    successor_name: str
    successor_message: Encoded
    created_at: datetime
    completed_at: datetime | None
    deadline_at: datetime | None = None
    on_expire_message: Encoded | None = None
    on_failure_message: Encoded | None = None
    child_timeout_seconds: float | None = None
    round: int = 1  # a retry round's number (1 otherwise), and the batch of round 1 it retries
    retry_of: uuid.UUID | None = None
    refused_reports: int = 0  # reports whose message disagreed with the child they named (migration 0014)

    def message_for(self, kind: str) -> Encoded:
        """The stored signature a successor of `kind` runs: `then`, or `on_expire` / `on_failure` instead of it."""
        messages: dict[str, Encoded | None] = {
            SuccessorKind.THEN: self.successor_message,
            SuccessorKind.ON_EXPIRE: self.on_expire_message,
            SuccessorKind.ON_FAILURE: self.on_failure_message,
        }
        found = messages.get(kind)
        if found is None:
            raise LookupError(f"batch {self.id} has no {kind} signature")
        return found


@dataclass(frozen=True)
class SuccessorRow:
    task_id: str
    state: str
    runs: int
    duplicates: int
    exc_type: str | None
    exc_message: str | None
    started_at: datetime | None
    finished_at: datetime | None
    kind: str = SuccessorKind.THEN
    traceback: str | None = None  # a failed run's (the `successor` statement reads it; the outbox's do not)


def _encoded(body: bytes | None, content_type: str | None, content_encoding: str | None) -> Encoded | None:
    if body is None:
        return None
    return Encoded(content_type or "", content_encoding or "", bytes(body))


def batch_row(r: Any) -> BatchRow | None:
    """The `BatchRow` of a row with the `batch` statement's columns (None where an outer join found no batch)."""
    if r is None or r.id is None:
        return None
    return BatchRow(
        r.id,
        r.step,
        r.state,
        r.planned,
        r.remaining,
        r.succeeded,
        r.failed,
        r.published_upto,
        r.successor_task_id,
        r.successor_name,
        Encoded(r.successor_content_type, r.successor_content_encoding, bytes(r.successor_message)),
        r.created_at,
        r.completed_at,
        r.deadline_at,
        _encoded(r.on_expire_message, r.on_expire_content_type, r.on_expire_content_encoding),
        _encoded(r.on_failure_message, r.on_failure_content_type, r.on_failure_content_encoding),
        float(r.child_timeout_seconds) if r.child_timeout_seconds is not None else None,
        r.round,
        r.retry_of,
        r.refused_reports,
    )


def successor_row(r: Any) -> SuccessorRow | None:
    """The `SuccessorRow` of a row with the `successor` statement's columns (None where an outer join found none)."""
    if r is None or r.s_task_id is None:
        return None
    return SuccessorRow(
        r.s_task_id,
        r.s_state,
        r.s_runs,
        r.s_duplicates,
        r.s_exc_type,
        r.s_exc_message,
        r.s_started_at,
        r.s_finished_at,
        r.s_kind,
        getattr(r, "s_traceback", None),
    )


def batch(conn: Connection, batch_id: uuid.UUID) -> BatchRow | None:
    r = conn.execute(q("batch").text, {"id": batch_id})
    return batch_row(r.first())


def successor(conn: Connection, batch_id: uuid.UUID, step: str) -> SuccessorRow | None:
    r = conn.execute(
        q("successor").text,
        {"id": batch_id, "step": step},
    )
    return successor_row(r.first())


def unfinished_leaves(conn: Connection, batch_id: uuid.UUID) -> tuple[int, int, int]:
    """(count, succeeded, failed) of a root's leaves still counting: the part of its totals not yet handed up (a
    `fail_up` leaf hands its failures up as they are counted)."""
    row = conn.execute(
        q("unfinished_leaves").text,
        {"id": batch_id},
    ).one()
    return int(row[0]), int(row[1]), int(row[2])


def successor_result(conn: Connection, batch_id: uuid.UUID, step: str) -> Encoded | None:
    row = conn.execute(
        q("successor_result").text,
        {"id": batch_id, "step": step},
    ).first()
    return None if row is None else _encoded(row.result, row.result_content_type, row.result_content_encoding)


def depth(conn: Connection, batch_id: uuid.UUID) -> int | None:
    row = conn.execute(q("depth").text, {"id": batch_id}).first()
    return None if row is None else int(row[0])


def child_counts(conn: Connection, batch_id: uuid.UUID) -> dict[str, int]:
    """How many children are in each state (pending, started, succeeded, failed, lost, ...)."""
    rows = conn.execute(
        q("child_counts").text,
        {"id": batch_id},
    )
    return {r[0]: int(r[1]) for r in rows}


@dataclass(frozen=True)
class FailureRow:
    index: int
    task_id: str
    task_name: str
    state: str
    exc_type: str | None
    exc_message: str | None
    attempts: int
    late_state: str | None
    message: Encoded
    traceback: str | None = None


def failures(conn: Connection, batch_id: uuid.UUID, limit: int | None = None) -> list[FailureRow]:
    """Children that did not succeed, in child order, with their stored signatures (to show their arguments)."""
    rows = conn.execute(
        q("failures").text,
        {"id": batch_id, "n": limit},
    )
    return [_failure_row(r) for r in rows]


def stream_failures(
    engine: Engine, batch_id: uuid.UUID, after: int | None = None, fetch_size: int = 1000
) -> Iterator[FailureRow]:
    """`failures`, streamed with a server-side cursor (memory bounded by `fetch_size`); `after`: past that index."""
    with engine.connect() as conn:
        rows = conn.execution_options(stream_results=True, yield_per=fetch_size).execute(
            q("stream_failures").text,
            {"id": batch_id, "after": after},
        )
        for r in rows:
            yield _failure_row(r)


def _failure_row(r: Any) -> FailureRow:
    """One row of `failures` / `stream_failures` (the same columns)."""
    return FailureRow(
        r.idx,
        r.task_id,
        r.task_name,
        r.state,
        r.exc_type,
        r.exc_message,
        r.starts,
        r.late_state,
        Encoded(r.content_type, r.content_encoding, bytes(r.message)),
        r.traceback,
    )


def child_results(
    engine: Engine, batch_id: uuid.UUID, fetch_size: int = 1000, across_rounds: bool = False
) -> Iterator[tuple[int, str, str, Encoded | None]]:
    """Every child's (index, task id, state, encoded result), in child order, streamed with a server-side cursor.

    `across_rounds`: round 1's children instead, each with its last outcome in the rounds up to `batch_id`'s
    (`retry-failed`); the same as without it for a batch never retried."""
    with engine.connect() as conn:
        rows = conn.execution_options(stream_results=True, yield_per=fetch_size).execute(
            (q("round_results") if across_rounds else q("child_results")).text,
            {"id": batch_id},
        )
        for r in rows:
            encoded = (
                Encoded(r.result_content_type, r.result_content_encoding, bytes(r.result))
                if r.result is not None
                else None
            )
            yield r.idx, r.task_id, r.state, encoded


def unfinished_children(conn: Connection, batch_id: uuid.UUID) -> list[Any]:
    """A batch's children (leaves included) not yet terminal, in child order, with their stored messages."""
    return list(
        conn.execute(
            q("unfinished_children").text,
            {"id": batch_id},
        )
    )
