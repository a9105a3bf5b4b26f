"""The outcome a successor receives as its first argument, built from the committed rows when it is published."""

from __future__ import annotations

import json
from typing import Any

from sqlalchemy import Connection

from ..protocol import BATCH_PARTIAL, CHILD_OPEN, BatchState, ChildState, OutcomePayload
from . import queries


def build_outcome(
    conn: Connection | None, batch: queries.BatchRow, failures_limit: int, *, max_bytes: int | None = None
) -> OutcomePayload:
    """The JSON-serialisable mapping a successor gets as its first argument.

    Built when the successor is published, after the transaction that saw zero committed, so every child's
    terminal row is visible. Failures are listed in child order up to `failures_limit` entries and `max_bytes`
    bytes of JSON (a child's arguments can be large), whichever comes first; the full list stays in Postgres
    (`BatchOutcome.iter_failures` streams it). `conn` may be None only for a complete batch with no failures,
    whose outcome is its row alone.
    """
    succeeded, failed_count = batch.succeeded, batch.failed
    if batch.state == BatchState.COMPLETE:
        # Every child reached a terminal state by being counted (none abandoned: that is the deadline's path), so
        # there is nothing unfinished to count, and failures to list only if some were counted: the common case
        # costs no scan of the batch's children.
        counts: dict[str, int] = {}
        failed = queries.failures(_reader(conn, batch), batch.id, limit=failures_limit + 1) if batch.failed else []
    else:
        counts = queries.child_counts(_reader(conn, batch), batch.id)
        failed = queries.failures(_reader(conn, batch), batch.id, limit=failures_limit + 1)
        # Finished early, a tree's root has not yet heard of the successes of leaves still counting: the child
        # rows say what happened, for a flat batch and a tree alike.
        succeeded = counts.get(ChildState.SUCCEEDED, 0)
        failed_count = sum(
            n for state, n in counts.items() if state not in CHILD_OPEN and state != ChildState.SUCCEEDED
        )
    listed, truncated_by = _listed_failures(failed, failures_limit, max_bytes)
    return {
        "batch_id": str(batch.id),
        "step": batch.step,
        "state": batch.state,
        "partial": batch.state in BATCH_PARTIAL,
        "planned": batch.planned,
        "succeeded": succeeded,
        "failed": failed_count,
        "abandoned": counts.get(ChildState.ABANDONED, 0),
        "unfinished": sum(counts.get(state, 0) for state in CHILD_OPEN),
        "failures": listed,
        "failures_truncated": truncated_by is not None,
        "failures_truncated_by": truncated_by,
        "round": batch.round,
        "retry_of": str(batch.retry_of) if batch.retry_of else None,
    }


def _reader(conn: Connection | None, batch: queries.BatchRow) -> Connection:
    if conn is None:
        raise ValueError(f"the outcome of batch {batch.id} ({batch.state}, {batch.failed} failed) needs a connection")
    return conn


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


def failure_entry(row: queries.FailureRow, with_traceback: bool = False) -> dict[str, Any]:
    """One failed child as the outcome lists it: which child (index, task, its arguments) and why it failed.

    Arguments are included when the child was encoded as JSON, so the entry stays JSON-serialisable whatever
    serializer the successor uses; other serializers' arguments stay in Postgres only. `with_traceback`: with the
    child's traceback too (None if none was kept), for what reads the database; never in the successor's message.
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
    if with_traceback:
        entry["traceback"] = row.traceback
    if row.message.content_type == "application/json":
        try:
            sig = json.loads(row.message.body)
            entry["args"] = sig.get("args", [])
            entry["kwargs"] = sig.get("kwargs", {})
        except (ValueError, AttributeError):  # a hand-edited row: leave the arguments out rather than fail
            pass
    return entry
