"""A relay and a worker asked to stop (SIGTERM, as systemd, Kubernetes and `docker stop` do) exit cleanly: code 0,
within a bound, after having done work. On Redis and on RabbitMQ, whose consumers shut down differently."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from celery_fanin import fan_in_group
from tests import app as tasks
from tests.e2e.brokers import on_broker

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

Runs = Callable[[str], list[dict[str, Any]]]


@pytest.fixture(params=["redis", "rabbitmq"])
def e2e_env(e2e_env: dict[str, str], request: pytest.FixtureRequest) -> Iterator[dict[str, str]]:
    with on_broker(e2e_env, request.param) as env:
        yield env


def test_relay_and_worker_exit_0_on_sigterm(producer: Any, processes: Any, successor_runs: Runs) -> None:
    worker = processes.worker()
    relay = processes.relay(process=True)
    handle = fan_in_group([tasks.ok.s(i) for i in range(5)], then=tasks.record_run.s("before-stop")).apply_async()
    assert handle.wait_batch(timeout=60).successor_state == "succeeded"  # both did work (the relay published it)
    assert len(successor_runs(handle.batch_id)) == 1

    # Far longer than either needs: a shutdown that hangs is killed, and `killed` then says so.
    assert relay.stop(timeout=20) == 0, relay.output()[-3000:]
    assert worker.stop(timeout=20) == 0, worker.output()[-3000:]
    assert not relay.killed and not worker.killed
    assert "relay stopped" in relay.output()
    assert "Warm shutdown" in worker.output()
