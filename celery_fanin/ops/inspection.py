"""What the operator commands show: a batch with its tree and rounds, lists of batches, failed children.

Plain data (dicts of JSON-able values), read in one connection per call, so `status --json`, `ls --json` and
`failures --json` print exactly what the rich renderings in `celery_fanin.cli` show.
"""

from __future__ import annotations

import math
import re
import uuid
from dataclasses import asdict, dataclass
from typing import Any

from sqlalchemy import Connection
from sqlalchemy.exc import SQLAlchemyError

from ..context import FanIn
from ..exceptions import BatchNotFound, FanInDatabaseError, summarise
from ..producer.result import parse_batch_id, read_status
from ..protocol import BatchState
from ..store import admin, queries, successors
from ..store.outcomes import failure_entry

# The longest duration and the largest count an operator command takes: beyond them an argument is a mistake, and
# PostgreSQL would refuse it with an out-of-range error only after the command had started.
MAX_SECONDS = 100 * 365 * 24 * 3600.0  # a century, as fan_in_group's timeouts and deadlines
MAX_COUNT = 2**31 - 1  # PostgreSQL's integer

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_PART = re.compile(r"(\d+(?:\.\d+)?)\s*([smhdw])")


def parse_duration(value: str | float | int) -> float:
    """Seconds from `30d`, `12h`, `1h30m`, `90s`, `2w` or a plain number of seconds; ValueError otherwise."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        text = str(value).strip().lower()
        try:
            seconds = float(text)
        except ValueError:
            parts = _PART.findall(text)
            if not parts or _PART.sub("", text).strip():
                raise ValueError(f"{value!r} is not a duration (examples: 30d, 12h, 1h30m, 90s, 600)") from None
            seconds = sum(float(n) * _UNITS[unit] for n, unit in parts)
    if seconds < 0:
        raise ValueError(f"a duration must not be negative, not {value!r}")
    if not math.isfinite(seconds) or seconds > MAX_SECONDS:
        raise ValueError(f"a duration must be finite and at most {MAX_SECONDS:.0f} seconds (a century), not {value!r}")
    return seconds


def parse_seconds(value: str | float, minimum: float = 0.0) -> float:
    """A finite number of seconds, at least `minimum` and at most a century; ValueError otherwise (a plain float
    option takes nan, which compares false with every bound, and inf)."""
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{value!r} is not a number of seconds") from None
    if not math.isfinite(seconds) or not minimum <= seconds <= MAX_SECONDS:
        raise ValueError(f"{value!r} is not a finite number of seconds from {minimum:g} to {MAX_SECONDS:.0f}")
    return seconds


def _read(fanin: FanIn, what: str) -> Connection:
    try:
        return fanin.engine.connect()
    except SQLAlchemyError as exc:
        raise FanInDatabaseError(f"could not {what}: {summarise(exc)}") from exc


def _node_or_raise(conn: Connection, batch_id: uuid.UUID) -> admin.Node:
    found = admin.node(conn, batch_id)
    if found is None:
        raise BatchNotFound(f"no fan-in batch with id {batch_id}")
    return found


def _kind(n: admin.Node) -> str:
    if n.parent_id is not None:
        return "leaf"
    if n.parent_task_id is not None:
        return "nested"
    if n.key is not None and n.key.startswith("then:"):
        return "stage"
    return "spawned"  # a fan-in started by one of the batch's children or by its successor


@dataclass
class _Budget:
    left: int
    truncated: bool = False

    def take(self, n: int) -> int:
        """How many of `n` nodes may still be shown."""
        taken = min(n, self.left)
        self.left -= taken
        if taken < n:
            self.truncated = True
        return taken


def _subtree(conn: Connection, n: admin.Node, kind: str, budget: _Budget) -> dict[str, Any]:
    """A node and, within the budget, its leaves and then its descendants (each with its own subtree). Lineage
    always points to an older batch, so this ends."""
    entry = {"kind": kind, **n.as_dict()}
    if n.child_index is not None:
        entry["child_index"] = n.child_index
    children: list[dict[str, Any]] = []
    leaves = admin.leaves(conn, n.id, budget.left + 1)  # one more than shown: whether any were left out
    for leaf in leaves[: budget.take(len(leaves))]:
        children.append({"kind": "leaf", **leaf.as_dict(), "children": []})
    below = admin.descendants(conn, n.id, budget.left + 1)
    for d in below[: budget.take(len(below))]:
        children.append(_subtree(conn, d, _kind(d), budget))
    entry["children"] = children
    return entry


def describe(fanin: FanIn, batch_id: str | uuid.UUID, tree_limit: int = 200) -> dict[str, Any]:
    """`status`: the batch's counts and successor (as `FanInResult.batch_status()`), its age, deadline, pending and
    running children, where it sits (a tree's leaf, a nested batch's outer child, a retry round), every round of
    it, and its tree: leaves, nested batches, pipeline stages and fan-ins its children or successor started, each
    with its own tree (at most `tree_limit` nodes in all)."""
    bid = parse_batch_id(batch_id)
    status = read_status(fanin, bid)
    conn = _read(fanin, f"read batch {bid}")
    try:
        with conn:
            n = _node_or_raise(conn, bid)
            now = admin.db_now(conn)
            pending, started = admin.open_children(conn, bid)
            data = status.as_dict()
            data.update(
                age_seconds=round((now - n.created_at).total_seconds(), 3),
                deadline_at=n.deadline_at.isoformat() if n.deadline_at else None,
                deadline_in_seconds=round((n.deadline_at - now).total_seconds(), 3) if n.deadline_at else None,
                pending=pending,
                running=started,
                depth=n.depth,
                round=n.round,
                retry_of=str(n.retry_of) if n.retry_of else None,
                leaf_of=str(n.parent_id) if n.parent_id else None,
                lineage=str(n.lineage) if n.lineage else None,
            )
            nested_in = None
            if n.parent_task_id:
                found = admin.child_location(conn, n.parent_task_id)
                nested_in = {"batch_id": str(found[0]), "child_index": found[1]} if found else None
            data["nested_in"] = nested_in
            succ = queries.successor(conn, bid, status.step) if n.parent_id is None else None
            failed = succ is not None and succ.exc_type is not None
            data["successor_error"] = f"{succ.exc_type}: {succ.exc_message or ''}" if succ and failed else None
            data["successor_traceback"] = succ.traceback if succ is not None else None
            data["successor_runs"] = succ.runs if succ is not None else 0
            data["successor_current_task_id"] = succ.task_id if succ is not None else None
            data["reruns"] = (
                [
                    {**asdict(r), "requested_at": r.requested_at.isoformat()}
                    for r in successors.reruns(conn, bid, status.step)
                ]
                if succ is not None
                else []
            )
            original = n.retry_of or n.id
            rounds = admin.rounds(conn, original)
            data["rounds"] = [r.as_dict() for r in rounds] if len(rounds) > 1 or n.retry_of else []
            budget = _Budget(tree_limit)
            data["tree"] = _subtree(conn, n, "leaf" if n.parent_id else "root", budget)
            data["tree_truncated"] = budget.truncated
    except SQLAlchemyError as exc:
        raise FanInDatabaseError(f"could not read batch {bid}: {summarise(exc)}") from exc
    return data


def list_batches(
    fanin: FanIn,
    *,
    states: tuple[str, ...] = (),
    stuck_after: float = 600.0,
    older_than: float | None = None,
    newer_than: float | None = None,
    step: str | None = None,
    limit: int = 50,
) -> list[dict[str, Any]]:
    """`ls`: root batches, newest first; `states` may include `stuck` (see `store.admin.list_batches`)."""
    real = tuple(s for s in states if s != "stuck")
    unknown = [s for s in real if s not in set(BatchState)]
    if unknown:
        raise ValueError(f"unknown state {unknown[0]!r}")
    conn = _read(fanin, "list batches")
    try:
        with conn:
            now = admin.db_now(conn)
            rows = admin.list_batches(
                conn,
                states=real,
                stuck="stuck" in states,
                stuck_after=stuck_after,
                older_than=older_than,
                newer_than=newer_than,
                step=step,
                limit=limit,
            )
    except SQLAlchemyError as exc:
        raise FanInDatabaseError(f"could not list batches: {summarise(exc)}") from exc
    out = []
    for row in rows:
        entry = row.node.as_dict()
        entry.update(
            age_seconds=round((now - row.node.created_at).total_seconds(), 3),
            last_progress_at=row.last_progress.isoformat() if row.last_progress else None,
            stuck=row.stuck,
        )
        out.append(entry)
    return out


def failures(fanin: FanIn, batch_id: str | uuid.UUID, limit: int | None = 100) -> dict[str, Any]:
    """`failures`: the children (of the batch and its leaves) that ended in any state but `succeeded`."""
    bid = parse_batch_id(batch_id)
    conn = _read(fanin, f"read batch {bid}")
    try:
        with conn:
            n = _node_or_raise(conn, bid)
            total = admin.failure_count(conn, bid)
            rows = queries.failures(conn, bid, limit=limit)
    except SQLAlchemyError as exc:
        raise FanInDatabaseError(f"could not read the failures of batch {bid}: {summarise(exc)}") from exc
    return {
        "batch_id": str(bid),
        "state": n.state,
        "round": n.round,
        "total": total,
        "failures": [failure_entry(r, with_traceback=True) for r in rows],
    }
