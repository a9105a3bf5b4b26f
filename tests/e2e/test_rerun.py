"""`celery -A proj fanin rerun` and `FanInResult.rerun()` (issue 40, item 5): a failed or revoked successor runs
again once its bug is fixed, from its stored signature and the batch's outcome, under a new task id and the next
run number, once (a copy of an earlier delivery is refused), recorded and shown by `status`. Real workers and relay."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
import redis
from starlette.testclient import TestClient

from celery_fanin import BatchNotFound, FanInResult, fan_in_group
from celery_fanin.exceptions import SuccessorNotRerunnable
from celery_fanin.protocol import HEADER_STEP, HEADER_SUCCESSOR
from celery_fanin.web import create_app
from tests import app as tasks
from tests.e2e.test_cli import celery, fanin
from tests.sql import attempts, open_gate, rows
from tests.sql import successor as successor_row
from tests.workers import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(150)]

TIMEOUT = 60


def _task_state_runs_duplicates(app: Any, batch_id: str) -> tuple[Any, ...]:
    found = successor_row(app, batch_id, "task_id", "state", "runs", "duplicates")
    return tuple(found.values()) if found is not None else (None, None, None, None)  # not created yet


def test_a_failed_successor_runs_again_once_fixed_and_only_once(
    producer: Any, processes: Any, e2e_env: dict[str, str], successor_runs: Any
) -> None:
    processes.worker(concurrency=2)
    processes.relay()
    key = f"rerun-{uuid.uuid4().hex[:8]}"
    handle = fan_in_group([tasks.ok.s(1), tasks.fail.s(2)], then=tasks.buggy_successor.s(key)).apply_async()
    with pytest.raises(RuntimeError, match="not fixed yet"):
        handle.get(timeout=TIMEOUT)
    first_task, state, runs, _ = _task_state_runs_duplicates(producer, handle.batch_id)
    assert (first_task, state, runs) == (handle.id, "failed", 1)

    redis.Redis.from_url(e2e_env["FANIN_TEST_BROKER"]).set(f"e2e:fixed:{key}", 1)  # the bug is fixed
    done = json.loads(celery(e2e_env, "rerun", handle.batch_id, "--json", "--by", "ops@example").stdout)
    assert (done["rerun"], done["previous_task_id"], done["previous_state"]) == (1, handle.id, "failed")
    assert done["requested_by"] == "ops@example" and done["task_id"] != handle.id
    # The first handle answers with the rerun, read from PostgreSQL, as it would for a first run.
    assert handle.get(timeout=TIMEOUT) == {"succeeded": 1, "failed": 1}
    assert [r["label"] for r in successor_runs(handle.batch_id)] == [f"fixed:{key}"]
    task_id, state, runs, duplicates = _task_state_runs_duplicates(producer, handle.batch_id)
    assert (task_id, state, runs) == (done["task_id"], "succeeded", 2), "the next run number, under the new task id"

    # A copy of the first delivery (its old task id) comes late: the run guard refuses it, the body does not run.
    outcome = {"batch_id": handle.batch_id, "step": "tests.app.buggy_successor", "succeeded": 1, "failed": 1}
    tasks.buggy_successor.apply_async(
        (outcome, key),
        task_id=handle.id,
        headers={HEADER_SUCCESSOR: handle.batch_id, HEADER_STEP: "tests.app.buggy_successor"},
    )
    wait_for(
        lambda: _task_state_runs_duplicates(producer, handle.batch_id)[3] == duplicates + 1,
        TIMEOUT,
        message="the copy refused",
    )
    assert (
        len(successor_runs(handle.batch_id)) == 1
        and _task_state_runs_duplicates(producer, handle.batch_id)[1] == "succeeded"
    )

    # status shows it; a succeeded successor is not run again.
    data = json.loads(fanin(producer, "status", handle.batch_id, "--json").stdout)
    assert data["successor_runs"] == 2 and data["successor_current_task_id"] == done["task_id"]
    assert [(r["rerun"], r["previous_state"], r["previous_exc_type"], r["requested_by"]) for r in data["reruns"]] == [
        (1, "failed", "RuntimeError", "ops@example")
    ]
    text = fanin(producer, "status", handle.batch_id).stdout
    assert "successor reruns" in text and done["task_id"] in text
    web = create_app(producer, page_size=10)  # the dashboard's page, its JSON, and a lookup by the rerun's task id
    try:
        with TestClient(web) as client:
            page = client.get(f"/batches/{handle.batch_id}").text
            body = client.get(f"/api/batches/{handle.batch_id}").json()
            found = client.get("/lookup", params={"id": done["task_id"]}, follow_redirects=False)
    finally:
        web.state.engine.dispose()
    assert '<table class="reruns">' in page and "ops@example" in page
    assert [(r["rerun"], r["task_id"]) for r in body["reruns"]] == [(1, done["task_id"])]
    assert found.status_code == 303 and found.headers["location"].endswith(f"/batches/{handle.batch_id}")
    refused = fanin(producer, "rerun", handle.batch_id)
    assert refused.returncode == 1 and "is succeeded: only a failed or revoked successor runs again" in refused.stderr
    with pytest.raises(SuccessorNotRerunnable):
        handle.rerun()
    with pytest.raises(BatchNotFound):
        FanInResult(producer, str(uuid.uuid4())).rerun()


def test_a_revoked_successor_runs_again_under_its_new_task_id(
    producer: Any, processes: Any, successor_runs: Any
) -> None:
    """Celery's workers remember a revoked task id: the rerun runs because it has an id of its own."""
    processes.worker(concurrency=2)
    processes.relay()
    rows(producer, tasks.ATTEMPTS_DDL)
    key = f"rerun-revoked-{uuid.uuid4().hex[:8]}"
    handle = fan_in_group([tasks.gated.s(key)], then=tasks.record_run.s("after-revoke")).apply_async()
    wait_for(lambda: attempts(producer, key) == 1, TIMEOUT, message="the gated child to start")
    handle.revoke()  # the successor's task id: a worker discards its message when it comes
    open_gate(producer, key)
    wait_for(
        lambda: _task_state_runs_duplicates(producer, handle.batch_id)[1] == "revoked",
        TIMEOUT,
        message="the successor revoked",
    )
    assert successor_runs(handle.batch_id) == []
    done = handle.rerun(requested_by="test")
    assert (done.previous_state, done.rerun, done.requested_by) == ("revoked", 1, "test")
    assert handle.get(timeout=TIMEOUT) == {"label": "after-revoke", "succeeded": 1, "failed": 0}
    assert [r["label"] for r in successor_runs(handle.batch_id)] == ["after-revoke"]
    assert _task_state_runs_duplicates(producer, handle.batch_id)[:3] == (done.task_id, "succeeded", 1)
