"""The example app end to end: `python -m example_app.demo` with its real prefork worker and relay subprocesses.

The report must count every child exactly once and name exactly the users the simulated partner's deterministic
rules fail, whatever order the children ran and retried in.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import uuid
from collections import Counter
from pathlib import Path
from types import ModuleType
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row

ROOT = Path(__file__).resolve().parents[2]
RECORDS = 300
SYNC_USER_MAX_RETRIES = 3  # example_app.tasks.MAX_RETRIES: a rate-limited id within it syncs, beyond it fails
DEMO_TIMEOUT = 150


def _load(name: str) -> ModuleType:
    """Load a stdlib-only module of the example by path: importing the `example_app` package would create its
    Celery app and make it the current app of this test process."""
    spec = importlib.util.spec_from_file_location(f"_example_{name}", ROOT / "example_app" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run_demo(args: list[str], env: dict[str, str]) -> tuple[int, str]:
    """Run the demo; on a timeout, SIGTERM it first so that it stops its own worker and relay."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "example_app.demo", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        out, _ = proc.communicate(timeout=DEMO_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        pytest.fail(f"demo did not finish within {DEMO_TIMEOUT}s:\n{out}")
    return proc.returncode, out


@pytest.mark.e2e
@pytest.mark.timeout(180)
def test_demo_report_matches_partner_rules(clean_db: str, clean_redis: str, tmp_path: Path) -> None:
    label = f"e2e-{uuid.uuid4().hex[:8]}"
    env = {
        **os.environ,
        "FANIN_DATABASE_URL": clean_db,
        "FANIN_BROKER_URL": clean_redis,
        # Fewer failures inline in the outcome than the run has: the report must read the rest from Postgres.
        "FANIN_OUTCOME_FAILURES_LIMIT": "3",
        "COLUMNS": "160",  # rich wraps at 80 columns when not on a terminal
    }
    code, out = _run_demo(
        ["--records", str(RECORDS), "--run-label", label, "--timeout", "120", "--log-dir", str(tmp_path)], env
    )
    assert code == 0, f"demo exited {code}:\n{out}"

    warehouse, partner_api = _load("warehouse"), _load("partner_api")
    ids = [r["external_id"] for r in warehouse.DataWarehouseClient().execute(RECORDS) if r["external_id"]]
    with psycopg.connect(clean_db, row_factory=dict_row) as conn:
        local = {
            r["external_id"]
            for r in conn.execute("SELECT external_id FROM example_users WHERE external_id = ANY(%s)", (ids,))
        }
        report: dict[str, Any] | None = conn.execute(
            "SELECT * FROM example_sync_reports WHERE run_label = %s", (label,)
        ).fetchone()
        assert report is not None, out
        batch = conn.execute(
            "SELECT state, planned, remaining, succeeded, failed FROM fanin_batches WHERE id = %s",
            (report["batch_id"],),
        ).fetchone()
        successor = conn.execute(
            "SELECT state, runs FROM fanin_successors WHERE batch_id = %s", (report["batch_id"],)
        ).fetchone()

    outcomes = {i: partner_api.expected(i, SYNC_USER_MAX_RETRIES) for i in local}
    counts = Counter(outcomes.values())
    behaviours = Counter(partner_api.behaviour(i) for i in local)
    expected_failed = sorted(i for i, o in outcomes.items() if o == "failed")
    # The run exercises every path: permanent failures, exhausted retries, retried successes, discards.
    assert all(behaviours[k] for k in ("rejected", "timeout", "rate_limited", "user_not_found", "ok")), behaviours

    assert report["state"] == "complete"
    assert report["scanned"] == RECORDS
    assert report["planned"] == len(local) > 0
    assert report["planned"] == report["succeeded"] + report["failed"]
    assert report["failed_external_ids"] == expected_failed
    assert report["failed"] == len(expected_failed)
    assert (report["synced"], report["discarded"]) == (counts["synced"], counts["user_not_found"])
    expected_types = {"PermanentError": behaviours["rejected"], "RetryableError": behaviours["timeout"]}
    assert report["failure_types"] == expected_types
    assert batch == {
        "state": "complete",
        "planned": len(local),
        "remaining": 0,
        "succeeded": report["succeeded"],
        "failed": report["failed"],
    }
    assert successor == {"state": "succeeded", "runs": 1}
    assert f"Partner sync report: {label}" in out
    assert "✗" not in out
