"""Versioned schema migrations, applied in order under an advisory lock.

Migrations are plain SQL files named ``NNNN_name.sql`` beside this module. `migrate` is safe to run twice and
concurrently: every run takes the same transaction-level advisory lock, then applies only the versions that
`fanin_migrations` does not list yet, each in the same transaction as its bookkeeping row.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import resources

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
    done: list[Migration] = []
    # READ COMMITTED whatever the engine's default: a waiter's next statement must see what the lock holder did.
    with engine.connect().execution_options(isolation_level="READ COMMITTED") as conn, conn.begin():
        conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _MIGRATION_LOCK})
        conn.execute(
            text(
                "CREATE TABLE IF NOT EXISTS fanin_migrations ("
                " version integer PRIMARY KEY, name text NOT NULL,"
                " applied_at timestamptz NOT NULL DEFAULT now())"
            )
        )
        have = set(conn.execute(text("SELECT version FROM fanin_migrations")).scalars())
        for migration in available():
            if migration.version in have:
                continue
            # Straight to the driver without parameters, so `%` in PL/pgSQL (`%ROWTYPE`) is not a placeholder.
            with conn.connection.dbapi_connection.cursor() as cursor:  # type: ignore[union-attr]
                cursor.execute(migration.sql)
            conn.execute(
                text("INSERT INTO fanin_migrations (version, name) VALUES (:v, :n)"),
                {"v": migration.version, "n": migration.name},
            )
            done.append(migration)
    return done


def is_current(engine: Engine) -> bool:
    return set(applied(engine)) >= {m.version for m in available()}


def pending(engine: Engine) -> list[Migration]:
    """The migrations `migrate` would apply now, oldest first (reads only: for `migrate --check` and `--sql`)."""
    have = set(applied(engine))
    return [m for m in available() if m.version not in have]
