"""The relay as docs/how-to/relay-in-production.md runs it: `--logfile` with `--log-format json`, `--metrics-port`
serving the metrics and the `/healthz` and `/readyz` probes, a stop on SIGTERM; a real `celery fanin relay`
process publishing a real worker's batch's successor."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from celery_fanin import fan_in_group
from celery_fanin.producer import encoder
from tests import app as tasks
from tests import http_get
from tests.cluster import free_port
from tests.sql import batch, rows
from tests.workers import RELAY_PUBLISHES, CeleryProcess, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


def _probe(port: int, path: str) -> tuple[int, str]:
    """The relay's HTTP endpoint `path`: (0, "") while it is not listening yet."""
    return http_get.get(f"http://127.0.0.1:{port}{path}", timeout=10, unanswered=(0, "")) or (0, "")


def _json_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_relay_with_a_json_logfile_metrics_and_probes(
    e2e_env: dict[str, str], producer: Any, processes: Any, tmp_path: Path
) -> None:
    logfile, port = tmp_path / "relay.jsonl", free_port()
    relay = CeleryProcess(
        [
            "fanin",
            "relay",
            "--poll-interval",
            "0.2",
            "--metrics-port",
            str(port),
            "--logfile",
            str(logfile),
            "--log-format",
            "json",
            "-l",
            "info",
        ],
        e2e_env,
        tmp_path / "relay.out",
        ready_marker=None,
    )
    try:
        wait_for(lambda: _probe(port, "/readyz")[0] == 200, 30, 0.1, "the relay's /readyz")
        status, body = _probe(port, "/healthz")
        assert status == 200 and json.loads(body) == {"status": "ok", "checks": {"relay_loop": "ok"}}
        ready = json.loads(_probe(port, "/readyz")[1])
        assert ready == {"status": "ok", "checks": {"relay_loop": "ok", "database": "ok"}}
        assert "fanin_up 1.0" in _probe(port, "/metrics")[1]

        processes.worker(RELAY_PUBLISHES)  # the relay's counter of successors it published
        handle = fan_in_group([tasks.ok.s(i) for i in range(3)], then=tasks.record_run.s("ops")).apply_async()
        assert handle.wait_batch(timeout=60).successor_state == "succeeded"
        wait_for(
            lambda: "fanin_relay_successors_published_total 1.0" in _probe(port, "/metrics")[1],
            30,
            0.1,
            "the relay's counter of published successors",
        )
    finally:
        code = relay.stop()
    assert code == 0, relay.output()[-3000:]
    lines = _json_lines(logfile)  # every line is one JSON object
    assert {"time", "level", "logger", "message"} <= lines[0].keys()
    messages = [line["message"] for line in lines]
    assert any(m.startswith("relay started") for m in messages)
    assert any(m.startswith("relay stopped") for m in messages), messages[-5:]
    published = [line for line in lines if line.get("batch_id") == handle.batch_id]
    assert published, "the lines about the batch carry its batch_id as a field"
    assert relay.output().strip() == "", "with --logfile nothing goes to stderr"


def test_a_logfile_that_cannot_be_opened_is_a_usage_error(e2e_env: dict[str, str], tmp_path: Path) -> None:
    from tests.e2e.test_cli import celery

    done = celery(e2e_env, "relay", "--once", "--logfile", str(tmp_path / "missing" / "relay.log"))
    assert done.returncode == 2
    assert "cannot open" in done.stderr and "--logfile" in done.stderr


def test_a_child_the_relay_cannot_publish_is_counted_rejected_by_a_worker_and_its_batch_finishes(
    producer: Any, processes: Any, successor_runs: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Child 1 gives `ok(i)` three arguments, written as by a producer that did not check them (one before the
    check, or one that does not know the task): the producer cannot publish its chunk and leaves it to the relay,
    which publishes children 0 and 2 and a rejection in child 1's place; a real worker runs the two and rejects the
    third, and the successor runs once with the two values and the rejected child among the failures."""
    with monkeypatch.context() as unchecked:
        unchecked.setattr(encoder.Arguments, "signature", lambda *_: None)
        handle = fan_in_group(
            [tasks.ok.s(1), tasks.ok.s(1, 2, 3), tasks.ok.s(3)], then=tasks.record_run.s("misfit", with_values=True)
        ).apply_async()
    mark = batch(producer, handle.batch_id, "published_upto")
    assert mark["published_upto"] == 0, "the producer published nothing of the failing chunk"
    processes.worker(concurrency=2)
    relay = processes.relay(process=True)
    status = handle.wait_batch(timeout=60)
    assert (status.state, status.succeeded, status.failed, status.successor_state) == ("complete", 2, 1, "succeeded")
    [misfit] = rows(
        producer,
        "SELECT task_id, state, exc_type, exc_message FROM fanin_children WHERE batch_id = :b AND idx = 1",
        b=handle.batch_id,
    )
    assert (misfit.state, misfit.exc_type) == ("rejected", "Reject")
    assert "not published by the relay: TypeError" in misfit.exc_message
    [run] = successor_runs(handle.batch_id)
    assert run["values"] == [10, 30]
    assert [(f["index"], f["state"]) for f in run["outcome"]["failures"]] == [(1, "rejected")]
    log = relay.output()
    assert f"batch_id={handle.batch_id} index=1 task_id={misfit.task_id} cannot be published (TypeError" in log
