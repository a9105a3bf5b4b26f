"""The transactions that finish batches no child will finish: lost children, deadlines, and reconciliation.

Each works under the batch row's lock (`SELECT ... FOR UPDATE`), the same lock every terminal report takes, so
it is serialised with live traffic: a report waits for it, then re-checks its own conditions against what it
left. Run at READ COMMITTED, a statement after the lock sees every report that committed before it.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection

from .batches import Encoded, lock_membership
from .statements import q

# --- lost children -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OverdueChild:
    task_id: str
    batch_id: uuid.UUID
    idx: int
    task_name: str
    state: str
    on_lost: str
    redrives: int
    max_redrives: int
    message: Encoded


def overdue_children(conn: Connection, limit: int = 500) -> list[OverdueChild]:
    """Unfinished children of running batches whose child_timeout has passed since they last started (or were
    published or redriven). Each with the batch its message names (a tree's root, for a leaf's child), which a
    redriven copy names again."""
    rows = conn.execute(
        q("overdue_children").text,
        {"n": limit},
    )
    return [
        OverdueChild(
            r.task_id,
            r.batch_id,
            r.idx,
            r.task_name,
            r.state,
            r.on_lost,
            r.redrives,
            r.max_redrives,
            Encoded(r.content_type, r.content_encoding, bytes(r.message)),
        )
        for r in rows
    ]


def claim_redrive(conn: Connection, child: OverdueChild) -> bool:
    """Take the right to re-publish an overdue child once: moves it back to pending and restarts its timer.

    Conditional on the redrive count the caller saw, so two relays never redrive the same child twice; the store
    checks again that it is overdue and may be redriven (`fanin_claim_redrive`, sql/schema.sql).
    """
    found = conn.execute(q("claim_redrive").text, {"task_id": child.task_id, "seen": child.redrives}).scalar_one()
    return bool(found)


def fail_lost(conn: Connection, child: OverdueChild) -> bool:
    """Count an overdue child as a terminal failure with state `lost`; True if this call counted it.

    `fanin_fail_lost` checks, on the locked child row, that it is overdue and may not be redriven."""
    return bool(conn.execute(q("fail_lost").text, {"task_id": child.task_id}).scalar_one())


# --- children whose message expired unconsumed -----------------------------------------------------------------


def expired_children(conn: Connection, grace_seconds: float, limit: int = 500) -> list[tuple[str, uuid.UUID, int]]:
    """Children never started whose `expires` passed more than `grace_seconds` ago: (task id, batch id, index).

    Why: RabbitMQ drops an expired message unconsumed (Celery gives it a TTL), so no worker's `task_revoked`
    reports it. A worker that took the message before it expired reports it itself (revoked, or its run)."""
    rows = conn.execute(
        q("expired_children").text,
        {"grace": grace_seconds, "n": limit},
    )
    return [(r.task_id, r.batch_id, r.idx) for r in rows]


def revoke_expired(conn: Connection, task_id: str, grace_seconds: float) -> bool:
    """Count a child as `revoked` (expired) if it is still pending and past its expiry; True if this call did.

    The child row is locked first and checked again (a start written since moves it out of `pending`), then
    counted by the same conditional transition a worker's report takes: a real report arriving later is late.
    """
    found = conn.execute(q("revoke_expired").text, {"task_id": task_id, "grace": grace_seconds}).scalar_one()
    return bool(found)


# --- deadlines -------------------------------------------------------------------------------------------------


def due_deadlines(conn: Connection, limit: int = 100) -> list[uuid.UUID]:
    rows = conn.execute(
        q("due_deadlines").text,
        {"n": limit},
    )
    return [r[0] for r in rows]


@dataclass(frozen=True)
class Expiry:
    batch_id: uuid.UUID
    on_deadline: str  # how it was applied: "proceed" or "abandon"
    abandoned: list[str]  # task ids of the children marked abandoned
    successor_created: bool
    state: str = ""  # the batch's final state: partial, expired or cancelled


# Why a batch may be ended early (the exception its unfinished children are abandoned with is fanin_expire_batch's).
_ENDINGS = frozenset({"deadline", "cancel"})


def expire_batch(
    conn: Connection, batch_id: uuid.UUID, *, reason: str = "deadline", proceed: bool | None = None
) -> Expiry | None:
    """Apply a passed deadline (or a cancel) to a running or open batch, once.

    `proceed`: every unfinished child becomes `abandoned` (a failure), the batch is `partial`, and its successor
    runs with what arrived. `abandon`: the same children are abandoned, the batch is `expired` (`cancelled` for a
    cancel), and only its `on_expire` signature runs, if it has one. Either way the counter reaches zero here, so
    later reports from abandoned children are recorded as late and never counted, and an open batch's producer
    can add nothing more. Returns None if the batch had already finished (or, for a deadline, is not yet due).

    `reason="cancel"` ends the batch now whatever its deadline, `proceed` defaulting to False; a deadline follows
    the batch's `on_deadline` unless `proceed` says otherwise.

    Locks are taken in the order every terminal report takes them (child rows, then leaves, then the root), so
    this never deadlocks with live reports; counters are then set from the child rows, under those locks.
    """
    if reason not in _ENDINGS:
        raise ValueError(f"not a reason to end a batch: {reason!r}")
    lock_membership(conn, batch_id)  # a producer's chunk in flight commits first, or waits and then finds it ended
    row = conn.execute(
        q("expire_batch").text,
        {"id": batch_id, "reason": reason, "proceed": proceed},
    ).first()
    return _expiry(batch_id, row)


def cancel_open_batch(conn: Connection, batch_id: uuid.UUID) -> Expiry | None:
    """`expire_batch(reason="cancel", proceed=False)` for a batch that is still open (its producer's input raised):
    the producer's cancel, which ends no batch that was sealed. None if it is not an open root."""
    lock_membership(conn, batch_id)
    row = conn.execute(q("cancel_open_batch").text, {"id": batch_id}).first()
    return _expiry(batch_id, row)


def _expiry(batch_id: uuid.UUID, row: Any) -> Expiry | None:
    if row is None:
        return None
    return Expiry(batch_id, row.on_deadline, list(row.abandoned), bool(row.successor_created), row.state)


# --- reconciliation --------------------------------------------------------------------------------------------


@dataclass
class Repair:
    """What reconciliation found wrong with one batch and what it did about it."""

    batch_id: uuid.UUID
    problems: list[str] = field(default_factory=list)
    actions: list[str] = field(default_factory=list)
    # What could not be checked: children of leaves retention deleted (counted now only in the root's totals).
    unchecked: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "batch_id": str(self.batch_id),
            "problems": self.problems,
            "actions": self.actions,
            "unchecked": self.unchecked,
        }


def batches_to_reconcile(conn: Connection, limit: int = 1000) -> list[uuid.UUID]:
    """Open and running batches (leaves before roots, so a leaf finished here is counted in its root's recount),
    and finished roots whose successor or its outbox row is missing."""
    rows = conn.execute(
        q("batches_to_reconcile").text,
        {"n": limit},
    )
    return [r[0] for r in rows]


def reconcile_batch(conn: Connection, batch_id: uuid.UUID) -> Repair | None:
    """Recompute one batch's counters from its child rows (and leaves) and repair what disagrees; None if all
    was right.

    Locks the batch row first: a terminal report in flight has updated its child row (or its leaf) but waits for
    this lock before decrementing, and its update is not visible to the counts below (uncommitted), so the
    counters written here are exactly what that report will then decrement. A batch whose children are all
    terminal is finished through `fanin_settle_v2`, the same path a last report takes (a leaf settles its root, a
    root gets its successor exactly once). Missing child rows (planned > created: rows deleted by hand, a
    restored backup) are reported, never guessed at.
    """
    row = conn.execute(q("reconcile_batch").text, {"id": batch_id}).one()
    if not row.problems:
        return None
    problems, unchecked = _without_pruned_leaves(conn, batch_id, list(row.problems))
    if not problems:
        return None
    return Repair(batch_id, problems, list(row.actions), unchecked)


def _without_pruned_leaves(conn: Connection, batch_id: uuid.UUID, problems: list[str]) -> tuple[list[str], list[str]]:
    """The problems, less a finished tree root's missing rows that are leaves retention deleted; and a note of them.

    Why: `fanin prune` deletes a large tree leaf by leaf before its root, so a root caught in between (a prune that
    stopped at `max_seconds`, or was killed) has fewer rows than it planned, which `fanin_reconcile_batch` reports.
    They are taken as pruned only if what was kept accounts for them exactly: the root holds no children of its own
    (a tree's are all in leaves), every kept leaf is finished, and the root's final totals less its kept leaves'
    are as many succeeded and failed children as are missing. Anything else (a leaf's planned count changed, rows
    deleted by hand) is still reported. A finished batch's counters are never rewritten here either way.
    """
    part = conn.execute(q("pruned_part").text, {"id": batch_id}).one_or_none()
    if part is None:
        return problems, []
    missing = part.planned - part.created
    # The text `fanin_reconcile_batch` (sql/schema.sql) gives this problem.
    mismatch = f"planned {part.planned} children but {part.created} rows exist"
    pruned = (
        missing > 0
        and part.direct == 0
        and part.unfinished == 0
        and part.pruned_succeeded >= 0
        and part.pruned_failed >= 0
        and part.pruned_succeeded + part.pruned_failed == missing
    )
    if not pruned or mismatch not in problems:
        return problems, []
    note = (
        f"{missing} of {part.planned} children were in leaves retention deleted: not checked (the root's totals "
        f"count them as {part.pruned_succeeded} succeeded, {part.pruned_failed} failed)"
    )
    return [p for p in problems if p != mismatch], [note]


def abandon_after_threshold(conn: Connection, batch_id: uuid.UUID) -> list[str]:
    """Stop a batch that passed its failure threshold: its unfinished children (the root's own and every leaf's)
    become `abandoned`, and its counters reach zero. Returns their task ids, for the caller to revoke.

    Once a child is abandoned, its report (the worker's `revoked` as it discards the queued message, or the
    outcome of one that was already running) finds the row terminal and is recorded as late, never counted: the
    counters set here are final. Locks are taken as `expire_batch` takes them (child rows, then leaves, then the
    root: the order of every terminal report), and the counters are then set from the child rows, which every
    report that counted has committed by then (the child UPDATE waited for any in flight). Runs again harmlessly:
    a stopped batch has nothing unfinished.
    """
    found = conn.execute(q("abandon_after_threshold").text, {"id": batch_id}).scalar_one()
    return list(found)


# --- open batches whose producer is gone -----------------------------------------------------------------------


def lapsed_open_batches(conn: Connection, grace_seconds: float, limit: int = 100) -> list[uuid.UUID]:
    """Open root batches whose producer has been gone for longer than the grace.

    "Gone" is the signal the relay already trusts for publishing orphaned children: nobody holds the batch's
    publish lock (a session advisory lock, released by the producer once it sealed, or by Postgres when its
    connection dies). "For longer than the grace" is measured from `producer_seen_at`: every chunk a producer
    writes renews it, and this call first renews it for every open batch whose lock is held, so the grace runs
    from (about) the moment the producer let go, not from its last chunk.
    """
    params = {"grace": grace_seconds, "n": limit}
    conn.execute(q("renew_open_batches").text)
    rows = conn.execute(
        q("lapsed_open_batches").text,
        params,
    )
    return [r[0] for r in rows]


@dataclass(frozen=True)
class Sealed:
    batch_id: uuid.UUID
    planned: int  # the children it was sealed with
    successor_created: bool  # every child had already finished: its successor was created by the seal


def seal_open_batch(conn: Connection, batch_id: uuid.UUID, *, lapsed_grace: float | None = None) -> Sealed | None:
    """Seal an open root batch and its open leaves: it takes no more children and finishes when they have.

    The same transition as a producer's own seal (`fanin_seal`, leaves first), so a batch whose children have
    all finished gets its successor here, once. With `lapsed_grace`, only if its producer was still last seen
    longer ago than that (checked under the row lock, so a resumer that wrote a chunk since is not sealed under).
    Returns None if the batch is not an open root (or has not lapsed).
    """
    lock_membership(conn, batch_id)  # after a producer's chunk in flight: its new leaves are sealed too
    row = conn.execute(
        q("seal_open_batch").text,
        {"id": batch_id, "grace": lapsed_grace},
    ).first()
    if row is None:
        return None
    return Sealed(batch_id, row.planned, bool(row.successor_created))


def batch_state(conn: Connection, batch_id: uuid.UUID) -> tuple[str, uuid.UUID | None] | None:
    """A batch's state and its root (for a leaf), to explain why it could not be sealed or cancelled."""
    row = conn.execute(q("batch_state").text, {"id": batch_id}).first()
    return None if row is None else (row.state, row.parent_id)
