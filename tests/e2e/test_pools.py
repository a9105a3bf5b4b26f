"""The core guarantees on every pool Celery ships: prefork, threads, solo, gevent and eventlet.

Thread-based pools run a duplicate delivery of a successor in the same process as its live run; a run belongs to
one execution of the task (its request), so the duplicate is refused without touching the live run. Each test runs
real `celery worker -P <pool>` subprocesses against Redis and PostgreSQL.

The duplicate-while-running test runs on the pools that run the copy in the same process as the live run (threads,
gevent, eventlet: the request stack is per thread or per green thread there). On prefork the copy runs in another
process: `test_faults.py::test_duplicate_delivery_while_successor_runs_is_refused`. The solo pool runs one task at
a time, so its copy can only come after the run ended: `test_recovery.py::test_successor_delivered_twice_runs_once`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from celery import chain

from celery_fanin import FanIn, fan_in_group
from celery_fanin.relay import Relay
from celery_fanin.store.reports import libpq_conninfo
from tests import app as tasks
from tests.sql import unsend_outbox
from tests.workers import RELAY_PUBLISHES, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

Runs = Callable[[str], list[dict[str, Any]]]
POOLS = ["prefork", "threads", "solo", "gevent", "eventlet"]
IN_PROCESS_POOLS = ["threads", "gevent", "eventlet"]  # a duplicate runs in the live run's own process
CONCURRENCY = {"prefork": 2, "threads": 4, "solo": 1, "gevent": 8, "eventlet": 8}


@pytest.mark.parametrize("pool", POOLS)
def test_children_of_every_kind_and_a_retrying_successor(
    producer: Any, processes: Any, successor_runs: Runs, pool: str
) -> None:
    processes.worker(pool=pool, concurrency=CONCURRENCY[pool])
    processes.relay()
    children = [tasks.ok.s(0), tasks.fail.s(1), tasks.flaky.s(2, 1), tasks.replacing_child.s(3), tasks.reject.s(4)]
    handle = fan_in_group(children, then=tasks.retrying_successor.s(f"pool-{pool}", 2)).apply_async()
    status = handle.wait_batch(timeout=60)
    assert (status.succeeded, status.failed, status.remaining) == (3, 2, 0)
    assert (status.successor_state, status.successor_runs, status.successor_duplicates) == ("succeeded", 3, 0)
    runs = successor_runs(handle.batch_id)
    assert len(runs) == 1
    assert sorted((f["index"], f["state"]) for f in runs[0]["outcome"]["failures"]) == [(1, "failed"), (4, "rejected")]


@pytest.mark.parametrize("pool", POOLS)
def test_a_replacement_failing_before_its_carrier_ends_its_child_and_its_successor(
    producer: Any, processes: Any, pool: str
) -> None:
    """A child replaced by a chain, and a `then=` chain, each failing in its middle: the failed task's own hooks end
    the child and the successor, whichever pool ran it (tests/e2e/test_canvas.py on prefork has the details)."""
    processes.worker(pool=pool, concurrency=CONCURRENCY[pool])
    processes.relay()
    then = chain(tasks.values.s(), tasks.fail.si(7), tasks.identity.s())
    handle = fan_in_group([tasks.ok.s(1), tasks.replacing_child_failing.s(2)], then=then).apply_async()
    status = handle.wait_batch(timeout=60)
    assert (status.succeeded, status.failed, status.remaining, status.successor_state) == (1, 1, 0, "failed")
    with pytest.raises(ValueError, match="child 7 failed on purpose"):
        handle.get(timeout=5)


@pytest.mark.parametrize("pool", IN_PROCESS_POOLS)
def test_a_duplicate_delivery_of_a_running_successor_is_refused(
    producer: Any, processes: Any, successor_runs: Runs, pool: str
) -> None:
    processes.worker(RELAY_PUBLISHES, pool=pool, concurrency=CONCURRENCY[pool])  # this test's relay rounds publish
    handle = fan_in_group([tasks.ok.s(1)], then=tasks.slow_successor.s(f"dup-{pool}", 2)).apply_async()
    relay = Relay(FanIn.of(producer))
    wait_for(lambda: relay.run_once() == 1, 20, message="the successor published")
    wait_for(lambda: handle.batch_status().successor_state == "running", 20, message="the successor running")
    # A second copy while the first runs: on a thread-based pool it runs in the same process as the live run.
    unsend_outbox(producer, handle.batch_id)
    assert relay.run_once() == 1
    wait_for(lambda: handle.batch_status().successor_duplicates == 1, 30, message="the copy refused")
    status = handle.wait_batch(timeout=30)
    assert (status.successor_state, status.successor_runs, status.successor_duplicates) == ("succeeded", 1, 1)
    assert len(successor_runs(handle.batch_id)) == 1


def test_an_eventlet_worker_runs_other_tasks_while_one_report_waits_for_a_lock(
    producer: Any, processes: Any, e2e_env: dict[str, str]
) -> None:
    """Under eventlet, psycopg's C wait (psycopg-binary) blocks the whole hub: one report held up by a lock would
    stall every task of the worker (`store/cooperative.py`). Here one child's report waits for its batch's row,
    which the test holds, while another batch's child is taken, run and counted by the same worker."""
    held = fan_in_group([tasks.ok.s(1)], then=tasks.record_run.s("held")).apply_async()
    holder = psycopg.connect(libpq_conninfo(e2e_env["FANIN_DATABASE_URL"]))
    try:
        holder.execute("SELECT 1 FROM fanin_batches WHERE id = %s FOR UPDATE", (held.batch_id,))
        worker = processes.worker(pool="eventlet", concurrency=8)
        wait_for(lambda: "Task tests.app.ok" in worker.output(), 30, message="the held child to run")
        other = fan_in_group([tasks.ok.s(2)], then=tasks.record_run.s("other")).apply_async()
        wait_for(
            lambda: other.batch_status().remaining == 0,
            20,
            message="the other batch's child to be counted while the first report waits (a blocked hub runs nothing)",
        )
        assert held.batch_status().remaining == 1, "the held report got through the lock"
    finally:
        holder.rollback()
        holder.close()
    wait_for(lambda: held.batch_status().remaining == 0, 30, message="the held report once the row is free")
