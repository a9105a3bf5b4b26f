"""An e2e environment on Redis or on RabbitMQ, for the tests whose behaviour could differ between brokers."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from kombu import Connection

from celery_fanin.store.reports import libpq_conninfo
from tests import app as tasks

RABBITMQ_URL = "amqp://guest:guest@127.0.0.1:5672//"
# The test's other queues are named `<its queue>-<suffix>` with one of these, so that they are deleted with it.
QUEUE_SUFFIXES = ("hold", "refuse")


def _reset_broker_pools() -> None:
    """The producer app is shared by the session: forget broker connections made for another broker URL."""
    tasks.app._pool = None
    tasks.app.amqp._producer_pool = None


@contextlib.contextmanager
def on_broker(env: dict[str, str], broker: str) -> Iterator[dict[str, str]]:
    """`env` on `broker` ("redis" or "rabbitmq") with a queue of the test's own (the RabbitMQ vhost is shared with
    every test session on the machine; its queues are deleted afterwards), and a clean `e2e_attempts` table."""
    queue = f"fanin-e2e-{uuid.uuid4().hex[:10]}"
    env = {**env, "FANIN_TEST_QUEUE": queue}
    if broker == "rabbitmq":
        env["FANIN_TEST_BROKER"] = RABBITMQ_URL
    with psycopg.connect(libpq_conninfo(env["FANIN_DATABASE_URL"]), autocommit=True) as conn:
        conn.execute(tasks.ATTEMPTS_DDL)
        conn.execute("TRUNCATE e2e_attempts")
    _reset_broker_pools()
    try:
        yield env
    finally:
        _reset_broker_pools()
        if broker == "rabbitmq":
            with Connection(RABBITMQ_URL) as conn:
                for name in (queue, *(f"{queue}-{suffix}" for suffix in QUEUE_SUFFIXES)):
                    channel = conn.channel()
                    try:
                        channel.queue_delete(name)
                    except Exception:  # noqa: BLE001 - never declared: nothing to clean
                        pass
                    finally:
                        channel.close()


# For a test module whose tests run on both brokers: `from tests.e2e.brokers import BROKERS, broker_env, worker_on`.
BROKERS = pytest.mark.parametrize("e2e_env", ["redis", "rabbitmq"], indirect=True)


@pytest.fixture(name="e2e_env")
def broker_env(e2e_env: dict[str, str], request: pytest.FixtureRequest) -> Iterator[dict[str, str]]:
    """The session's environment on one broker (Redis unless parametrized), with a queue of the test's own."""
    with on_broker(e2e_env, getattr(request, "param", "redis")) as env:
        yield env


def worker_on(processes: Any, env: dict[str, str], **kwargs: Any) -> Any:
    """A worker, checked to be on the broker the test is parametrized with (its banner names the transport)."""
    worker = processes.worker(**kwargs)
    assert f"transport:   {env['FANIN_TEST_BROKER'].split(':')[0]}://" in worker.output()
    return worker
