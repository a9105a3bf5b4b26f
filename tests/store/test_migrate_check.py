"""`celery -A proj fanin migrate --check` and `--sql`, for deploy pipelines, against real databases left at an older
schema version: --check exits 1 when migrations are pending and 0 when the schema is current, --sql prints what
`migrate` would run, neither applies anything, and the printed SQL, run by hand, brings the schema to exactly what
`migrate` gives."""

from __future__ import annotations

from collections.abc import Callable

import psycopg
import pytest
from sqlalchemy import Engine, text

from celery_fanin.store import migrate
from tests.e2e.test_cli import celery

from .helpers import make_engine

ALL = migrate.available()
OLD = 12  # the version a database is left at, as an older release of celery-fanin leaves it
PENDING = [f"{m.version:04d}_{m.name}" for m in ALL[OLD:]]


def _schema(engine: Engine) -> dict[str, list[tuple[str, ...]]]:
    """What a migration changes: columns, indexes, constraints, functions (with their arguments) and versions."""
    queries = {
        "columns": "SELECT table_name, column_name, data_type, is_nullable, coalesce(column_default, '')"
        " FROM information_schema.columns WHERE table_schema = current_schema() ORDER BY 1, 2",
        "indexes": "SELECT tablename, indexname, indexdef FROM pg_indexes WHERE schemaname = current_schema()"
        " ORDER BY 1, 2",
        "constraints": "SELECT conrelid::regclass::text, conname, pg_get_constraintdef(oid) FROM pg_constraint"
        " WHERE connamespace = current_schema()::regnamespace ORDER BY 1, 2",
        "functions": "SELECT proname, pg_get_function_identity_arguments(oid), md5(prosrc) FROM pg_proc"
        " WHERE pronamespace = current_schema()::regnamespace ORDER BY 1, 2",
        "versions": "SELECT version::text, name FROM fanin_migrations ORDER BY fanin_migrations.version",
    }
    with engine.connect() as conn:
        return {k: [tuple(str(v) for v in row) for row in conn.execute(text(q))] for k, q in queries.items()}


@pytest.fixture
def old_db(fresh_db_url: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """A database migrated up to version OLD only, as the previous release left it."""
    with monkeypatch.context() as patch:
        patch.setattr(migrate, "available", lambda: ALL[:OLD])
        engine = make_engine(fresh_db_url)
        try:
            migrate.migrate(engine)
        finally:
            engine.dispose()
    return fresh_db_url


def test_check_and_sql_report_an_old_schema_and_apply_nothing(old_db: str, fresh_db: Callable[[], str]) -> None:
    env = {"FANIN_DATABASE_URL": old_db}
    engine = make_engine(old_db)
    try:
        before = _schema(engine)
        assert [v for v, _ in before["versions"]] == [str(v) for v in range(1, OLD + 1)]

        check = celery(env, "migrate", "--check")
        assert check.returncode == 1, check.stdout + check.stderr
        assert f"schema is behind: {len(PENDING)} pending migration(s): {', '.join(PENDING)}" in check.stdout

        sql = celery(env, "migrate", "--sql")
        assert sql.returncode == 0, sql.stderr
        assert sql.stdout.startswith(f"-- celery-fanin: {len(PENDING)} pending migration(s): {PENDING[0]}")
        for m in ALL[OLD:]:
            assert f"-- {m.version:04d}_{m.name}\n{m.sql.strip()}\n" in sql.stdout
        assert all(f"-- {m.version:04d}_{m.name}\n" not in sql.stdout for m in ALL[:OLD])
        assert "schema is behind" in sql.stderr  # the status goes to stderr: stdout is the script alone

        both = celery(env, "migrate", "--check", "--sql")
        assert (both.returncode, both.stdout) == (1, sql.stdout)

        assert _schema(engine) == before, "--check and --sql applied nothing"

        # The printed script, run by hand (as a DBA would with psql), gives what `migrate` gives.
        with psycopg.connect(old_db, autocommit=True) as conn:
            conn.execute(sql.stdout.encode())
        current = celery(env, "migrate", "--check")
        assert (current.returncode, current.stdout.strip()) == (0, "schema is up to date"), current.stderr
        assert celery(env, "migrate", "--sql").stdout == "-- celery-fanin: 0 pending migration(s)\n"
        reference_url = fresh_db()
        assert celery({"FANIN_DATABASE_URL": reference_url}, "migrate").returncode == 0
        reference = make_engine(reference_url)  # a database `migrate` brought up from nothing
        try:
            assert _schema(engine) == _schema(reference)
        finally:
            reference.dispose()
    finally:
        engine.dispose()


def test_check_on_an_empty_database_lists_every_migration(fresh_db_url: str) -> None:
    check = celery({"FANIN_DATABASE_URL": fresh_db_url}, "migrate", "--check")
    assert check.returncode == 1
    assert f"{len(ALL)} pending migration(s): 0001_initial" in check.stdout
    with psycopg.connect(fresh_db_url) as conn:  # not even the bookkeeping table was created
        assert conn.execute("SELECT to_regclass('fanin_migrations')").fetchone() == (None,)


def test_check_on_an_unreachable_database_fails_with_the_reason() -> None:
    check = celery({"FANIN_DATABASE_URL": "postgresql://nobody@127.0.0.1:1/none"}, "migrate", "--check")
    assert check.returncode == 1
    assert "could not read the fan-in schema's version" in check.stderr
