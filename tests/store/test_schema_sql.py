"""`store/sql/schema.sql` is exactly what the migrations produce, and no function is overloaded."""

from __future__ import annotations

import difflib
from collections.abc import Callable
from importlib import resources

import psycopg
import pytest

from celery_fanin.store import migrate

from .catalog import describe
from .helpers import make_engine

SCHEMA_SQL = resources.files("celery_fanin.store") / "sql" / "schema.sql"


def _migrated(url: str) -> None:
    engine = make_engine(url)
    try:
        migrate.migrate(engine)
    finally:
        engine.dispose()


@pytest.mark.timeout(120)
def test_migrations_from_empty_produce_exactly_schema_sql(fresh_db: Callable[[], str]) -> None:
    from_file, from_migrations = fresh_db(), fresh_db()
    with psycopg.connect(from_file, autocommit=True) as conn:
        conn.execute(SCHEMA_SQL.read_text(encoding="utf-8"))  # no parameters: `%` stays literal
    _migrated(from_migrations)
    expected, got = describe(from_migrations), describe(from_file)
    assert len(expected) > 100, "the description reads the schema"
    diff = "\n".join(difflib.unified_diff(expected, got, "migrations", "schema.sql", lineterm="", n=2))
    assert not diff, f"store/sql/schema.sql differs from what the migrations produce:\n{diff}"


@pytest.mark.timeout(120)
def test_functions_are_versioned_by_name_not_overloaded(fresh_db: Callable[[], str]) -> None:
    url = fresh_db()
    _migrated(url)
    with psycopg.connect(url) as conn:
        overloaded = conn.execute(
            "SELECT proname, count(*) FROM pg_proc WHERE pronamespace = 'public'::regnamespace"
            " AND left(proname, 6) = 'fanin_' GROUP BY proname HAVING count(*) > 1"
        ).fetchall()
        unused = conn.execute("SELECT to_regproc('fanin_record_start'), to_regproc('fanin_record_terminal')").fetchone()
    assert overloaded == [], "a changed signature gets a new name (`_v2`), never a second overload"
    assert unused == (None, None), "the unused and superseded functions are dropped (versioned_functions)"
