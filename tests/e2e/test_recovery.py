"""Recovery from a dead producer, a stopped relay, two relays at once, and a successor delivered twice."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from celery_fanin import FanIn, FanInResult, fan_in_group
from celery_fanin.relay import Relay
from tests import app as tasks
from tests.e2e import producer_crash
from tests.sql import unsend_outbox
from tests.workers import RELAY_PUBLISHES, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(150)]

Runs = Callable[[str], list[dict[str, Any]]]


@pytest.mark.parametrize("kill_on_chunk", [1, 3], ids=["before-publishing", "mid-publishing"])
def test_producer_killed_after_commit_relay_finishes(
    e2e_env: dict[str, str], producer: Any, processes: Any, successor_runs: Runs, kill_on_chunk: int
) -> None:
    processes.worker()
    batch_id = producer_crash.run_killed(e2e_env, "35", str(kill_on_chunk))
    with psycopg.connect(e2e_env["FANIN_DATABASE_URL"], autocommit=True) as conn:
        planned, published = conn.execute(
            "SELECT planned, published_upto FROM fanin_batches WHERE id = %s", (batch_id,)
        ).fetchone()  # type: ignore[misc]
    assert (planned, published) == (35, (kill_on_chunk - 1) * 10)
    processes.relay()
    result = FanInResult(producer, batch_id)
    status = result.wait_batch(timeout=60)
    assert (status.planned, status.succeeded, status.failed, status.published) == (35, 35, 0, 35)
    runs = successor_runs(batch_id)
    assert len(runs) == 1 and runs[0]["outcome"]["succeeded"] == 35


def test_relay_stopped_while_batches_complete_then_started(producer: Any, processes: Any, successor_runs: Runs) -> None:
    processes.worker(RELAY_PUBLISHES)  # (a worker that publishes its own: tests/e2e/test_successor_publish.py)
    handles = [
        fan_in_group([tasks.ok.s(i) for i in range(5)], then=tasks.record_run.s(f"b{k}")).apply_async()
        for k in range(5)
    ]
    for h in handles:
        wait_for(lambda h=h: h.batch_status().state == "complete", 30, message=f"batch {h.batch_id} complete")
    # No relay: every successor waits in the outbox and nothing ran.
    assert all(h.batch_status().successor_state == "pending" for h in handles)
    assert all(successor_runs(h.batch_id) == [] for h in handles)
    processes.relay()
    for h in handles:
        assert h.wait_batch(timeout=30).successor_state == "succeeded"
        assert len(successor_runs(h.batch_id)) == 1


def test_two_relays_publish_each_successor_once(
    producer: Any, processes: Any, successor_runs: Runs, e2e_env: dict[str, str]
) -> None:
    # The worker leaves every successor to the relays: with the default worker (which publishes its own) the
    # relays had nothing to do, and this test could not fail.
    processes.worker(RELAY_PUBLISHES)
    relays = [processes.relay(process=True), processes.relay(process=True)]  # each with its own connections
    handles = [
        fan_in_group([tasks.ok.s(i) for i in range(3)], then=tasks.record_run.s(f"r{k}")).apply_async()
        for k in range(30)
    ]
    for h in handles:
        status = h.wait_batch(timeout=60)
        assert status.successor_state == "succeeded"
        assert status.successor_duplicates == 0
        assert len(successor_runs(h.batch_id)) == 1
    # The relays sent every successor, each once between them: one "published" line per batch in their logs (a
    # relay logs it once its publish is flushed, after the row is marked sent), and each outbox row marked sent
    # once (a second mark, after a second claim, would count a second attempt).
    expected = Counter(h.batch_id for h in handles)
    wait_for(lambda: _relays_published(relays) == expected, 20, message="the relays' log lines for every successor")
    with psycopg.connect(e2e_env["FANIN_DATABASE_URL"], autocommit=True) as conn:
        rows = conn.execute(
            "SELECT batch_id::text, sent_at IS NOT NULL, attempts FROM fanin_outbox WHERE batch_id = ANY(%s::uuid[])",
            ([h.batch_id for h in handles],),
        ).fetchall()
    assert sorted(rows) == sorted((h.batch_id, True, 1) for h in handles)


def _relays_published(relays: list[Any]) -> Counter[str]:
    """How many times the relays' logs say they published each batch's successor."""
    return Counter(b for relay in relays for b in re.findall(r"published successor batch_id=(\S+)", relay.output()))


def test_successor_delivered_twice_runs_once(producer: Any, processes: Any, successor_runs: Runs) -> None:
    processes.worker(RELAY_PUBLISHES)  # this test's relay rounds publish it
    handle = fan_in_group([tasks.ok.s(1)], then=tasks.record_run.s("twice")).apply_async()
    fanin = FanIn.of(producer)
    wait_for(lambda: handle.batch_status().state == "complete", 30, message="batch complete")
    relay = Relay(fanin)
    assert relay.run_once() == 1
    assert handle.wait_batch(timeout=30).successor_state == "succeeded"
    # As if the relay had died after publishing but before marking the row sent: the row goes out again.
    unsend_outbox(fanin.app, handle.batch_id)
    assert relay.run_once() == 1
    wait_for(lambda: handle.batch_status().successor_duplicates == 1, 30, message="the duplicate to be refused")
    status = handle.batch_status()
    assert status.successor_runs == 1 and status.successor_state == "succeeded"
    assert len(successor_runs(handle.batch_id)) == 1
