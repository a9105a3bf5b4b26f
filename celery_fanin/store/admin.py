"""Statements for the operator commands (`celery -A proj fanin status | ls | failures | retry-failed | prune`).

None of them is on the counting path. Reads take no locks. Retention deletes in short transactions that lock only
rows nobody counts any more (`FOR UPDATE SKIP LOCKED`: a batch some other session holds is left for the next run).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Connection

from ..protocol import BATCH_ACTIVE, BatchState
from .statements import q

# Batch states in which nothing is counted any more (a failed_threshold batch may still record late children).
FINISHED_STATES = tuple(s.value for s in BatchState if s not in BATCH_ACTIVE)
BATCH_STATES = tuple(s.value for s in BatchState)


@dataclass(frozen=True)
class Node:
    """One batch as the operator commands show it; counts are in children, leaves' unfinished totals included."""

    id: uuid.UUID
    step: str
    state: str
    planned: int
    succeeded: int
    failed: int
    created_at: datetime
    completed_at: datetime | None
    deadline_at: datetime | None
    successor_name: str
    successor_state: str | None
    key: str | None
    parent_id: uuid.UUID | None
    parent_task_id: str | None
    lineage: uuid.UUID | None
    depth: int
    round: int
    retry_of: uuid.UUID | None
    child_index: int | None  # a nested batch: the index of the outer child it stands for

    @property
    def remaining(self) -> int:
        return self.planned - self.succeeded - self.failed

    def as_dict(self) -> dict[str, Any]:
        return {
            "batch_id": str(self.id),
            "step": self.step,
            "state": self.state,
            "planned": self.planned,
            "succeeded": self.succeeded,
            "failed": self.failed,
            "remaining": self.remaining,
            "created_at": self.created_at.isoformat(),
            "completed_at": self.completed_at.isoformat() if self.completed_at else None,
            "deadline_at": self.deadline_at.isoformat() if self.deadline_at else None,
            "successor_name": self.successor_name,
            "successor_state": self.successor_state,
            "round": self.round,
            "retry_of": str(self.retry_of) if self.retry_of else None,
        }


# Every node statement (`node`, `node_leaves`, `node_descendants`, `node_rounds`, `list_batches` in
# sql/queries.sql) selects from the view `fanin_nodes` (migration 0022), the one shape `_node` reads. An unfinished
# leaf's counts are added to its root's, but for failures under a threshold (`fail_up`): those are in the root's
# `failed` already (migration 0012), as the dashboard counts.


def _node(r: Any) -> Node:
    return Node(
        r.id,
        r.step,
        r.state,
        int(r.planned),
        int(r.succeeded),
        int(r.failed),
        r.created_at,
        r.completed_at,
        r.deadline_at,
        r.successor_name,
        r.successor_state,
        r.key,
        r.parent_id,
        r.parent_task_id,
        r.lineage,
        int(r.depth),
        int(r.round),
        r.retry_of,
        r.child_index,
    )


def node(conn: Connection, batch_id: uuid.UUID) -> Node | None:
    r = conn.execute(q("node").text, {"id": batch_id}).first()
    return None if r is None else _node(r)


def leaves(conn: Connection, root_id: uuid.UUID, limit: int) -> list[Node]:
    """A tree root's leaf counters, oldest first."""
    rows = conn.execute(
        q("node_leaves").text,
        {"id": root_id, "n": limit},
    )
    return [_node(r) for r in rows]


def descendants(conn: Connection, batch_id: uuid.UUID, limit: int) -> list[Node]:
    """Batches created by this batch's children or successor: nested batches (their `parent_task_id` is one of
    its children), the next stage of a pipeline (`then=fan_in_group(...)`), and any other fan-in a child or the
    successor started. Leaves are not included (see `leaves`)."""
    rows = conn.execute(
        q("node_descendants").text,
        {"id": batch_id, "n": limit},
    )
    return [_node(r) for r in rows]


def rounds(conn: Connection, original_id: uuid.UUID) -> list[Node]:
    """Round 1 (the original batch, if it still exists) and every retry round of it, in round order."""
    rows = conn.execute(
        q("node_rounds").text,
        {"id": original_id},
    )
    return [_node(r) for r in rows]


def open_children(conn: Connection, batch_id: uuid.UUID) -> tuple[int, int]:
    """(pending, started) children of a batch and its leaves: published or queued, and running on a worker now."""
    r = conn.execute(
        q("open_children").text,
        {"id": batch_id},
    ).one()
    return int(r.pending), int(r.started)


def last_progress(conn: Connection, batch_id: uuid.UUID) -> datetime | None:
    """When a child of the batch (or of its leaves) last reached a terminal state."""
    return conn.execute(
        q("last_progress").text,
        {"id": batch_id},
    ).scalar_one()


def child_location(conn: Connection, task_id: str) -> tuple[uuid.UUID, int] | None:
    """The root batch a child belongs to (its leaf's root for a tree) and the child's index."""
    r = conn.execute(
        q("child_location").text,
        {"t": task_id},
    ).first()
    return None if r is None else (r.root, int(r.idx))


@dataclass(frozen=True)
class RecoveryPolicy:
    child_timeout_seconds: float | None
    on_lost: str
    max_redrives: int


def recovery_policy(conn: Connection, batch_id: uuid.UUID) -> RecoveryPolicy:
    """What a batch does about lost children (a retry round of it does the same)."""
    r = conn.execute(
        q("recovery_policy").text,
        {"id": batch_id},
    ).one()
    return RecoveryPolicy(float(r.timeout_s) if r.timeout_s is not None else None, r.on_lost, int(r.max_redrives))


def db_now(conn: Connection) -> datetime:
    return conn.execute(q("db_now").text).scalar_one()


def failure_count(conn: Connection, batch_id: uuid.UUID) -> int:
    """Children of a batch (and its leaves) that ended in any terminal state but `succeeded`."""
    return int(
        conn.execute(
            q("failure_count").text,
            {"id": batch_id},
        ).scalar_one()
    )


# --- ls ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Listed:
    node: Node
    last_progress: datetime | None  # unfinished batches only: when one of its children last finished
    stuck: bool


def list_batches(
    conn: Connection,
    *,
    states: Sequence[str] = (),
    stuck: bool = False,
    stuck_after: float = 600.0,
    older_than: float | None = None,
    newer_than: float | None = None,
    step: str | None = None,
    limit: int = 50,
) -> list[Listed]:
    """Root batches (a tree's leaves are part of their root), newest first.

    `states` and `stuck` select (a batch matching either is listed; neither: every state): batches in one of
    `states`, and with `stuck`, open or running batches none of whose children finished in the last `stuck_after`
    seconds, nor was the batch created in them. Ages are seconds since creation; `step` matches exactly.
    """
    rows = conn.execute(
        q("list_batches").text,
        {
            "any_state": not states and not stuck,
            "states": list(states),
            "stuck": stuck,
            "threshold": stuck_after,
            "older": older_than,
            "newer": newer_than,
            "step": step,
            "n": limit,
        },
    ).all()
    listed = []
    for r in rows:
        n = _node(r)
        progress = max(n.created_at, r.last_progress) if r.last_progress is not None else n.created_at
        is_stuck = n.state in BATCH_ACTIVE and (r.now - progress).total_seconds() > stuck_after
        listed.append(Listed(n, r.last_progress, is_stuck))
    return listed


# --- retry rounds -----------------------------------------------------------------------------------------------


def latest_round(conn: Connection, original_id: uuid.UUID) -> uuid.UUID | None:
    """The batch of the highest round of `original_id` (itself when it was never retried); None if none exists."""
    return conn.execute(
        q("latest_round").text,
        {"id": original_id},
    ).scalar()


def highest_round(conn: Connection, original_id: uuid.UUID) -> int:
    return int(
        conn.execute(
            q("highest_round").text,
            {"id": original_id},
        ).scalar_one()
    )


# --- retention --------------------------------------------------------------------------------------------------

# Which root batches retention may delete: `prunable_totals` and `lock_prunable` in sql/queries.sql.


def prunable_totals(conn: Connection, age_seconds: float) -> tuple[int, int]:
    """(root batches, children) retention would delete now."""
    r = conn.execute(q("prunable_totals").text, {"age": age_seconds}).one()
    return int(r.n), int(r.children)


@dataclass(frozen=True)
class Prunable:
    id: uuid.UUID
    planned: int
    leaves: int


def lock_prunable(conn: Connection, age_seconds: float, limit: int) -> list[Prunable]:
    """Lock up to `limit` prunable roots, oldest first, skipping rows another session holds (a late report that
    is settling a failed_threshold batch, another prune). Call inside the transaction that deletes them."""
    rows = conn.execute(
        q("lock_prunable").text,
        {"age": age_seconds, "n": limit},
    )
    return [Prunable(r.id, int(r.planned), int(r.leaves)) for r in rows]


def lock_leaves(conn: Connection, root_id: uuid.UUID, limit: int) -> list[tuple[uuid.UUID, int]]:
    """Up to `limit` leaves of a locked prunable root, with their child counts."""
    rows = conn.execute(
        q("lock_leaves").text,
        {"id": root_id, "n": limit},
    )
    return [(r.id, int(r.planned)) for r in rows]


def child_rows(conn: Connection, ids: Sequence[uuid.UUID]) -> int:
    """Child rows held directly by these batches (about to be deleted with them)."""
    return int(conn.execute(q("child_rows").text, {"ids": list(ids)}).scalar_one())


# Which sagas retention may delete: `prunable_sagas` and `delete_sagas` in sql/queries.sql.


def prunable_sagas(conn: Connection, age_seconds: float) -> int:
    """Sagas retention would delete now."""
    return int(conn.execute(q("prunable_sagas").text, {"age": age_seconds}).scalar_one())


def delete_sagas(conn: Connection, age_seconds: float, limit: int) -> int:
    """Delete up to `limit` prunable sagas, oldest first. The outer conditions are checked again on a row another
    session changed meanwhile (READ COMMITTED), so a saga that stopped being finished is not deleted; a row
    another prune deleted first is simply not counted."""
    result = conn.execute(
        q("delete_sagas").text,
        {"age": age_seconds, "n": limit},
    )
    return int(result.rowcount)


def delete_batches(conn: Connection, ids: Sequence[uuid.UUID]) -> int:
    """Delete batch rows; their children, leaves, successors and outbox rows go with them (ON DELETE CASCADE)."""
    if not ids:
        return 0
    result = conn.execute(q("delete_batches").text, {"ids": list(ids)})
    return int(result.rowcount)


def record_action(conn: Connection, actor: str, action: str, batch_id: uuid.UUID, outcome: str, detail: str) -> int:
    """Record an operator's action (`fanin dashboard --allow-actions`): who, what, on which batch, how it ended."""
    return int(
        conn.execute(
            q("record_action").text,
            {"actor": actor, "action": action, "batch": batch_id, "outcome": outcome, "detail": detail},
        ).scalar_one()
    )
