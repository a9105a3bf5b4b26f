"""Timeouts and deadlines made to pass at a moment a test chooses, instead of a few seconds it races.

A test that wants a child counted lost (or a deadline reached) sets an hour-long timeout, waits until the children
that must not be caught by it have finished, then moves the batch's clock back in PostgreSQL: the relay's reaper
reads these columns on every pass, so it sees the time as gone by. A slow machine then makes the test slower, never
wrong: no healthy child is counted lost because it took longer than 2 s to run.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import text

from celery_fanin import FanIn
from tests.workers import wait_for

LONG = 3600  # seconds: a timeout or deadline no test run reaches by itself
AGE_STARTS = """
    UPDATE fanin_children c SET started_at = c.started_at - b.child_timeout - interval '1 second',
                                redriven_at = c.redriven_at - b.child_timeout - interval '1 second'
      FROM fanin_batches b
     WHERE b.id = c.batch_id AND (c.started_at IS NOT NULL OR c.redriven_at IS NOT NULL)
       AND c.batch_id IN (SELECT id FROM fanin_batches WHERE id = :b OR parent_id = :b)
"""
# The batch and, for a tree, its leaves (whose rows hold its children).
AGE_BATCH = """
    UPDATE fanin_batches SET created_at = created_at - child_timeout - interval '1 second'
     WHERE (id = :b OR parent_id = :b) AND child_timeout IS NOT NULL
"""


def finished(app: Any, batch_id: str) -> set[int]:
    """The indexes of the batch's children (a tree's too) that succeeded or failed."""
    with FanIn.of(app).engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT idx FROM fanin_children WHERE state IN ('succeeded', 'failed')"
                " AND batch_id IN (SELECT id FROM fanin_batches WHERE id = :b OR parent_id = :b)"
            ),
            {"b": batch_id},
        ).all()
    return {r.idx for r in rows}


def wait_finished(app: Any, batch_id: str, indexes: set[int], timeout: float = 60) -> None:
    wait_for(lambda: indexes <= finished(app, batch_id), timeout, message=f"children {sorted(indexes)} to finish")


def expire_child_timeout(app: Any, batch_id: str) -> None:
    """Every unfinished child of the batch is now past its child_timeout (since creation, its last start or its
    last redrive)."""
    with FanIn.of(app).engine.begin() as conn:
        conn.execute(text(AGE_STARTS), {"b": batch_id})
        updated = conn.execute(text(AGE_BATCH), {"b": batch_id}).rowcount
    assert updated >= 1, f"batch {batch_id} has no child_timeout"


def pass_deadline(app: Any, batch_id: str) -> None:
    """The batch's deadline is now."""
    with FanIn.of(app).engine.begin() as conn:
        updated = conn.execute(
            text("UPDATE fanin_batches SET deadline_at = now() WHERE id = :b AND deadline_at IS NOT NULL"),
            {"b": batch_id},
        ).rowcount
    assert updated == 1, f"batch {batch_id} has no deadline"
