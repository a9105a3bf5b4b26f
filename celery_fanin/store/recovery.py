"""The transactions that finish batches no child will finish: lost children, deadlines, and reconciliation.

Each works under the batch row's lock (`SELECT ... FOR UPDATE`), the same lock every terminal report takes, so
it is serialised with live traffic: a report waits for it, then re-checks its own conditions against what it
left. Run at READ COMMITTED, a statement after the lock sees every report that committed before it.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection, text

from .batches import RUN_LOCK_CLASS, Encoded, insert_successor, record_terminal

# --- lost children -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OverdueChild:
    task_id: str
    batch_id: uuid.UUID
    idx: int
    state: str
    on_lost: str
    redrives: int
    max_redrives: int
    message: Encoded


def overdue_children(conn: Connection, limit: int = 500) -> list[OverdueChild]:
    """Unfinished children of running batches whose child_timeout has passed since they last started (or were
    published or redriven)."""
    rows = conn.execute(
        text(
            """
            SELECT c.task_id, c.batch_id, c.idx, c.state, b.on_lost, c.redrives, b.max_redrives,
                   c.message, c.content_type, c.content_encoding
              FROM fanin_batches b
              JOIN fanin_children c ON c.batch_id = b.id AND c.state IN ('pending', 'started')
             WHERE b.state = 'running' AND b.child_timeout IS NOT NULL
               AND greatest(b.created_at, c.started_at, c.redriven_at) + b.child_timeout < now()
             ORDER BY b.created_at, c.idx
             LIMIT :n
            """
        ),
        {"n": limit},
    )
    return [
        OverdueChild(r.task_id, r.batch_id, r.idx, r.state, r.on_lost, r.redrives, r.max_redrives,
                     Encoded(r.content_type, r.content_encoding, bytes(r.message)))
        for r in rows
    ]  # fmt: skip


def claim_redrive(conn: Connection, child: OverdueChild) -> bool:
    """Take the right to re-publish an overdue child once: moves it back to pending and restarts its timer.

    Conditional on the redrive count the caller saw, so two relays never redrive the same child twice.
    """
    row = conn.execute(
        text(
            """
            UPDATE fanin_children
               SET state = 'pending', started_at = NULL, redriven_at = now(), redrives = redrives + 1
             WHERE task_id = :task_id AND state IN ('pending', 'started') AND redrives = :seen
         RETURNING 1
            """
        ),
        {"task_id": child.task_id, "seen": child.redrives},
    ).first()
    return row is not None


def fail_lost(conn: Connection, child: OverdueChild, timeout_text: str) -> bool:
    """Count an overdue child as a terminal failure with state `lost`; True if this call counted it."""
    rec = record_terminal(
        conn, child.task_id, "lost", exc_type="ChildLost",
        exc_message=f"no terminal outcome within child_timeout ({timeout_text}); redrives: {child.redrives}",
    )  # fmt: skip
    return rec.counted


# --- successors whose message went missing -------------------------------------------------------------------


def stalled_successors(conn: Connection, timeout_seconds: float, limit: int = 100) -> list[tuple[uuid.UUID, str]]:
    """Successors that should have run by now: `sent` or `retrying` for longer than the timeout (the message
    was lost, with a broker restart say), or `running` with no live process holding the run lock (its worker
    died mid-body and nothing redelivered it)."""
    rows = conn.execute(
        text(
            """
            SELECT s.batch_id, s.step FROM fanin_successors s
             WHERE s.state_at < now() - make_interval(secs => :timeout)
               AND (s.state IN ('sent', 'retrying')
                    OR (s.state = 'running' AND NOT EXISTS (
                        SELECT 1 FROM pg_locks l
                         WHERE l.locktype = 'advisory' AND l.classid = :cls AND l.objsubid = 2
                           AND l.objid = CAST(hashtext(s.batch_id::text || ':' || s.step) AS oid)
                           AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()))))
             LIMIT :n
            """
        ),
        {"timeout": timeout_seconds, "cls": RUN_LOCK_CLASS, "n": limit},
    )
    return [(r[0], r[1]) for r in rows]


def republish_successor(conn: Connection, batch_id: uuid.UUID, step: str) -> bool:
    """Put a stalled successor's outbox row back in line (same task id; the run guard refuses any duplicate)."""
    row = conn.execute(
        text(
            """
            WITH s AS (
                UPDATE fanin_successors SET state_at = now()
                 WHERE batch_id = :id AND step = :step AND state IN ('sent', 'retrying', 'running')
             RETURNING batch_id, step
            )
            UPDATE fanin_outbox o SET sent_at = NULL, available_at = now(), last_error = 'republished: stalled'
              FROM s WHERE o.batch_id = s.batch_id AND o.step = s.step
         RETURNING o.id
            """
        ),
        {"id": batch_id, "step": step},
    ).first()
    if row is not None:
        conn.execute(text("SELECT pg_notify('fanin_outbox', :id)"), {"id": str(row[0])})
    return row is not None


# --- deadlines -------------------------------------------------------------------------------------------------


def due_deadlines(conn: Connection, limit: int = 100) -> list[uuid.UUID]:
    rows = conn.execute(
        text(
            """
            SELECT id FROM fanin_batches
             WHERE state = 'running' AND deadline_at IS NOT NULL AND deadline_at <= now()
             ORDER BY deadline_at LIMIT :n
            """
        ),
        {"n": limit},
    )
    return [r[0] for r in rows]


@dataclass(frozen=True)
class Expiry:
    batch_id: uuid.UUID
    on_deadline: str
    abandoned: list[str]  # task ids of the children marked abandoned
    successor_created: bool


def expire_batch(conn: Connection, batch_id: uuid.UUID) -> Expiry | None:
    """Apply a passed deadline to a running batch, once.

    `proceed`: every unfinished child becomes `abandoned` (a failure), the batch is `partial`, and its successor
    runs with what arrived. `abandon`: the same children are abandoned, the batch is `expired`, and only its
    `on_expire` signature runs, if it has one. Either way the counter reaches zero here, so later reports from
    abandoned children are recorded as late and never counted. Returns None if the batch was no longer running.
    """
    batch = conn.execute(
        text(
            """
            SELECT on_deadline, on_expire_message IS NOT NULL AS has_on_expire FROM fanin_batches
             WHERE id = :id AND state = 'running' AND deadline_at <= now()
               FOR UPDATE
            """
        ),
        {"id": batch_id},
    ).first()
    if batch is None:
        return None
    abandoned = [
        r[0]
        for r in conn.execute(
            text(
                """
                UPDATE fanin_children
                   SET state = 'abandoned', finished_at = now(), exc_type = 'DeadlineExceeded',
                       exc_message = 'the batch deadline passed before this child finished'
                 WHERE batch_id = :id AND state IN ('pending', 'started')
             RETURNING task_id
                """
            ),
            {"id": batch_id},
        )
    ]
    new_state = "partial" if batch.on_deadline == "proceed" else "expired"
    conn.execute(
        text(
            """
            UPDATE fanin_batches
               SET state = :state, remaining = 0, failed = failed + :n, completed_at = now()
             WHERE id = :id
            """
        ),
        {"id": batch_id, "state": new_state, "n": len(abandoned)},
    )
    created = None
    if batch.on_deadline == "proceed":
        created = insert_successor(conn, batch_id, "then")
    elif batch.has_on_expire:
        created = insert_successor(conn, batch_id, "on_expire")
    return Expiry(batch_id, batch.on_deadline, abandoned, created is not None)


# --- reconciliation --------------------------------------------------------------------------------------------


@dataclass
class Repair:
    """What reconciliation found wrong with one batch and what it did about it."""

    batch_id: uuid.UUID
    problems: list[str] = field(default_factory=list)
    actions: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"batch_id": str(self.batch_id), "problems": self.problems, "actions": self.actions}


def batches_to_reconcile(conn: Connection, limit: int = 1000) -> list[uuid.UUID]:
    """Open batches, and finished ones whose successor or its outbox row is missing."""
    rows = conn.execute(
        text(
            """
            SELECT id FROM fanin_batches WHERE state = 'running'
            UNION
            SELECT b.id FROM fanin_batches b
              LEFT JOIN fanin_successors s ON s.batch_id = b.id AND s.step = b.step
              LEFT JOIN fanin_outbox o ON o.batch_id = b.id AND o.step = b.step
             WHERE b.state IN ('complete', 'partial', 'failed_threshold') AND (s.batch_id IS NULL OR o.id IS NULL)
            LIMIT :n
            """
        ),
        {"n": limit},
    )
    return [r[0] for r in rows]


def reconcile_batch(conn: Connection, batch_id: uuid.UUID) -> Repair | None:
    """Recompute one batch's counters from its child rows and repair what disagrees; None if all was right.

    Locks the batch row first: a terminal report in flight has updated its child row but waits for this lock
    before decrementing, and its child row is not visible to the counts below (uncommitted), so the counters
    written here are exactly what that report will then decrement. A batch whose children are all terminal is
    finished here (its successor inserted exactly once). Missing child rows (planned > created: rows deleted by
    hand, a restored backup) are reported, never guessed at.
    """
    b = conn.execute(
        text(
            """
            SELECT id, step, state, planned, remaining, succeeded, failed, max_failures,
                   on_failure_message IS NOT NULL AS has_on_failure
              FROM fanin_batches WHERE id = :id FOR UPDATE
            """
        ),
        {"id": batch_id},
    ).first()
    if b is None:
        return None
    c = conn.execute(
        text(
            """
            SELECT count(*) AS created,
                   count(*) FILTER (WHERE state IN ('pending', 'started')) AS open,
                   count(*) FILTER (WHERE state = 'succeeded') AS succeeded,
                   count(*) FILTER (WHERE state NOT IN ('pending', 'started', 'succeeded')) AS failed
              FROM fanin_children WHERE batch_id = :id
            """
        ),
        {"id": batch_id},
    ).one()
    repair = Repair(batch_id)
    if c.created != b.planned:
        repair.problems.append(f"planned {b.planned} children but {c.created} rows exist")
    if b.state == "running":
        if c.created == b.planned and (b.remaining, b.succeeded, b.failed) != (c.open, c.succeeded, c.failed):
            repair.problems.append(
                f"counter says remaining={b.remaining} succeeded={b.succeeded} failed={b.failed}, children say "
                f"remaining={c.open} succeeded={c.succeeded} failed={c.failed}"
            )
            conn.execute(
                text("UPDATE fanin_batches SET remaining = :r, succeeded = :s, failed = :f WHERE id = :id"),
                {"id": batch_id, "r": c.open, "s": c.succeeded, "f": c.failed},
            )
            repair.actions.append("counters recomputed from child rows")
        if c.created == b.planned and c.open == 0:
            conn.execute(
                text("UPDATE fanin_batches SET state = 'complete', completed_at = now() WHERE id = :id"),
                {"id": batch_id},
            )
            if not repair.problems:
                repair.problems.append("all children are terminal but the batch was still running")
            repair.actions.append("batch finished")
    state_now = conn.execute(text("SELECT state FROM fanin_batches WHERE id = :id"), {"id": batch_id}).scalar_one()
    if state_now in ("complete", "partial", "failed_threshold"):
        kind = "on_failure" if state_now == "failed_threshold" and b.has_on_failure else "then"
        if insert_successor(conn, batch_id, kind) is not None:
            repair.problems.append(f"batch is {state_now} but had no successor")
            repair.actions.append("successor and outbox row inserted")
        elif _restore_outbox_row(conn, batch_id, b.step):
            repair.problems.append("successor had no outbox row")
            repair.actions.append("outbox row inserted")
    return repair if repair.problems else None


def _restore_outbox_row(conn: Connection, batch_id: uuid.UUID, step: str) -> bool:
    row = conn.execute(
        text(
            """
            INSERT INTO fanin_outbox (batch_id, step)
            SELECT s.batch_id, s.step FROM fanin_successors s
             WHERE s.batch_id = :id AND s.step = :step AND s.state = 'pending'
               AND NOT EXISTS (SELECT 1 FROM fanin_outbox o WHERE o.batch_id = s.batch_id AND o.step = s.step)
            ON CONFLICT (batch_id, step) DO NOTHING
            RETURNING id
            """
        ),
        {"id": batch_id, "step": step},
    ).first()
    return row is not None


def open_children(conn: Connection, batch_id: uuid.UUID, limit: int = 10_000) -> list[str]:
    """Task ids of a batch's unfinished children (to revoke them when the batch finished early)."""
    rows = conn.execute(
        text(
            """
            SELECT task_id FROM fanin_children
             WHERE batch_id = :id AND state IN ('pending', 'started') ORDER BY idx LIMIT :n
            """
        ),
        {"id": batch_id, "n": limit},
    )
    return [r[0] for r in rows]
