"""`celery_fanin.store.migrate`: versions applied once, idempotent, safe to race, and the tables of `schema.sql`
(whose whole catalog `test_schema_sql.py` compares with the migrations')."""

from __future__ import annotations

import re
import threading
import uuid
from collections import Counter
from importlib import resources

import psycopg
from sqlalchemy import Engine, inspect, text
from sqlalchemy.dialects import postgresql

from celery_fanin.store import migrate

from .helpers import create, make_engine, process_migrator, run_spawned

# The tables `store/sql/schema.sql` creates (the file every schema test reads; `fanin_migrations` is migrate's own).
SCHEMA_TABLES = set(
    re.findall(
        r"^CREATE TABLE (fanin_\w+)",
        (resources.files("celery_fanin.store") / "sql" / "schema.sql").read_text(encoding="utf-8"),
        re.M,
    )
)

SHIPPED = [(m.version, m.name) for m in migrate.available()]
EXPECTED_VERSIONS = [v for v, _ in SHIPPED]


def _versions(engine: Engine) -> list[tuple[int, str]]:
    with engine.connect() as conn:
        return [tuple(r) for r in conn.execute(text("SELECT version, name FROM fanin_migrations ORDER BY version"))]


def _fanin_tables(engine: Engine) -> set[str]:
    return {t for t in inspect(engine).get_table_names() if t.startswith("fanin_")}


def test_available_migrations_are_numbered_in_order() -> None:
    found = migrate.available()
    # 0001, 0002, ...: no gaps, no duplicates, oldest first, starting with the initial schema.
    assert [m.version for m in found] == list(range(1, len(found) + 1))
    assert (found[0].version, found[0].name) == (1, "initial")
    assert "CREATE TABLE fanin_batches" in found[0].sql


def test_fresh_database_gets_0001_then_nothing(fresh_db_url: str) -> None:
    engine = make_engine(fresh_db_url)
    try:
        assert migrate.applied(engine) == []
        assert not migrate.is_current(engine)
        assert _fanin_tables(engine) == set()

        applied = migrate.migrate(engine)
        assert [(m.version, m.name) for m in applied] == SHIPPED
        assert applied[0].version == 1  # 0001 first
        assert migrate.applied(engine) == EXPECTED_VERSIONS
        assert migrate.is_current(engine)
        assert _versions(engine) == SHIPPED
        assert _fanin_tables(engine) == SCHEMA_TABLES | {"fanin_migrations"}

        # A second run finds every version recorded and applies nothing (running 0001 again would fail loudly).
        assert migrate.migrate(engine) == []
        assert _versions(engine) == SHIPPED
    finally:
        engine.dispose()


def _migrated_by_an_older_release(engine: Engine, upto: int) -> None:
    """The database an older release left: versions 1..`upto` and their bookkeeping only."""
    with engine.begin() as conn:
        conn.execute(
            text(
                "CREATE TABLE fanin_migrations (version integer PRIMARY KEY, name text NOT NULL,"
                " applied_at timestamptz NOT NULL DEFAULT now())"
            )
        )
        for m in migrate.available():
            if m.version > upto:
                break
            with conn.connection.dbapi_connection.cursor() as cursor:  # type: ignore[union-attr]
                cursor.execute(m.sql)  # no parameters: `%ROWTYPE` is not a placeholder
            conn.execute(
                text("INSERT INTO fanin_migrations (version, name) VALUES (:v, :n)"), {"v": m.version, "n": m.name}
            )


def test_database_at_0001_is_upgraded_with_the_later_versions_only(fresh_db_url: str) -> None:
    engine = make_engine(fresh_db_url)
    try:
        _migrated_by_an_older_release(engine, 1)
        assert [(m.version, m.name) for m in migrate.migrate(engine)] == SHIPPED[1:]
        assert _versions(engine) == SHIPPED
    finally:
        engine.dispose()


def test_concurrent_migrate_from_threads_applies_each_version_once(fresh_db_url: str) -> None:
    n = 4
    engines = [make_engine(fresh_db_url, pool_size=1) for _ in range(n)]
    barrier = threading.Barrier(n, timeout=30)
    results: list[list[int]] = [[] for _ in range(n)]
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            with engines[i].connect() as conn:  # connected before the start line, so the race is on migrate itself
                conn.execute(text("SELECT 1"))
            barrier.wait()
            results[i] = [m.version for m in migrate.migrate(engines[i])]
        except BaseException as exc:
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads)
        assert errors == []
        applied = Counter(v for r in results for v in r)
        assert applied == Counter(EXPECTED_VERSIONS), f"per-thread results: {results}"
        assert sum(1 for r in results if r) == 1, f"exactly one thread should have applied the schema: {results}"
        assert results[[bool(r) for r in results].index(True)] == EXPECTED_VERSIONS
        assert _versions(engines[0]) == SHIPPED
    finally:
        for e in engines:
            e.dispose()


def test_concurrent_migrate_from_processes_applies_each_version_once(fresh_db_url: str) -> None:
    n = 3
    outcomes = run_spawned(process_migrator, [(fresh_db_url,)] * n)
    assert Counter(v for versions in outcomes for v in versions) == Counter(EXPECTED_VERSIONS), outcomes
    assert sum(1 for versions in outcomes if versions) == 1, outcomes
    engine = make_engine(fresh_db_url)
    try:
        assert _versions(engine) == SHIPPED
    finally:
        engine.dispose()


def _type_sql(column_type: object) -> str:
    return column_type.compile(dialect=postgresql.dialect())  # type: ignore[attr-defined]


def _foreign_keys(table: object) -> set[tuple[str, str, str | None]]:
    return {
        (fk.parent.name, fk.target_fullname, fk.ondelete and fk.ondelete.upper())
        for fk in table.foreign_keys  # type: ignore[attr-defined]
    }


def test_0009_lets_every_role_that_settled_before_settle_after(fresh_db_url: str) -> None:
    """fanin_settle runs with its caller's privileges and 0009 makes it write a new column: a role granted the
    counters before the upgrade (grants.sql of an older release) may write that column after it."""
    role = f"fanin_upgrade_{uuid.uuid4().hex[:8]}"
    engine = make_engine(fresh_db_url)
    try:
        _migrated_by_an_older_release(engine, 8)
        with engine.begin() as conn:  # and its grants run
            conn.exec_driver_sql(f'CREATE ROLE "{role}"')  # a generated identifier
            conn.exec_driver_sql(f'GRANT UPDATE (remaining, succeeded, failed, state) ON fanin_batches TO "{role}"')
        assert [m.version for m in migrate.migrate(engine)] == [v for v in EXPECTED_VERSIONS if v > 8]
        with engine.connect() as conn:
            allowed = conn.execute(
                text("SELECT has_column_privilege(:r, 'fanin_batches', 'last_settle_moved', 'UPDATE')"), {"r": role}
            ).scalar_one()
        assert allowed
    finally:
        with engine.begin() as conn:
            if conn.execute(text("SELECT 1 FROM pg_roles WHERE rolname = :r"), {"r": role}).first():
                conn.exec_driver_sql(f'DROP OWNED BY "{role}"')
                conn.exec_driver_sql(f'DROP ROLE "{role}"')
        engine.dispose()


def _drop_roles(engine: Engine, *roles: str) -> None:
    """Drop the roles an upgrade test created (those it got to), and the engine."""
    with engine.begin() as conn:
        for role in roles:
            if conn.execute(text("SELECT 1 FROM pg_roles WHERE rolname = :r"), {"r": role}).first():
                conn.exec_driver_sql(f'DROP OWNED BY "{role}"')
                conn.exec_driver_sql(f'DROP ROLE "{role}"')
    engine.dispose()


def test_0025_lets_every_role_that_reported_before_report_after(fresh_db_url: str) -> None:
    """The workers' report statement calls fanin_handed_off from 0025 on: each role granted fanin_report_terminal
    before the upgrade (grants.sql of an older release) may call it after the migration, before grants.sql runs
    again; a role that could not report, and PUBLIC, may not."""
    suffix = uuid.uuid4().hex[:8]
    worker, other = f"fanin_upgrade_w_{suffix}", f"fanin_upgrade_o_{suffix}"
    report = (
        "fanin_report_terminal(text, uuid, integer, text, text, bytea, text, text, text, text, timestamptz, integer, "
        "text)"
    )
    engine = make_engine(fresh_db_url)
    try:
        _migrated_by_an_older_release(engine, 24)
        with engine.begin() as conn:  # and its grants run
            for role in (worker, other):
                conn.exec_driver_sql(f'CREATE ROLE "{role}"')  # generated identifiers
            conn.exec_driver_sql(f'GRANT EXECUTE ON FUNCTION {report} TO "{worker}"')
        assert [m.version for m in migrate.migrate(engine)] == [v for v in EXPECTED_VERSIONS if v > 24]
        with engine.connect() as conn:
            may = {
                role: conn.execute(
                    text("SELECT has_function_privilege(:r, 'fanin_handed_off(uuid)', 'EXECUTE')"), {"r": role}
                ).scalar_one()
                for role in (worker, other)
            }
            public = conn.execute(
                text(
                    "SELECT count(*) FROM pg_proc p, aclexplode(p.proacl) a"
                    " WHERE p.oid = 'fanin_handed_off(uuid)'::regprocedure AND a.grantee = 0"
                )
            ).scalar_one()
        assert may == {worker: True, other: False} and public == 0
    finally:
        _drop_roles(engine, worker, other)


def test_0032_keeps_the_workers_of_the_version_before_reporting_and_handing_off(fresh_db_url: str) -> None:
    """0032 makes the hand-off an argument of `fanin_report_terminal_v2`. Between the migration and their restart,
    the workers of version 31 go on: a role granted the old report functions may call the new ones (before
    grants.sql runs again), and the old `fanin_report_terminal`, which those workers still call with their session
    settings, hands a completed batch's successor to them as it did; without the settings it leaves it to the
    relay, due at once."""
    suffix = uuid.uuid4().hex[:8]
    worker, other = f"fanin_upgrade_w_{suffix}", f"fanin_upgrade_o_{suffix}"
    old = (
        "fanin_report_terminal(text, uuid, integer, text, text, bytea, text, text, text, text, timestamptz, integer,"
        " text)"
    )
    old_unrun = "fanin_report_unrun(text, uuid, integer, text, text, text, text)"
    new = {
        "fanin_report_terminal_v2(text, uuid, integer, text, text, bytea, text, text, text, text, timestamptz, integer,"
        " text, double precision)",
        "fanin_report_unrun_v2(text, uuid, integer, text, text, text, text, double precision)",
    }
    engine = make_engine(fresh_db_url)
    try:
        _migrated_by_an_older_release(engine, 31)
        with engine.begin() as conn:
            for role in (worker, other):
                conn.exec_driver_sql(f'CREATE ROLE "{role}"')  # generated identifiers
            conn.exec_driver_sql(f'GRANT EXECUTE ON FUNCTION {old} TO "{worker}"')
            conn.exec_driver_sql(f'GRANT EXECUTE ON FUNCTION {old_unrun} TO "{worker}"')
        assert [m.version for m in migrate.migrate(engine)] == [v for v in EXPECTED_VERSIONS if v > 31]
        with engine.connect() as conn:
            for fn in new:
                may = {
                    role: conn.execute(
                        text("SELECT has_function_privilege(:r, :f, 'EXECUTE')"), {"r": role, "f": fn}
                    ).scalar_one()
                    for role in (worker, other)
                }
                assert may == {worker: True, other: False}, fn

        due: dict[bool, bool] = {}
        for publishes in (True, False):
            batch, children, _ = create(engine, 1)
            with engine.begin() as conn:
                if publishes:  # what a worker of version 31 said once per session
                    conn.execute(text("SELECT set_config('fanin.successor_publisher', 'worker', true)"))
                    conn.execute(text("SELECT set_config('fanin.successor_handoff', '30', true)"))
                counted, created = conn.execute(
                    text(
                        "SELECT counted, successor_created FROM fanin_report_terminal(:t, :b, 0, :n, 'succeeded',"
                        " NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL)"
                    ),
                    {"t": children[0].task_id, "b": batch.id, "n": children[0].task_name},
                ).one()
                assert counted and created
                due[publishes] = conn.execute(
                    text("SELECT available_at <= now() FROM fanin_outbox WHERE batch_id = :b"), {"b": batch.id}
                ).scalar_one()
        assert due == {True: False, False: True}, "handed to the old worker for 30 s; else the relay's at once"
    finally:
        _drop_roles(engine, worker, other)


def test_0033_lets_the_producers_of_the_version_before_wake_the_relay(fresh_db_url: str) -> None:
    """0033 sends every NOTIFY through `fanin_notify_relay`, which the producer's statement now calls: a role that
    could add children before the upgrade (grants.sql of an older release) may call it after, before grants.sql runs
    again; a role that could not, and PUBLIC, may not. The functions that sent their own NOTIFY still wake the relay
    on its channel."""
    suffix = uuid.uuid4().hex[:8]
    producer, other = f"fanin_upgrade_p_{suffix}", f"fanin_upgrade_o_{suffix}"
    add = "fanin_add_children(uuid, uuid[], integer[], integer, integer, bytea)"
    engine = make_engine(fresh_db_url)
    try:
        _migrated_by_an_older_release(engine, 32)
        with engine.begin() as conn:
            for role in (producer, other):
                conn.exec_driver_sql(f'CREATE ROLE "{role}"')  # generated identifiers
            conn.exec_driver_sql(f'GRANT EXECUTE ON FUNCTION {add} TO "{producer}"')
        assert [m.version for m in migrate.migrate(engine)] == [v for v in EXPECTED_VERSIONS if v > 32]
        with engine.connect() as conn:
            may = {
                role: conn.execute(
                    text("SELECT has_function_privilege(:r, 'fanin_notify_relay(text)', 'EXECUTE')"), {"r": role}
                ).scalar_one()
                for role in (producer, other)
            }
            public = conn.execute(
                text(
                    "SELECT count(*) FROM pg_proc p, aclexplode(p.proacl) a"
                    " WHERE p.oid = 'fanin_notify_relay(text)'::regprocedure AND a.grantee = 0"
                )
            ).scalar_one()
        assert may == {producer: True, other: False} and public == 0

        batch, _, _ = create(engine, 0)  # an empty batch: its successor created, the relay woken with its row's id
        listener = psycopg.connect(fresh_db_url, autocommit=True)
        try:
            listener.execute("LISTEN fanin_outbox")
            with engine.begin() as conn:
                conn.execute(text("SELECT fanin_wake_relay(:b)"), {"b": batch.id})
                conn.execute(text("SELECT fanin_notify_relay(:p)"), {"p": f"batch:{batch.id}"})
            payloads = [n.payload for n in listener.notifies(timeout=5, stop_after=2)]
        finally:
            listener.close()
        assert payloads == ["", f"batch:{batch.id}"]
    finally:
        _drop_roles(engine, producer, other)
