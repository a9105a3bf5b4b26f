"""`celery -A tests.app fanin ...` through Celery's own CLI (the `celery.commands` entry point)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from types import SimpleNamespace
from typing import Any

import pytest
from click.testing import CliRunner

from celery_fanin import fan_in_group
from celery_fanin.cli import fanin as fanin_cli
from tests import app as tasks
from tests.workers import ROOT

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(90)]


def celery(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "celery", "-A", "tests.app", "fanin", *args],
        cwd=ROOT,
        env={**os.environ, **env, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
    )


def fanin(app: Any, *args: str) -> subprocess.CompletedProcess[str]:
    """`fanin ARGS` in this process: the click command `celery -A tests.app fanin` runs, without the 1-3 s a new
    interpreter costs (a test that needs the entry point, the exit code or the output of the real command runs
    `celery` instead); an exception a subprocess would have printed as a traceback fails the test here."""
    result = CliRunner().invoke(fanin_cli, list(args), obj=SimpleNamespace(app=app))
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return subprocess.CompletedProcess(list(args), result.exit_code, result.stdout, result.stderr)


def test_migrate_twice_is_harmless(e2e_env: dict[str, str]) -> None:
    first = celery(e2e_env, "migrate")
    assert first.returncode == 0, first.stderr
    assert "schema is up to date" in first.stdout  # the session fixture migrated already
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "tests.app", "fanin", "migrate"],
            cwd=ROOT,
            env={**os.environ, **e2e_env, "PYTHONPATH": str(ROOT)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    for p in procs:
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err


def test_status_of_a_finished_batch(e2e_env: dict[str, str], producer: Any, processes: Any) -> None:
    processes.worker()
    processes.relay()
    handle = fan_in_group([tasks.ok.s(1), tasks.fail.s(2)], then=tasks.record_run.s("cli")).apply_async()
    handle.wait_batch(timeout=30)
    as_json = celery(e2e_env, "status", handle.batch_id, "--json")
    assert as_json.returncode == 0, as_json.stderr
    data = json.loads(as_json.stdout)
    assert data["batch_id"] == handle.batch_id
    assert (data["planned"], data["succeeded"], data["failed"], data["remaining"]) == (2, 1, 1, 0)
    assert data["successor_state"] == "succeeded"
    shown = celery(e2e_env, "status", handle.batch_id)
    assert shown.returncode == 0, shown.stderr
    assert handle.batch_id in shown.stdout and "succeeded" in shown.stdout and "2/2" in shown.stdout


def test_status_of_unknown_batch_exits_non_zero(e2e_env: dict[str, str]) -> None:
    missing = celery(e2e_env, "status", str(uuid.uuid4()))
    assert missing.returncode != 0
    assert "no fan-in batch with id" in missing.stderr
    garbage = celery(e2e_env, "status", "not-a-uuid")
    assert garbage.returncode != 0 and "is not a batch id" in garbage.stderr


def test_unreachable_database_exits_non_zero(e2e_env: dict[str, str]) -> None:
    env = {**e2e_env, "FANIN_DATABASE_URL": "postgresql://root@127.0.0.1:1/nowhere"}
    result = celery(env, "status", str(uuid.uuid4()))
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    assert "127.0.0.1" in result.stderr or "connect" in result.stderr.lower()
    migrate = celery(env, "migrate")
    assert migrate.returncode != 0 and "Traceback" not in migrate.stderr


def test_relay_once(e2e_env: dict[str, str]) -> None:
    result = celery(e2e_env, "relay", "--once")
    assert result.returncode == 0, result.stderr
    assert "published 0 messages" in result.stdout
