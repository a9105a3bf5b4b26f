"""A worker or relay started on a database without the fan-in schema, or with an older one, stops at once and
says to run `celery -A proj fanin migrate`, instead of failing at its first report or round. Real `celery worker`
and `celery fanin relay` subprocesses on databases of the test's own (`fresh_db`)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable

import psycopg
import pytest

from celery_fanin.ops import schema
from celery_fanin.store import migrate
from tests.workers import ROOT

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(90)]

WORKER = ["worker", "-P", "solo", "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "INFO"]
RELAY = ["fanin", "relay", "--poll-interval", "0.2"]


def _run(args: list[str], database_url: str, broker: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "FANIN_DATABASE_URL": database_url, "FANIN_TEST_BROKER": broker, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "celery", "-A", "tests.app", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=45,  # a process that started instead of stopping is a failure, not a hang
    )


def _older(url: str) -> str:
    """`url` migrated to the version before the newest, as `fanin migrate --sql` would have applied it then."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(schema.script(migrate.available()[:-1]).encode())
    return url


@pytest.mark.parametrize("args", [WORKER, RELAY, [*RELAY, "--once"]], ids=["worker", "relay", "relay-once"])
@pytest.mark.parametrize("database", ["unmigrated", "older"])
def test_a_worker_or_relay_on_an_unmigrated_or_older_schema_stops_and_says_migrate(
    fresh_db: Callable[[], str], clean_redis: str, args: list[str], database: str
) -> None:
    url = fresh_db() if database == "unmigrated" else _older(fresh_db())
    done = _run(args, url, clean_redis)
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    assert "run `celery -A proj fanin migrate`" in out, out
    newest = migrate.available()[-1]
    assert f"{newest.version:04d}_{newest.name}" in out, "names what is missing"
    if database == "older":
        assert f"older fan-in schema (version {newest.version - 1})" in out, out
