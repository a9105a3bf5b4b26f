"""The relay loads the app as a worker does: its task modules (so it routes a successor as the workers' app would)
and its logging (through `app.log.setup`)."""

from __future__ import annotations

from typing import Any

from celery_fanin import fan_in_group
from tests.app import ok
from tests.workers import wait_for

DISCOVER = {"FANIN_TEST_AUTODISCOVER": "1"}


def test_the_relay_routes_a_successor_by_its_autodiscovered_task(
    e2e_env: dict[str, str], producer: Any, processes: Any
) -> None:
    """`@shared_task(queue=...)` in a module only autodiscovery imports: the relay, a `celery fanin relay`
    process, publishes the successor to that queue (before, it knew no such task and used the default queue)."""
    default = e2e_env.get("FANIN_TEST_QUEUE", "celery")
    processes.worker(extra_env=DISCOVER, extra=["-Q", f"{default},fanin-routed"])
    processes.relay(extra_env=DISCOVER)
    assert "tests.routed.where" not in producer.tasks  # the test process never imported it
    handle = fan_in_group([ok.s(1)], then=producer.signature("tests.routed.where")).apply_async()
    assert handle.get(timeout=60) == "fanin-routed"


def test_the_relays_log_goes_through_celerys_logging_setup(e2e_env: dict[str, str], processes: Any) -> None:
    """`worker_log_format` (which `app.log.setup` applies, as it does a worker's) formats the relay's lines."""
    relay = processes.relay(extra_env={"FANIN_TEST_LOG_FORMAT": "RELAY-LOG %(levelname)s %(name)s: %(message)s"})
    wait_for(lambda: "RELAY-LOG INFO celery_fanin.relay: relay started" in relay.output(), 30, message="the line")
