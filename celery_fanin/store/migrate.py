"""Versioned schema migrations, applied in order under an advisory lock.

Migrations are plain SQL files named ``NNNN_name.sql`` beside this module. `migrate` is safe to run twice and
concurrently: every run takes the same transaction-level advisory lock, then applies only the versions that
`fanin_migrations` does not list yet, each in the same transaction as its bookkeeping row.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any, Protocol

from sqlalchemy import Engine, text

# An arbitrary constant that identifies "the celery-fanin schema" among advisory locks.
_MIGRATION_LOCK = 0x66616E696E  # "fanin"
_NAME = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str


def available() -> list[Migration]:
    """All migrations shipped with the package, oldest first."""
    found = []
    for entry in resources.files("celery_fanin.store.migrations").iterdir():
        match = _NAME.match(entry.name)
        if match:
            found.append(Migration(int(match.group(1)), match.group(2), entry.read_text(encoding="utf-8")))
    return sorted(found, key=lambda m: m.version)


def applied(engine: Engine) -> list[int]:
    """Versions already applied (empty on a fresh database)."""
    with engine.connect() as conn:
        exists = conn.execute(text("SELECT to_regclass('fanin_migrations') IS NOT NULL")).scalar_one()
        if not exists:
            return []
        return list(conn.execute(text("SELECT version FROM fanin_migrations ORDER BY version")).scalars())


def migrate(engine: Engine) -> list[Migration]:
    """Bring the schema up to date; returns the migrations this call applied (none when already current)."""
    # READ COMMITTED whatever the engine's default: a waiter's next statement must see what the lock holder did.
    with (
        engine.connect().execution_options(isolation_level="READ COMMITTED") as conn,
        conn.begin(),
        conn.connection.dbapi_connection.cursor() as cursor,  # type: ignore[union-attr]
    ):
        return apply_pending(cursor)


class Cursor(Protocol):
    """What `apply_pending` needs of a DB-API cursor (psycopg's, or Django's wrapper of it)."""

    def execute(self, sql: str, params: Sequence[Any] | None = None, /) -> Any: ...

    def fetchall(self) -> Sequence[Sequence[Any]]: ...


def apply_pending(cursor: Cursor) -> list[Migration]:
    """Apply the migrations not applied yet in the cursor's transaction, which the caller commits: `migrate`'s, or
    the one a Django migration runs in (`celery_fanin.django`). Returns what it applied."""
    cursor.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK,))
    cursor.execute(
        "CREATE TABLE IF NOT EXISTS fanin_migrations ("
        " version integer PRIMARY KEY, name text NOT NULL,"
        " applied_at timestamptz NOT NULL DEFAULT now())"
    )
    cursor.execute("SELECT version FROM fanin_migrations")
    have = {int(row[0]) for row in cursor.fetchall()}
    done: list[Migration] = []
    for migration in available():
        if migration.version in have:
            continue
        # Without parameters, so `%` in PL/pgSQL (`%ROWTYPE`) is not taken for a placeholder.
        cursor.execute(migration.sql)
        cursor.execute(
            "INSERT INTO fanin_migrations (version, name) VALUES (%s, %s)", (migration.version, migration.name)
        )
        done.append(migration)
    return done


def is_current(engine: Engine) -> bool:
    return set(applied(engine)) >= {m.version for m in available()}


def pending(engine: Engine) -> list[Migration]:
    """The migrations `migrate` would apply now, oldest first (reads only: for `migrate --check` and `--sql`)."""
    have = set(applied(engine))
    return [m for m in available() if m.version not in have]
