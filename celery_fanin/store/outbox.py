"""The outbox: successors waiting to be published, claimed by one relay at a time.

Claiming is `SELECT ... FOR UPDATE SKIP LOCKED` inside the transaction that also marks the rows sent: the relay
holds the row locks while it publishes, so a second relay skips those rows, and a relay that dies mid-publish
releases them at once (its rows were never marked sent, and go out again: at-least-once publishing, made
exactly-once in effect by the successor's start guard).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import Connection, text


@dataclass(frozen=True)
class OutboxRow:
    id: int
    batch_id: uuid.UUID
    step: str
    attempts: int


def claim(conn: Connection, limit: int, ids: Sequence[int] | None = None) -> list[OutboxRow]:
    """Lock up to `limit` due, unsent rows that no other transaction holds (only `ids`, when given)."""
    rows = conn.execute(
        text(
            """
            SELECT id, batch_id, step, attempts FROM fanin_outbox
             WHERE sent_at IS NULL AND available_at <= now()
               AND (CAST(:ids AS bigint[]) IS NULL OR id = ANY(CAST(:ids AS bigint[])))
             ORDER BY available_at, id
             LIMIT :n
               FOR UPDATE SKIP LOCKED
            """
        ),
        {"n": limit, "ids": list(ids) if ids is not None else None},
    )
    return [OutboxRow(r.id, r.batch_id, r.step, r.attempts) for r in rows]


def mark_sent(conn: Connection, rows: Sequence[OutboxRow]) -> None:
    if not rows:
        return
    conn.execute(
        text("UPDATE fanin_outbox SET sent_at = now(), attempts = attempts + 1 WHERE id = ANY(CAST(:ids AS bigint[]))"),
        {"ids": [r.id for r in rows]},
    )
    # A successor that already started (the worker was faster than this commit) keeps its later state.
    conn.execute(
        text(
            """
            UPDATE fanin_successors s SET state = 'sent', state_at = now()
              FROM fanin_outbox o
             WHERE o.id = ANY(CAST(:ids AS bigint[])) AND s.batch_id = o.batch_id AND s.step = o.step
               AND s.state = 'pending'
            """
        ),
        {"ids": [r.id for r in rows]},
    )


def mark_failed(conn: Connection, row: OutboxRow, error: str, retry_in_seconds: float) -> None:
    """Keep the row pending, due again after a backoff, with the error for `status` and the logs."""
    conn.execute(
        text(
            """
            UPDATE fanin_outbox
               SET attempts = attempts + 1, last_error = :err,
                   available_at = now() + make_interval(secs => :delay)
             WHERE id = :id
            """
        ),
        {"id": row.id, "err": error[:2000], "delay": retry_in_seconds},
    )


def backlog(conn: Connection) -> tuple[int, float | None]:
    """How many rows wait to be published, and the age in seconds of the oldest."""
    row = conn.execute(
        text("SELECT count(*), extract(epoch FROM now() - min(created_at)) FROM fanin_outbox WHERE sent_at IS NULL")
    ).one()
    return int(row[0]), (float(row[1]) if row[1] is not None else None)


def pending_ids(conn: Connection, batch_id: uuid.UUID) -> list[int]:
    """A batch's outbox rows not yet sent (to publish a successor at once rather than on NOTIFY)."""
    rows = conn.execute(
        text("SELECT id FROM fanin_outbox WHERE batch_id = :id AND sent_at IS NULL ORDER BY id"), {"id": batch_id}
    )
    return [int(r[0]) for r in rows]
