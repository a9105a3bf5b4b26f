"""Reading and editing the test database from a test, through the producer app's engine."""

from __future__ import annotations

from typing import Any

from sqlalchemy import text

from celery_fanin import FanIn


def rows(app: Any, sql: str, **params: Any) -> list[Any]:
    """Run one statement in its own transaction; the rows it returns (none for a statement without)."""
    with FanIn.of(app).engine.begin() as conn:
        result = conn.execute(text(sql), params)
        return list(result) if result.returns_rows else []


def counters(app: Any, batch_id: str) -> tuple[str, int, int, int]:
    """A batch's (state, remaining, succeeded, failed) as its row says."""
    [row] = rows(app, "SELECT state, remaining, succeeded, failed FROM fanin_batches WHERE id = :b", b=batch_id)
    return row.state, row.remaining, row.succeeded, row.failed
