"""Outages end to end: real workers and relays whose PostgreSQL (or broker) connections go through a proxy the
test cuts and restores (tests.faults). Nothing is restarted, so other test sessions are unaffected.

The claim: a PostgreSQL outage of 60 s (20 s outside `make chaos`) during a batch loses no report and runs no
successor twice; the reports wait (`fanin_report_timeout`, 300 s by default) and every process recovers by itself
once the store is back.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sqlalchemy import text

from celery_fanin import FanIn, fan_in_group
from tests import app as tasks
from tests.faults import TcpProxy, proxy_for
from tests.sql import child_states
from tests.workers import RELAY_PUBLISHES, CeleryProcess, wait_for

pytestmark = [pytest.mark.e2e]

Runs = Callable[[str], list[dict[str, Any]]]


@pytest.fixture
def pg_proxy(e2e_env: dict[str, str]) -> Iterator[TcpProxy]:
    with proxy_for(e2e_env["FANIN_DATABASE_URL"], 5432) as proxy:
        yield proxy


def _through(proxy: TcpProxy, e2e_env: dict[str, str]) -> dict[str, str]:
    """The environment of a process whose store is reached through the proxy (the successor's own record of
    its runs goes straight to the database: it is the test's witness, not the system under test)."""
    url = e2e_env["FANIN_DATABASE_URL"]
    return {"FANIN_DATABASE_URL": proxy.url(url), "FANIN_TEST_RUNS_URL": url}


def _hold_cut(proxy: TcpProxy, seconds: float, procs: list[CeleryProcess]) -> None:
    """Keep the proxy cut for `seconds` from now, checking that every process stays up meanwhile."""
    until = time.monotonic() + seconds

    def over() -> bool:
        for p in procs:
            assert p.proc.poll() is None, f"{p.log.name} exited during the outage:\n{p.output()[-3000:]}"
        return time.monotonic() >= until

    wait_for(over, seconds + 10, interval=0.5, message=f"{seconds}s of outage")


# 20 s in the default suite (more than three times the retry budget reports had before they waited for the store);
# the full 60 s with the fault-injection suite (`make chaos`, run by CI), beside its 60 s stop of PostgreSQL itself.
@pytest.mark.timeout(240)
@pytest.mark.parametrize("seconds", [pytest.param(20, id="20s"), pytest.param(60, id="60s", marks=pytest.mark.chaos)])
def test_a_database_outage_loses_no_report_and_runs_no_successor_twice(
    producer: Any, processes: Any, successor_runs: Runs, pg_proxy: TcpProxy, e2e_env: dict[str, str], seconds: int
) -> None:
    env = _through(pg_proxy, e2e_env)  # default settings: fanin_report_timeout is 300 s
    worker = processes.worker(extra_env=env, concurrency=4)
    relay = processes.relay(extra_env=env)
    children = [tasks.fail.s(0)] + [tasks.sleepy.s(3) for _ in range(4)]
    handle = fan_in_group(children, then=tasks.record_run.s("outage")).apply_async()
    wait_for(lambda: child_states(producer, handle.batch_id).get("started") == 4, 30, message="4 children started")
    assert child_states(producer, handle.batch_id) == {"failed": 1, "started": 4}
    pg_proxy.cut()  # every child ends about 3 s from now, inside the outage
    _hold_cut(pg_proxy, seconds, [worker, relay])
    assert child_states(producer, handle.batch_id) == {"failed": 1, "started": 4}  # nothing got through meanwhile
    assert pg_proxy.refused > 0  # the worker and relay kept trying
    pg_proxy.restore()
    status = handle.wait_batch(timeout=60)
    assert (status.succeeded, status.failed, status.remaining, status.planned) == (4, 1, 0, 5)
    assert child_states(producer, handle.batch_id) == {"failed": 1, "succeeded": 4}  # nothing counted lost
    assert status.successor_state == "succeeded" and status.successor_runs == 1
    runs = successor_runs(handle.batch_id)
    assert len(runs) == 1 and (runs[0]["outcome"]["succeeded"], runs[0]["outcome"]["failed"]) == (4, 1)
    log = worker.output()
    assert "recording terminal outcome" in log and "retrying in" in log  # the reports waited...
    assert "gave up" not in log  # ...and none was dropped


@pytest.mark.timeout(150)
def test_a_successor_that_ends_during_an_outage_is_recorded_once(
    producer: Any, processes: Any, successor_runs: Runs, pg_proxy: TcpProxy, e2e_env: dict[str, str]
) -> None:
    """Its final state waits for the store; it is not taken for stalled and run again."""
    env = {**_through(pg_proxy, e2e_env), "FANIN_TEST_SUCCESSOR_TIMEOUT": "3"}
    worker = processes.worker(extra_env=env)
    relay = processes.relay(extra_env=env)
    handle = fan_in_group([tasks.ok.s(1)], then=tasks.slow_successor.s("ends-in-outage", 2)).apply_async()
    wait_for(lambda: handle.batch_status().successor_state == "running", 30, message="the successor running")
    pg_proxy.cut()
    wait_for(lambda: successor_runs(handle.batch_id), 20, message="the successor body to finish (during the cut)")
    _hold_cut(pg_proxy, 15, [worker, relay])  # well past the old five attempts (about 6 s)
    assert handle.batch_status().successor_state == "running"
    pg_proxy.restore()
    wait_for(lambda: handle.batch_status().successor_state == "succeeded", 30, message="the successor's state recorded")
    wait_for(lambda: relay.output().count("relay round failed") >= 1, 5, message="the relay saw the outage")
    # A rerun would come from the relay's stalled-successor check (every second) past successor_timeout (3 s).
    until = time.monotonic() + 5

    def no_rerun() -> bool:
        assert handle.batch_status().successor_runs == 1
        return time.monotonic() >= until

    wait_for(no_rerun, 15, interval=0.5, message="5 s without a second run")
    assert len(successor_runs(handle.batch_id)) == 1
    assert "gave up" not in worker.output()


@pytest.mark.timeout(120)
def test_relay_recovers_from_a_database_cut(
    producer: Any, processes: Any, successor_runs: Runs, pg_proxy: TcpProxy, e2e_env: dict[str, str]
) -> None:
    """The relay alone is cut off: the NOTIFY for a successor created meanwhile is lost with its LISTEN
    connection; the relay reconnects when the store is back and publishes it."""
    processes.worker(RELAY_PUBLISHES)
    relay = processes.relay(extra_env=_through(pg_proxy, e2e_env))
    first = fan_in_group([tasks.ok.s(1)], then=tasks.record_run.s("before")).apply_async()
    assert first.wait_batch(timeout=30).successor_state == "succeeded"
    pg_proxy.cut()
    wait_for(lambda: "relay round failed" in relay.output(), 30, message="the relay to notice the cut")
    second = fan_in_group([tasks.ok.s(2)], then=tasks.record_run.s("during")).apply_async()
    wait_for(
        lambda: second.batch_status().successor_state == "pending", 30, message="the successor waiting in the outbox"
    )
    accepted = pg_proxy.accepted
    pg_proxy.restore()
    assert second.wait_batch(timeout=40).successor_state == "succeeded"
    assert pg_proxy.accepted > accepted  # reconnected through the proxy (nothing else reaches the relay)
    assert len(successor_runs(second.batch_id)) == 1
    assert relay.proc.poll() is None


@pytest.mark.timeout(150)
def test_worker_and_relay_recover_from_a_broker_cut(
    producer: Any, processes: Any, successor_runs: Runs, e2e_env: dict[str, str]
) -> None:
    """The worker's and the relay's Redis connections are cut while a batch waits: once Redis is reachable
    again the worker consumes the children and the relay publishes the successor, neither restarted."""
    with proxy_for(e2e_env["FANIN_TEST_BROKER"], 6379) as broker:
        env = {"FANIN_TEST_BROKER": broker.url(e2e_env["FANIN_TEST_BROKER"])}
        # The worker leaves its successors to the relay: one that published its own left the relay nothing to
        # recover, and this test could not fail on the relay's side.
        worker = processes.worker(extra_env={**env, **RELAY_PUBLISHES})
        relay = processes.relay(extra_env=env)
        first = fan_in_group([tasks.ok.s(1)], then=tasks.record_run.s("before")).apply_async()
        assert first.wait_batch(timeout=30).successor_state == "succeeded"
        broker.cut()
        second = fan_in_group([tasks.ok.s(i) for i in range(3)], then=tasks.record_run.s("after")).apply_async()
        _hold_cut(broker, 5, [worker, relay])
        assert second.batch_status().remaining == 3  # the worker could not consume meanwhile
        broker.restore()
        status = second.wait_batch(timeout=60)
        assert (status.succeeded, status.successor_state, status.successor_runs) == (3, "succeeded", 1)
        assert status.successor_duplicates == 0
        assert len(successor_runs(second.batch_id)) == 1
        # The relay sent both successors, each once (it logs a publish after the commit that marks it sent).
        published = f"published successor batch_id={second.batch_id} "
        wait_for(lambda: published in relay.output(), 20, message="the relay's publish of the second successor")
        log = relay.output()
        assert log.count(f"published successor batch_id={first.batch_id} ") == 1
        assert log.count(published) == 1


def _past_expiry_by(producer: Any, batch_id: str, seconds: float) -> bool:
    """The batch's expiring child's `expires` passed more than `seconds` ago, by the database's clock (the relay's)."""
    with FanIn.of(producer).engine.connect() as conn:
        return bool(
            conn.execute(
                text(
                    "SELECT bool_and(expires_at + make_interval(secs => :s) < now()) FROM fanin_children "
                    "WHERE batch_id = :b AND expires_at IS NOT NULL"
                ),
                {"b": batch_id, "s": seconds},
            ).scalar_one()
        )


@pytest.mark.timeout(120)
@pytest.mark.parametrize("track_started", ["1", "0"], ids=["track_started", "track_started_off"])
def test_a_start_held_up_by_a_short_cut_keeps_the_expiry_sweep_off_a_running_child(
    producer: Any, processes: Any, successor_runs: Runs, pg_proxy: TcpProxy, e2e_env: dict[str, str], track_started: str
) -> None:
    """Issue 38, hole 4: a child with `expires` shorter than its run starts while its worker cannot reach
    PostgreSQL (a 3 s cut, shorter than `fanin_report_timeout`). Its start is kept and written once the store is
    back, and the relay's expiry sweep (expires_grace 1 s, so it waits 1 + report_timeout past `expires`) never
    counts it revoked: the batch ends with the child's own success. Before, the start was dropped after three quick
    attempts, the sweep counted the child `revoked` 1 s past its expiry, and its success arrived as a late report.

    With `fanin_track_started = False` the start of a child with `expires` is still written (the sweep needs it);
    before, none was, and the sweep counted every such child still running past its expiry plus the grace."""
    timeouts = {"FANIN_TEST_REPORT_TIMEOUT": "8", "FANIN_TEST_EXPIRES_GRACE": "1"}
    env = {**_through(pg_proxy, e2e_env), **timeouts, "FANIN_TEST_TRACK_STARTED": track_started}
    worker = processes.worker(extra_env=env)
    relay = processes.relay(extra_env=timeouts)  # straight to the database: its sweep runs every second throughout
    warm = fan_in_group([tasks.ok.s(0)], then=tasks.record_run.s("warm")).apply_async()
    assert warm.wait_batch(timeout=30).successor_state == "succeeded"  # the worker is up and has used the store
    pg_proxy.cut()
    handle = fan_in_group([tasks.sleepy.s(24).set(expires=4)], then=tasks.record_run.s("expiring")).apply_async()
    wait_for(lambda: "writing start records failed" in worker.output(), 20, message="the start meeting the cut")
    _hold_cut(pg_proxy, 3, [worker, relay])
    assert child_states(producer, handle.batch_id) == {"pending": 1}  # nothing got through meanwhile
    pg_proxy.restore()
    wait_for(lambda: child_states(producer, handle.batch_id) != {"pending": 1}, 15, message="the start written")
    assert child_states(producer, handle.batch_id) == {"started": 1}
    # The sweep may count it from 1 + 8 s past `expires`; two of its rounds later, the child still runs (24 s).
    wait_for(lambda: _past_expiry_by(producer, handle.batch_id, 11), 20, message="the sweep's grace to pass")
    assert child_states(producer, handle.batch_id) == {"started": 1}, "the sweep counted a running child"
    status = handle.wait_batch(timeout=30)
    assert (status.succeeded, status.failed, status.remaining) == (1, 0, 0), status
    assert status.successor_state == "succeeded" and status.successor_runs == 1
    runs = successor_runs(handle.batch_id)
    assert len(runs) == 1 and (runs[0]["outcome"]["succeeded"], runs[0]["outcome"]["failed"]) == (1, 0)
    with FanIn.of(producer).engine.connect() as conn:
        late = conn.execute(
            text("SELECT late_reports FROM fanin_children WHERE batch_id = :b"), {"b": handle.batch_id}
        ).scalar_one()
    assert late == 0  # its success was counted, not late
    assert "dropped" not in worker.output() and "child expired unconsumed" not in relay.output()
