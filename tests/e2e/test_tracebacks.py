"""Tracebacks end to end (issue 40, item 3): real prefork workers keep the traceback of a child that failed and of
a successor that failed in PostgreSQL, and `failures`, `status`, the dashboard, `BatchOutcome.all_failures()` and
the handle's `traceback` show it; the successor's message does not carry it."""

from __future__ import annotations

import json
from typing import Any

import pytest
from starlette.testclient import TestClient

from celery_fanin import BatchOutcome, fan_in_group
from celery_fanin.web import create_app
from tests import app as tasks
from tests.e2e.test_cli import fanin

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


def test_a_failed_child_and_successor_keep_their_tracebacks(producer: Any, processes: Any, successor_runs: Any) -> None:
    processes.worker(concurrency=2)
    processes.relay()
    handle = fan_in_group([tasks.ok.s(1), tasks.fail.s(7)], then=tasks.failing_successor.s("tb")).apply_async()
    with pytest.raises(RuntimeError, match="failed on purpose"):
        handle.get(timeout=60)

    # The successor's: the frame that raised, in the handle and in `status`.
    trace = handle.traceback
    assert trace is not None and trace.startswith("Traceback (most recent call last):"), trace
    assert 'tests/app.py", line' in trace and "in failing_successor" in trace
    assert trace.rstrip().endswith("RuntimeError: the successor failed on purpose")
    shown = fanin(producer, "status", handle.batch_id)
    assert shown.returncode == 0 and "successor traceback:" in shown.stdout and "in failing_successor" in shown.stdout
    assert "successor error" in shown.stdout

    # The child's: in `failures` (JSON, and under the table with --traceback), and BatchOutcome.all_failures().
    listed = json.loads(fanin(producer, "failures", handle.batch_id, "--json").stdout)
    [failure] = listed["failures"]
    assert failure["index"] == 1 and "in fail" in failure["traceback"]
    assert failure["traceback"].rstrip().endswith("ValueError: child 7 failed on purpose")
    text_ = fanin(producer, "failures", handle.batch_id, "--traceback").stdout
    assert "child 1 (" in text_ and "in fail" in text_
    [run] = successor_runs(handle.batch_id)
    assert "traceback" not in run["outcome"]["failures"][0], "never in the successor's message"
    outcome = BatchOutcome.from_message(run["outcome"], app=producer)
    assert outcome.all_failures()[0]["traceback"] == failure["traceback"]

    # The dashboard's batch page, and its JSON.
    web = create_app(producer, page_size=10)
    try:
        with TestClient(web) as client:
            page = client.get(f"/batches/{handle.batch_id}").text
            body = client.get(f"/api/batches/{handle.batch_id}").json()
    finally:
        web.state.engine.dispose()
    assert page.count('<details class="tb">') == 2 and "in failing_successor" in page
    assert body["failures"][0]["traceback"] == failure["traceback"] and body["successor"]["traceback"] == trace
