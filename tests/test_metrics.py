"""The Prometheus endpoint: scraped over HTTP while a batch is created, its children finish, the relay publishes
its successor and the successor starts."""

from __future__ import annotations

import urllib.request
import uuid
from collections.abc import Iterator

import pytest
from celery import Celery
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import text

from celery_fanin import FanIn, fan_in_group
from celery_fanin.relay import Relay, metrics
from celery_fanin.store import batches, successors

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
        assert batches.record_terminal(conn, task_id, state).counted


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

    status = handle.status()
    with FanIn.of(app).engine.begin() as conn:  # what a worker's run guard does when the successor starts
        run = successors.claim_run(
            conn, uuid.UUID(handle.batch_id), status.step, status.successor_task_id, 0, lease=60, grace=60, owner="t"
        )
        assert isinstance(run, successors.Run)
    started = scrape(server)
    assert started["fanin_successor_latency_seconds_count"] == 1
    assert 0 <= started["fanin_successor_latency_seconds_sum"] < 60
    # Counters only grow: a later scrape does not count the same children again.
    assert started['fanin_children_finished_total{state="succeeded"}'] == 2


def test_an_unreachable_store_is_reported_not_raised() -> None:
    app = Celery("metrics-down", set_as_current=False)
    app.conf.fanin_database_url = "postgresql://nobody@127.0.0.1:1/none"
    app.conf.fanin_pool_size = 1
    srv = metrics.serve(FanIn(app), 0, "127.0.0.1")
    try:
        samples = scrape(srv)
    finally:
        srv.stop()
        FanIn.of(app).dispose()
    assert samples["fanin_up"] == 0
    assert "fanin_batches_open" not in samples
