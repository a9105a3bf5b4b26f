"""The Prometheus endpoint: scraped over HTTP while a batch is created, its children finish, the relay publishes
its successor and the successor starts."""

from __future__ import annotations

import json
import re
import threading
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import text

from celery_fanin import FanIn, fan_in_group
from celery_fanin.relay import Relay, metrics
from celery_fanin.store import successors
from celery_fanin.store.reports import record_terminal
from celery_fanin.worker import successor_runs
from tests.sql import Held
from tests.workers import ROOT, wait_for

# Far longer than the test takes: no batch turns stuck by itself while it runs, only when the test ages it.
STUCK_AFTER = 600.0


def scrape(server: metrics.MetricsServer) -> dict[str, float]:
    """Every sample of the endpoint, keyed by name and labels as Prometheus would show them."""
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10) as response:
        assert response.status == 200
        body = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(body):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples


@pytest.fixture
def relay(app: Celery) -> Relay:
    return Relay(FanIn.of(app), poll_interval=0.1)


@pytest.fixture
def server(app: Celery, relay: Relay, monkeypatch: pytest.MonkeyPatch) -> Iterator[metrics.MetricsServer]:
    monkeypatch.setattr(metrics, "LAG_SECONDS", 0.0)  # count rows as soon as they are committed
    srv = metrics.serve(FanIn.of(app), 0, "127.0.0.1", relay=relay, stuck_after=STUCK_AFTER)
    yield srv
    srv.stop()


def _finish(app: Celery, task_id: str, state: str) -> None:
    with FanIn.of(app).engine.begin() as conn:
        assert record_terminal(Held(conn), task_id, state).counted


def test_metrics_follow_a_batch(app: Celery, server: metrics.MetricsServer, relay: Relay) -> None:
    first = scrape(server)
    assert first["fanin_up"] == 1
    assert (first["fanin_batches_open"], first["fanin_batches_stuck"], first["fanin_outbox_backlog"]) == (0, 0, 0)
    assert first["fanin_successor_latency_seconds_count"] == 0
    assert "process_cpu_seconds_total" in first, "the process's own metrics are served too"

    ids = [str(uuid.uuid4()) for _ in range(3)]
    children = [app.signature("tests.metrics.child", args=(i,)).set(task_id=ids[i]) for i in range(3)]
    handle = fan_in_group(children, then=app.signature("tests.metrics.successor"), app=app).apply_async()
    created = scrape(server)
    assert (created["fanin_batches_open"], created["fanin_batches_stuck"]) == (1, 0)

    # Quiet for longer than stuck_after, without waiting for it: the batch is made older than that.
    with FanIn.of(app).engine.begin() as conn:
        conn.execute(
            text("UPDATE fanin_batches SET created_at = created_at - make_interval(secs => :s) WHERE id = :b"),
            {"s": 2 * STUCK_AFTER, "b": handle.batch_id},
        )
    assert scrape(server)["fanin_batches_stuck"] == 1

    _finish(app, ids[0], "succeeded")
    _finish(app, ids[1], "succeeded")
    progressing = scrape(server)
    assert progressing["fanin_batches_stuck"] == 0, "a finished child is progress"
    _finish(app, ids[2], "failed")
    done = scrape(server)
    assert done['fanin_children_finished_total{state="succeeded"}'] == 2
    assert done['fanin_children_finished_total{state="failed"}'] == 1
    assert (done["fanin_batches_open"], done["fanin_outbox_backlog"]) == (0, 1)
    assert done["fanin_outbox_oldest_pending_seconds"] >= 0

    assert relay.run_once(maintenance=False) == 1  # publishes the successor (to the test Redis)
    published = scrape(server)
    assert published["fanin_outbox_backlog"] == 0
    assert published["fanin_outbox_oldest_pending_seconds"] == 0
    assert published["fanin_relay_successors_published_total"] == 1
    assert published["fanin_relay_reconcile_repairs_total"] == 0

    status = handle.batch_status()
    with FanIn.of(app).engine.begin() as conn:  # what a worker's run guard does when the successor starts
        run = successors.claim_run(
            Held(conn),
            uuid.UUID(handle.batch_id),
            status.step,
            status.successor_task_id,
            0,
            lease=60,
            grace=60,
            owner="t",
        )
        assert isinstance(run, successors.Run)
    started = scrape(server)
    assert started["fanin_successor_latency_seconds_count"] == 1
    assert 0 <= started["fanin_successor_latency_seconds_sum"] < 60
    # Counters only grow: a later scrape does not count the same children again.
    assert started['fanin_children_finished_total{state="succeeded"}'] == 2
    assert not any(name.startswith("fanin_successors_finished_total{") for name in started)

    assert successor_runs.record_final(FanIn.of(app), handle.batch_id, status.step, "failed", run=run.number)
    finished = scrape(server)
    assert finished['fanin_successors_finished_total{state="failed"}'] == 1  # what "successors failing" alerts on
    assert scrape(server)['fanin_successors_finished_total{state="failed"}'] == 1


def probe(server: metrics.MetricsServer, path: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}{path}", timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_probes_follow_the_relay_loop_and_the_store(app: Celery, server: metrics.MetricsServer, relay: Relay) -> None:
    assert probe(server, "/healthz") == (200, {"status": "ok", "checks": {"relay_loop": "ok"}})
    assert probe(server, "/readyz") == (200, {"status": "ok", "checks": {"relay_loop": "ok", "database": "ok"}})
    # A loop that has not gone round for longer than fanin_relay_stall_timeout (its last beat moved back).
    relay._beat -= 2 * FanIn.of(app).settings.relay_stall_timeout
    code, body = probe(server, "/healthz")
    assert code == 503 and body["status"] == "failing" and body["checks"]["relay_loop"].startswith("no round for")
    assert probe(server, "/readyz")[0] == 503
    relay.beat()
    assert probe(server, "/healthz")[0] == 200


def test_the_relay_loop_beats_while_it_runs(app: Celery) -> None:
    relay = Relay(FanIn.of(app), poll_interval=0.1)
    relay._beat -= 10_000.0
    thread = threading.Thread(target=relay.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: relay.stalled_for(60.0) is None and relay.stats.rounds > 0, 30, message="a beat")
        assert relay.stalled_for(60.0) is None
    finally:
        relay.stop()
        thread.join(15)
    assert not thread.is_alive()


def test_an_unreachable_store_is_reported_not_raised() -> None:
    app = Celery("metrics-down", set_as_current=False)
    app.conf.fanin_database_url = "postgresql://nobody@127.0.0.1:1/none"
    app.conf.fanin_pool_size = 1
    srv = metrics.serve(FanIn(app), 0, "127.0.0.1")
    try:
        samples = scrape(srv)
        readiness, liveness = probe(srv, "/readyz"), probe(srv, "/healthz")
    finally:
        srv.stop()
        FanIn.of(app).dispose()
    assert samples["fanin_up"] == 0
    assert "fanin_batches_open" not in samples
    assert readiness[0] == 503 and readiness[1]["checks"]["database"].startswith("unreachable")
    assert liveness == (200, {"status": "ok", "checks": {}}), "no relay here: alive while it serves"


def _names(exposition: str) -> tuple[set[str], set[str]]:
    """The names a query can use (a counter's `_total`, a histogram's `_bucket`, `_sum` and `_count`, a gauge's),
    and each metric's name as the reference lists it (a histogram by its own name)."""
    samples, metrics_ = set(), set()
    for family in text_string_to_metric_families(exposition):
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}.get(family.type, ("",))
        samples |= {family.name + suffix for suffix in suffixes}
        metrics_.add(family.name + ("_total" if family.type == "counter" else ""))
    return samples, metrics_


def test_the_dashboard_alerts_and_reference_use_only_metrics_that_exist(server: metrics.MetricsServer) -> None:
    """docs/ops/ (the Grafana dashboard, the Prometheus rules) and docs/reference/metrics.md name only metrics that
    the endpoint (a relay's) or a worker's registry exposes, and the reference lists every one of them."""
    import yaml
    from prometheus_client import REGISTRY, generate_latest

    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10) as response:
        exposed, listed = _names(response.read().decode())
    worker_samples, worker_metrics = _names(generate_latest(REGISTRY).decode())  # the workers' own counters
    exposed |= worker_samples
    listed |= worker_metrics

    ops = ROOT / "docs" / "ops"
    dashboard = json.loads((ops / "grafana-dashboard.json").read_text())
    rules = yaml.safe_load((ops / "alerts.yml").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [r["expr"] for group in rules["groups"] for r in group["rules"]]
    used = {name for e in exprs for name in re.findall(r"\bfanin_[a-z_]+", e)}
    assert len(used) > 15 and used <= exposed, used - exposed
    alerts = {r["alert"] for group in rules["groups"] for r in group["rules"]}
    assert {"FanInBatchesStuck", "FanInRelayLagging", "FanInSuccessorsFailing"} <= alerts
    assert all(r.get("annotations", {}).get("summary") for group in rules["groups"] for r in group["rules"])

    reference = (ROOT / "docs" / "reference" / "metrics.md").read_text()
    documented = set(re.findall(r"^\| `(fanin_[a-z_]+)", reference, re.M))
    ours = {name for name in listed if name.startswith("fanin_") and not name.endswith("_created")}
    assert documented == ours, documented ^ ours


def test_the_relay_metrics_listen_on_loopback_unless_told(app: Celery, monkeypatch: pytest.MonkeyPatch) -> None:
    """`fanin relay --metrics-port` binds 127.0.0.1 (the counters name queues and tasks); `--metrics-host` widens it.
    The address each run binds is read from the started server itself."""
    from types import SimpleNamespace

    from click.testing import CliRunner

    from celery_fanin.cli import commands, fanin

    bound: list[str] = []
    real_serve = metrics.serve

    def serve(*args: Any, **kwargs: Any) -> metrics.MetricsServer:
        srv = real_serve(*args, **{**kwargs, "stuck_after": STUCK_AFTER})
        bound.append(srv._server.server_address[0])
        srv.stop()
        return srv

    monkeypatch.setattr(commands, "serve", serve)
    for extra in ([], ["--metrics-host", "0.0.0.0"]):
        result = CliRunner().invoke(
            fanin, ["relay", "--once", "--metrics-port", "0", *extra], obj=SimpleNamespace(app=app)
        )
        assert result.exit_code == 0, result.output
    assert bound == ["127.0.0.1", "0.0.0.0"]
    assert metrics.serve.__defaults__ == (metrics.DEFAULT_PORT, "127.0.0.1")
