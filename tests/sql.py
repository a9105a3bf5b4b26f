"""Reading and editing the test database from a test: through an app's engine (`rows`), or a connection of its own
(`env_rows`); a batch's children and successor, whatever names the database (`children`, `successor`); the store's
runtime statements in a transaction the test holds (`Held`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import psycopg
from psycopg import sql as psycopg_sql
from psycopg.rows import dict_row
from sqlalchemy import Connection, Engine, text

from celery_fanin import FanIn
from celery_fanin.store.reports import libpq_conninfo
from celery_fanin.store.statements import Statement

# Statements a test sends through a `Runner` (a worker's report connection) to see or change its session.
BACKEND = Statement("backend", "the session's server process", "SELECT pg_backend_pid()")
READ_ONLY = Statement(
    "read_only",
    "the session refuses writes (25006), as after a failover",
    "SELECT set_config('default_transaction_read_only', 'on', false)",
)

# The successor predicates of migration 0034: plain SQL that the planner inlines, so not definer functions, and
# callable by PUBLIC (tests/store/test_predicates.py; the roles' tests leave them out).
SUCCESSOR_PREDICATES = (
    "fanin_successor_final",
    "fanin_successor_handed_over",
    "fanin_successor_lapsed",
    "fanin_successor_stalled",
)


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


def notes(env: dict[str, str]) -> list[tuple[str, Any]]:
    """What the test app's tasks noted (`e2e_notes`: label, value), in order."""
    return [(r[0], r[1]) for r in env_rows(env, "SELECT label, value FROM e2e_notes ORDER BY id")]


def _conninfo(db: Any) -> str:
    """A libpq conninfo for `db`: a URL, an environment (`FANIN_DATABASE_URL`), an engine, or an app wired with
    FanIn. (A SQLAlchemy connection the test holds is used as it is, in its transaction.)"""
    if isinstance(db, str):
        url = db
    elif isinstance(db, dict):
        url = db["FANIN_DATABASE_URL"]
    elif isinstance(db, Engine):
        url = db.url.render_as_string(hide_password=False)
    else:
        url = FanIn.of(db).database_url
    return libpq_conninfo(url)


def _select(db: Any, table: str, columns: tuple[str, ...], where: str, order: str, params: tuple[Any, ...]) -> Any:
    query = psycopg_sql.SQL("SELECT {} FROM {} WHERE {} ORDER BY {}").format(
        psycopg_sql.SQL(", ").join(psycopg_sql.Identifier(c) for c in columns) if columns else psycopg_sql.SQL("*"),
        psycopg_sql.Identifier(table),
        psycopg_sql.SQL(where),  # a constant of this module's
        psycopg_sql.SQL(order),
    )
    if isinstance(db, Connection):  # inside a transaction the test holds: what it sees, uncommitted rows too
        return [dict(r) for r in db.exec_driver_sql(query.as_string(), params).mappings()]
    with psycopg.connect(_conninfo(db), autocommit=True, row_factory=dict_row) as conn:
        return conn.execute(query, params).fetchall()


def children(
    db: Any, batch_id: Any = None, *columns: str, task_ids: Sequence[str] | None = None
) -> list[dict[str, Any]]:
    """These columns of a batch's child rows (a tree's leaves' children too), in child order; or of the children
    with these `task_ids`. `db`: a URL, an environment, an engine, an app, or a connection the test holds."""
    if task_ids is not None:
        return list(_select(db, "fanin_children", columns, "task_id = ANY(%s)", "idx", (list(task_ids),)))
    where = "batch_id IN (SELECT id FROM fanin_batches WHERE id = %s OR parent_id = %s)"
    return list(_select(db, "fanin_children", columns, where, "idx", (str(batch_id), str(batch_id))))


def successor(db: Any, batch_id: Any, *columns: str) -> dict[str, Any] | None:
    """These columns of a batch's successor row, or None before it was created. `db` as for `children`."""
    found = _select(db, "fanin_successors", columns, "batch_id = %s", "created_at", (str(batch_id),))
    assert len(found) <= 1, found
    return found[0] if found else None


def child_ids(db: Any, batch_id: Any) -> list[str]:
    """A batch's children's task ids (a tree's leaves' too), in child order. `db` as for `children`."""
    return [r["task_id"] for r in children(db, batch_id, "task_id")]


def batch(db: Any, batch_id: Any, *columns: str) -> dict[str, Any]:
    """These columns of one batch's row, or all of them (AssertionError if there is none). `db` as for
    `children`."""
    [row] = _select(db, "fanin_batches", columns, "id = %s", "id", (str(batch_id),))
    return dict(row)


def outbox(db: Any, batch_id: Any, *columns: str) -> list[dict[str, Any]]:
    """These columns of a batch's outbox rows, oldest first. `db` as for `children`."""
    return list(_select(db, "fanin_outbox", columns, "batch_id = %s", "id", (str(batch_id),)))


def row_count(db: Any, table: str) -> int:
    """How many rows `table` holds. `db` as for `children`."""
    query = psycopg_sql.SQL("SELECT count(*) AS n FROM {}").format(psycopg_sql.Identifier(table))
    if isinstance(db, Connection):
        return int(db.exec_driver_sql(query.as_string()).scalar_one())
    with psycopg.connect(_conninfo(db), autocommit=True) as conn:
        row = conn.execute(query).fetchone()
        assert row is not None
        return int(row[0])


def unpublish(db: Any, batch_id: Any) -> int:
    """Mark a batch's children unpublished, as if its producer died after its commit and before publishing them:
    the relay publishes them. `db` as for `children`."""
    return _write(db, "UPDATE fanin_batches SET published_upto = 0 WHERE id = %s", (str(batch_id),))


def _write(db: Any, query: str, params: tuple[Any, ...]) -> int:
    if isinstance(db, Connection):
        return int(db.exec_driver_sql(query, params).rowcount)
    with psycopg.connect(_conninfo(db), autocommit=True) as conn:
        return conn.execute(query, params).rowcount


def unsend_outbox(db: Any, batch_id: Any) -> int:
    """Mark a batch's outbox rows unsent, as if their publish was lost with the relay that made it: the relay
    publishes them again. How many rows. `db` as for `children`."""
    return _write(db, "UPDATE fanin_outbox SET sent_at = NULL WHERE batch_id = %s", (str(batch_id),))


def drop_outbox(db: Any, batch_id: Any) -> int:
    """Delete a batch's outbox rows (a successor that nothing would publish: what reconciliation repairs). How many
    rows. `db` as for `children`."""
    return _write(db, "DELETE FROM fanin_outbox WHERE batch_id = %s", (str(batch_id),))


def open_gate(db: Any, key: str) -> None:
    """Let the test app's `gated` task under `key` return (tests/app.py: it polls for `<key>:open`)."""
    _write(db, "INSERT INTO e2e_attempts (key, n) VALUES (%s, 1)", (f"{key}:open",))


def child_states(db: Any, batch_id: Any) -> dict[str, int]:
    """How many of a batch's children are in each state. `db` as for `children`."""
    return dict(Counter(r["state"] for r in children(db, batch_id, "state")))
