"""A transaction-mode pooler in front of PostgreSQL is detected before a worker or relay starts, against a real
PgBouncer (Debian's package; CI installs it) in session and in transaction mode."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from celery import Celery
from sqlalchemy.engine import make_url

from celery_fanin import FanIn
from celery_fanin.exceptions import FanInNotConfigured
from celery_fanin.relay import Relay
from celery_fanin.store.pooler import transaction_pooled
from tests.cluster import free_port

pytestmark = pytest.mark.timeout(60)
ROOT = Path(__file__).resolve().parents[2]


def _pgbouncer(database_url: str, mode: str) -> Iterator[str]:
    binary = shutil.which("pgbouncer") or ("/usr/sbin/pgbouncer" if os.path.exists("/usr/sbin/pgbouncer") else None)
    if binary is None:
        if os.environ.get("CI"):
            pytest.fail("pgbouncer is not installed (.ci/run installs Debian's package)", pytrace=False)
        pytest.skip("pgbouncer is not installed: apt-get install pgbouncer")
    url = make_url(database_url)
    port = free_port()
    # PgBouncer will not run as root: it switches to the postgres user, which must reach and write this folder
    # (pytest's own tmp_path is private to root).
    tmp_path = Path(tempfile.mkdtemp(prefix="fanin-pgbouncer-"))
    tmp_path.chmod(0o777)
    (tmp_path / "users.txt").write_text(f'"{url.username}" ""\n')
    (tmp_path / "pgbouncer.ini").write_text(
        f"""[databases]
{url.database} = host={url.host} port={url.port or 5432} dbname={url.database}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {port}
unix_socket_dir =
auth_type = trust
auth_file = {tmp_path / "users.txt"}
pool_mode = {mode}
default_pool_size = 4
logfile = {tmp_path / "pgbouncer.log"}
pidfile = {tmp_path / "pgbouncer.pid"}
"""
    )
    for name in ("users.txt", "pgbouncer.ini"):
        (tmp_path / name).chmod(0o644)
    args = [binary, str(tmp_path / "pgbouncer.ini")]
    if os.geteuid() == 0:
        args[1:1] = ["-u", "postgres"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    pooled = url.set(port=port).render_as_string(hide_password=False)
    deadline = time.monotonic() + 15
    while True:
        try:
            with psycopg.connect(pooled.replace("+psycopg", ""), connect_timeout=2) as conn:
                conn.execute("SELECT 1")
            break
        except psycopg.OperationalError:
            if proc.poll() is not None or time.monotonic() > deadline:
                log = (tmp_path / "pgbouncer.log").read_text() if (tmp_path / "pgbouncer.log").exists() else ""
                out = proc.stdout.read().decode() if proc.stdout and proc.poll() is not None else ""
                proc.kill()
                shutil.rmtree(tmp_path, ignore_errors=True)
                pytest.fail(f"pgbouncer did not start: {out}\n{log}", pytrace=False)
            time.sleep(0.1)
    try:
        yield pooled
    finally:
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(tmp_path, ignore_errors=True)


@pytest.fixture
def transaction_pooler(database_url: str) -> Iterator[str]:
    yield from _pgbouncer(database_url, "transaction")


@pytest.fixture
def session_pooler(database_url: str) -> Iterator[str]:
    yield from _pgbouncer(database_url, "session")


def test_a_direct_connection_and_session_pooling_pass(database_url: str, session_pooler: str) -> None:
    assert transaction_pooled(database_url) is False
    assert transaction_pooled(session_pooler) is False


def test_transaction_pooling_is_detected_and_the_relay_refuses_to_start(transaction_pooler: str) -> None:
    assert transaction_pooled(transaction_pooler) is True
    app = Celery("pooled", set_as_current=False)
    app.conf.fanin_database_url = transaction_pooler
    fanin = FanIn(app)
    try:
        with pytest.raises(FanInNotConfigured, match="transaction"):
            Relay(fanin).run()
        app.conf.fanin_check_pooler = False  # the documented way out, for a pooler the user vouches for
        fanin.check_session_pooling()
    finally:
        fanin.dispose()


def test_a_worker_behind_a_transaction_pooler_exits_with_the_reason(transaction_pooler: str, clean_redis: str) -> None:
    env = {**os.environ, "FANIN_DATABASE_URL": transaction_pooler, "FANIN_TEST_BROKER": clean_redis}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "tests.app",
            "worker",
            "-P",
            "solo",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
            "-l",
            "INFO",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=45,
    )
    assert done.returncode != 0
    assert "transaction (or statement) mode" in done.stdout + done.stderr
