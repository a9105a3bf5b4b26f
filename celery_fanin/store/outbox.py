"""The outbox: successors waiting to be published, claimed by one relay at a time.

Claiming is `SELECT ... FOR UPDATE SKIP LOCKED` (`fanin_claim_outbox`, sql/schema.sql) inside the transaction
that also marks the rows sent: the relay holds the row locks while it publishes, so a second relay skips those
rows, and a relay that dies mid-publish releases them at once (its rows were never marked sent, and go out again:
at-least-once publishing, made exactly-once in effect by the successor's start guard).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from types import SimpleNamespace
from typing import Any

from sqlalchemy import Connection

from .queries import BatchRow, SuccessorRow, batch_row, successor_row
from .statements import q

# The same, in psycopg's placeholders, for the worker's report connection (`store.reports`): the successor its
# report handed it, read without a lock (the report returns it too), and marked sent once published.
MARK_SENT_ASYNC = q("mark_sent_async")


@dataclass(frozen=True)
class OutboxRow:
    id: int
    batch_id: uuid.UUID
    step: str
    attempts: int
    # The batch's and the successor's rows, read by the claim itself (None only if a hand-edited database lost them).
    batch: BatchRow | None = field(default=None, compare=False, repr=False)
    successor: SuccessorRow | None = field(default=None, compare=False, repr=False)


def _bytea(v: str) -> bytes:
    return bytes.fromhex(v[2:])  # to_jsonb renders bytea in hex format: "\\x..."


# What JSON cannot carry as itself in `fanin_handed_off`'s rows, by column; the rest (text, integers, the
# timeout's seconds) arrive as the read's own values.
_FROM_JSON: dict[str, Callable[[str], Any]] = {
    "outbox_batch_id": uuid.UUID,
    "id": uuid.UUID,
    "retry_of": uuid.UUID,
    "successor_message": _bytea,
    "on_expire_message": _bytea,
    "on_failure_message": _bytea,
    "created_at": datetime.fromisoformat,
    "completed_at": datetime.fromisoformat,
    "deadline_at": datetime.fromisoformat,
    "s_started_at": datetime.fromisoformat,
    "s_finished_at": datetime.fromisoformat,
}


def handed_off_rows(value: Sequence[dict[str, Any]]) -> list[OutboxRow]:
    """The rows of `fanin_handed_off`'s jsonb array (the worker's report returns it),
    with the same values a claim's columns give."""
    out = []
    for item in value:
        r = SimpleNamespace(
            **{k: (_FROM_JSON[k](v) if v is not None and k in _FROM_JSON else v) for k, v in item.items()}
        )
        out.append(
            OutboxRow(r.outbox_id, r.outbox_batch_id, r.outbox_step, r.outbox_attempts, batch_row(r), successor_row(r))
        )
    return out


def claim(
    conn: Connection, limit: int, ids: Sequence[int] | None = None, batch_id: uuid.UUID | None = None
) -> list[OutboxRow]:
    """Lock up to `limit` due, unsent rows that no other transaction holds (only `ids`, or only the rows of
    `batch_id`, when given).

    Each row comes with its batch's and its successor's rows, read by the same statement: the relay needs both to
    publish, and on the successor's path every round trip counts. Only the outbox rows are locked (`FOR UPDATE OF
    o`); the batch and successor rows are read as of the statement's snapshot, which holds everything the outbox
    row's own transaction wrote with it.
    """
    if batch_id is not None:
        rows = conn.execute(q("claim_batch").text, {"n": limit, "batch": batch_id})
    else:
        rows = conn.execute(q("claim").text, {"n": limit, "ids": list(ids) if ids is not None else None})
    return [
        OutboxRow(r.outbox_id, r.outbox_batch_id, r.outbox_step, r.outbox_attempts, batch_row(r), successor_row(r))
        for r in rows
    ]


def mark_sent(conn: Connection, rows: Sequence[OutboxRow], *, durable: bool = True) -> None:
    """Mark the rows sent and their successors `sent`, in one statement (a started successor keeps its state).

    Not `durable`: the transaction's commit returns without waiting for its WAL flush (`synchronous_commit =
    off` for this transaction alone), and with it the lock on the successor's row that the worker's start guard
    may be waiting on. A crash of the database can then lose the mark, never the publish: the row is pending
    again and published again, as after a relay that died before its commit, and the guard, whose commit is
    durable, runs the successor once (docs/concepts/outbox.md). The caller keeps it durable when the
    transaction wrote more than the marks (a batch's children abandoned past its failure threshold).
    """
    if not rows:
        return
    # The worker's start guard waits on the successor's row until this commits: one round trip, not two.
    statement = q("mark_sent") if durable else q("mark_sent_async")
    conn.execute(statement.text, {"ids": [r.id for r in rows]})


def mark_failed(conn: Connection, row: OutboxRow, error: str, retry_in_seconds: float) -> None:
    """Keep the row pending, due again after a backoff, with the error for `status` and the logs."""
    conn.execute(
        q("mark_failed").text,
        {"id": row.id, "err": error[:2000], "delay": retry_in_seconds},
    )


def backlog(conn: Connection) -> tuple[int, float | None]:
    """How many rows wait to be published, and the age in seconds of the oldest."""
    row = conn.execute(q("backlog").text).one()
    return int(row[0]), (float(row[1]) if row[1] is not None else None)


def pending_ids(conn: Connection, batch_id: uuid.UUID) -> list[int]:
    """A batch's outbox rows not yet sent (to publish a successor at once rather than on NOTIFY)."""
    rows = conn.execute(q("pending_ids").text, {"id": batch_id})
    return [int(r[0]) for r in rows]
