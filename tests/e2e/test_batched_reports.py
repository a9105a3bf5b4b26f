"""A prefork worker's group commit of its children's reports (`fanin_report_batching`, worker/batching.py), with
real `celery worker` subprocesses: every kind of child ends its batch as it does alone, a pool process killed
mid-task and a whole worker killed mid-batch lose nothing and count nothing twice, and reports really share
commits."""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable
from typing import Any

import pytest

from celery_fanin import fan_in_group
from tests import app as tasks
from tests.e2e.brokers import broker_env, worker_on  # noqa: F401 - broker_env: the fixture
from tests.sql import attempts, rows
from tests.workers import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

Runs = Callable[[str], list[dict[str, Any]]]
BATCHING = {"FANIN_TEST_REPORT_BATCHING": "1"}


def _committed(output: str) -> tuple[int, int]:
    """The batcher's own count at shutdown: reports committed, and the statements that carried them."""
    found = re.search(r"report batcher: (\d+) reports committed in (\d+) statements", output)
    assert found, "the batcher logged no summary: no report went through it"
    return int(found.group(1)), int(found.group(2))


# On Redis (its tasks count their attempts there); RabbitMQ: the next test.
def test_children_of_every_kind_end_their_batch_through_the_batcher(
    e2e_env: dict[str, str], producer: Any, processes: Any, successor_runs: Runs
) -> None:
    worker = worker_on(processes, e2e_env, extra_env=BATCHING, concurrency=4)
    processes.relay()
    children = [tasks.ok.s(0), tasks.fail.s(1), tasks.flaky.s(2, 1), tasks.replacing_child.s(3), tasks.reject.s(4)]
    many = [tasks.ok.s(i) for i in range(5, 200)]
    handle = fan_in_group(children + many, then=tasks.retrying_successor.s("batched", 2)).apply_async()
    status = handle.wait_batch(timeout=90)
    assert (status.succeeded, status.failed, status.remaining) == (198, 2, 0)
    assert (status.successor_state, status.successor_runs, status.successor_duplicates) == ("succeeded", 3, 0)
    [run] = successor_runs(handle.batch_id)
    assert sorted((f["index"], f["state"]) for f in run["outcome"]["failures"]) == [(1, "failed"), (4, "rejected")]
    worker.terminate()
    worker.stop(timeout=15)
    reports, statements = _committed(worker.output())
    # Every child's report but the two the main process or a replacement made differently went through it; with four
    # pool processes reporting at once, some shared a commit.
    assert reports >= 195 and statements < reports, (reports, statements)


# On RabbitMQ, which gives a dead consumer's unacknowledged messages back at once (Redis only after its
# visibility timeout, an hour by default).
@pytest.mark.parametrize("e2e_env", ["rabbitmq"], indirect=True)
def test_a_pool_process_killed_mid_task_and_a_worker_killed_mid_batch_count_each_child_once(
    e2e_env: dict[str, str], producer: Any, processes: Any, successor_runs: Runs
) -> None:
    """With acks_late, a child whose report the batcher had not committed is delivered again and counted once."""
    env = {**BATCHING, "FANIN_TEST_ACKS_LATE": "1"}
    first = worker_on(processes, e2e_env, extra_env=env, concurrency=4)
    processes.relay()
    key = f"batched-{uuid.uuid4().hex[:8]}"
    children = [tasks.die_once_pg.s(key)] + [tasks.sleepy.s(0.02) for _ in range(299)]
    handle = fan_in_group(children, then=tasks.record_run.s("killed")).apply_async()
    wait_for(lambda: 0 < handle.batch_status().remaining < 250, timeout=60, message="part of the batch reported")
    first.kill()  # main process and pool at once, mid-batch: whatever the batcher held is lost with it
    worker_on(processes, e2e_env, extra_env=env, concurrency=4)
    status = handle.wait_batch(timeout=120)
    odd = "SELECT c.idx, c.state, c.exc_type FROM fanin_children c JOIN fanin_batches b ON b.id = c.batch_id"
    odd += " WHERE (b.id = :b OR b.parent_id = :b) AND c.state <> 'succeeded'"  # a tree: its leaves hold the rows
    assert (status.succeeded, status.failed, status.remaining) == (300, 0, 0), rows(producer, odd, b=handle.batch_id)
    assert attempts(producer, key) == 2  # killed in its first run, delivered again, run to the end
    assert status.successor_state == "succeeded"
    assert len(successor_runs(handle.batch_id)) == 1
