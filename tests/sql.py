"""Reading and editing the test database from a test: through an app's engine (`rows`), or a connection of its own
(`env_rows`); the store's runtime statements in a transaction the test holds (`Held`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import psycopg
from sqlalchemy import Connection, text

from celery_fanin import FanIn
from celery_fanin.store.statements import Statement


def rows(app: Any, sql: str, **params: Any) -> list[Any]:
    """Run one statement in its own transaction; the rows it returns (none for a statement without)."""
    with FanIn.of(app).engine.begin() as conn:
        result = conn.execute(text(sql), params)
        return list(result) if result.returns_rows else []


def env_rows(env: dict[str, str], query: str, *params: Any) -> list[tuple[Any, ...]]:
    """`query` (psycopg placeholders) on a connection of its own to the test database `env` names, committed."""
    with psycopg.connect(env["FANIN_DATABASE_URL"], autocommit=True) as conn:
        cur = conn.execute(query, params)
        return cur.fetchall() if cur.description is not None else []


def counters(app: Any, batch_id: str) -> tuple[str, int, int, int]:
    """A batch's (state, remaining, succeeded, failed) as its row says."""
    [row] = rows(app, "SELECT state, remaining, succeeded, failed FROM fanin_batches WHERE id = :b", b=batch_id)
    return row.state, row.remaining, row.succeeded, row.failed


def child(app: Any, batch_id: str, index: int) -> Any:
    """One child's row: its state, and the late reports recorded after it was counted."""
    [row] = rows(
        app,
        "SELECT state, late_state, late_reports, exc_type, starts FROM fanin_children WHERE batch_id = :b AND idx = :i",
        b=batch_id,
        i=index,
    )
    return row


def attempts(app: Any, key: str) -> int:
    """How many times a task body counted itself under `key` in `e2e_attempts` (tests/app.py `_attempt`)."""
    found = rows(app, "SELECT n FROM e2e_attempts WHERE key = :k", k=key)
    return int(found[0].n) if found else 0


class Held:
    """A `store.statements.Runner` over a SQLAlchemy connection the test holds (its transaction, committed by the
    test): runs the store's runtime functions (`store.reports.record_terminal`, `store.successors.claim_run`, ...)
    with the statements the worker's `ReportConnection` sends, through psycopg as well, inside a transaction the
    test (or the protocol model) decides when to commit."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def one(self, statement: Statement, params: Mapping[str, object]) -> tuple[Any, ...]:
        return tuple(self.conn.exec_driver_sql(statement.psycopg, dict(params)).one())

    def all(self, statement: Statement, params: Mapping[str, object]) -> list[tuple[Any, ...]]:
        return [tuple(r) for r in self.conn.exec_driver_sql(statement.psycopg, dict(params))]
