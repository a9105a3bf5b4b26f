"""A fan-in child's result is stored once, in PostgreSQL: not in Celery's result backend unless asked for.

Real `celery worker` processes with a real result backend (Redis), on Redis and on RabbitMQ as brokers. By default
no child writes to the backend (its key is absent, `AsyncResult(child).state` stays `PENDING`): plain children on
the fast path, one on Celery's own path, every task of a chain child, a replacement, a retried child, a failure;
the successor's outcome still has every child's result, and the successor's own result is in the backend as ever.
A child whose signature sets `ignore_result=False` (or a fan-in applied with it) keeps its backend result, and
`fanin_store_child_results_in_backend = True` stores every child's, as Celery does without celery-fanin.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
import redis
from celery import chain

from celery_fanin import fan_in_group
from celery_fanin.broker.publish import _CHAIN_IDS
from tests.app import add, always_retry, fail, ok, record_run, replacing_child
from tests.e2e import producer_crash
from tests.e2e.brokers import on_broker
from tests.sql import child_ids
from tests.workers import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

BROKERS = pytest.mark.parametrize("e2e_env", ["redis", "rabbitmq"], indirect=True)
TIMEOUT = 60
META = "celery-task-meta-"

Runs = Callable[[str], list[dict[str, Any]]]


@pytest.fixture
def e2e_env(e2e_env: dict[str, str], clean_redis: str, request: pytest.FixtureRequest) -> Iterator[dict[str, str]]:
    """The session's environment on one broker, with a queue of the test's own and the session's (emptied) Redis
    database as the result backend, whichever the broker."""
    with on_broker(e2e_env, request.param) as env:
        yield {**env, "FANIN_TEST_RESULT_BACKEND": clean_redis}


@pytest.fixture
def backend(e2e_env: dict[str, str], producer: Any) -> Iterator[redis.Redis]:
    """The producer app on the result backend too (to read `AsyncResult`s); the backend's Redis, to read keys."""
    url = e2e_env["FANIN_TEST_RESULT_BACKEND"]
    before = producer.conf.result_backend, producer.conf.fanin_store_child_results_in_backend
    producer.conf.result_backend = url
    producer._local.__dict__.pop("backend", None)  # the app caches its backend per thread
    client = redis.Redis.from_url(url)
    yield client
    client.close()
    producer._local.__dict__.pop("backend", None)
    producer.conf.result_backend, producer.conf.fanin_store_child_results_in_backend = before


def _start(processes: Any, env: dict[str, str], stored: bool) -> None:
    extra = {"FANIN_TEST_STORE_CHILD_RESULTS": "1"} if stored else {}
    worker = processes.worker(extra_env=extra, concurrency=4)
    assert f"transport:   {env['FANIN_TEST_BROKER'].split(':')[0]}://" in worker.output()
    processes.relay()


def _children() -> list[Any]:
    """Every way a child reaches the broker and the worker (the values: ok(i) = 10 * i)."""
    return [
        ok.s(0),  # the fast path
        ok.s(1),
        fail.s(2),  # a failure
        chain(add.s(1, 2), add.s(3)),  # a chain: Celery's path, its second task published by the worker
        replacing_child.s(4),  # replaced by ok(4), which takes the child's id
        always_retry.s(5),  # retried twice (each retry published by the worker), then failed
        ok.s(6).set(link_error=ok.si(99)),  # an option the fast path does not model: Celery's apply_async
        ok.s(7).set(ignore_result=False),  # asked for its result in the backend
    ]


def _run(env: dict[str, str], producer: Any, successor_runs: Runs, label: str) -> tuple[Any, list[str], list[str]]:
    """Run the batch to its end; its handle, its children's task ids (from PostgreSQL) and the chain's first."""
    handle = fan_in_group(_children(), then=record_run.s(label, True), app=producer).apply_async()
    status = handle.wait_batch(timeout=TIMEOUT)
    assert status.successor_state == "succeeded" and (status.succeeded, status.failed) == (6, 2), status
    (run,) = successor_runs(handle.batch_id)
    # The successor's outcome is complete: every success's value, in child order, from PostgreSQL.
    assert run["values"] == [0, 10, 6, 40, 60, 70]
    assert (run["outcome"]["succeeded"], run["outcome"]["failed"]) == (6, 2)
    ids = child_ids(env, handle.batch_id)
    first_of_chain = str(uuid.uuid5(_CHAIN_IDS, f"{ids[3]}:0"))
    return handle, ids, [first_of_chain]


def _meta(client: redis.Redis, task_id: str) -> dict[str, Any] | None:
    raw = client.get(META + task_id)
    return json.loads(raw) if raw is not None else None


def _stored(client: redis.Redis) -> set[str]:
    return {key.decode()[len(META) :] for key in client.scan_iter(META + "*")}


def _successor_stored(client: redis.Redis, handle: Any) -> None:
    """The successor's own result is in the backend, as Celery stores any task's (the fan-in does not touch it)."""
    meta = wait_for(lambda: _meta(client, handle.id), TIMEOUT, message="the successor's result in the backend")
    assert meta["status"] == "SUCCESS" and meta["result"]["succeeded"] == 6, meta


@BROKERS
def test_by_default_no_child_result_is_in_the_backend(
    e2e_env: dict[str, str], processes: Any, producer: Any, backend: redis.Redis, successor_runs: Runs
) -> None:
    _start(processes, e2e_env, stored=False)
    handle, ids, chain_first = _run(e2e_env, producer, successor_runs, "default")
    _successor_stored(backend, handle)
    # Every child reported its end (to PostgreSQL) after Celery's trace stored or skipped its result: nothing later
    # can write one. Only the child that asked, and the successor, are in the backend.
    assert _stored(backend) == {ids[7], handle.id}
    for task_id in [*ids[:7], *chain_first]:
        assert producer.AsyncResult(task_id).state == "PENDING", task_id
    asked = producer.AsyncResult(ids[7])
    assert asked.state == "SUCCESS" and asked.result == 70

    # A fan-in applied with ignore_result=False gives it to every child (and its successor): all stored.
    every = fan_in_group([ok.s(1), ok.s(2)], then=record_run.s("asked"), app=producer).apply_async(ignore_result=False)
    assert every.wait_batch(timeout=TIMEOUT).succeeded == 2
    children = child_ids(e2e_env, every.batch_id)
    wait_for(lambda: _meta(backend, every.id), TIMEOUT, message="the second successor's result")
    assert [producer.AsyncResult(c).result for c in children] == [10, 20]


@BROKERS
def test_with_the_setting_every_child_result_is_in_the_backend(
    e2e_env: dict[str, str], processes: Any, producer: Any, backend: redis.Redis, successor_runs: Runs
) -> None:
    producer.conf.fanin_store_child_results_in_backend = True  # the producer (and relay); the worker's is its env
    _start(processes, e2e_env, stored=True)
    handle, ids, chain_first = _run(e2e_env, producer, successor_runs, "stored")
    _successor_stored(backend, handle)
    assert _stored(backend) == {*ids, *chain_first, handle.id}
    metas = {task_id: _meta(backend, task_id) for task_id in [*ids, *chain_first]}
    states = [(m or {}).get("status") for m in metas.values()]
    assert states == ["SUCCESS", "SUCCESS", "FAILURE", "SUCCESS", "SUCCESS", "FAILURE", "SUCCESS", "SUCCESS", "SUCCESS"]
    assert [producer.AsyncResult(ids[i]).result for i in (0, 1, 3, 4, 6, 7)] == [0, 10, 6, 40, 60, 70]
    assert producer.AsyncResult(chain_first[0]).result == 3
    assert isinstance(producer.AsyncResult(ids[2]).result, ValueError)


@BROKERS
def test_children_the_relay_publishes_are_not_in_the_backend_either(
    e2e_env: dict[str, str], processes: Any, producer: Any, backend: redis.Redis, successor_runs: Runs
) -> None:
    """A producer killed after its commit, before publishing: the relay publishes every child, with the same
    default (read from the relay's own configuration)."""
    _start(processes, e2e_env, stored=False)
    batch_id = producer_crash.run_killed(e2e_env, "12", "1")
    wait_for(lambda: successor_runs(batch_id), TIMEOUT, message="the successor's run")
    ids = child_ids(e2e_env, batch_id)
    assert len(ids) == 12
    with psycopg.connect(e2e_env["FANIN_DATABASE_URL"], autocommit=True) as conn:
        successor = conn.execute("SELECT successor_task_id FROM fanin_batches WHERE id = %s", (batch_id,)).fetchone()
    assert successor is not None
    wait_for(lambda: _meta(backend, successor[0]), TIMEOUT, message="the successor's result in the backend")
    assert _stored(backend) == {successor[0]}
