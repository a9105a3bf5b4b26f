"""Prometheus metrics for celery-fanin, read from the store when Prometheus scrapes.

``serve(fanin, port, relay=relay)`` starts an HTTP endpoint (``/metrics``) in a background thread; the relay runs
it with ``celery -A proj fanin relay --metrics-port 9808``. Every value comes from Postgres (so one endpoint
covers every worker and producer) except the relay's own counters, which come from the relay it serves beside.

============================================  =========  ============================================================
metric                                        type       meaning
============================================  =========  ============================================================
``fanin_up``                                  gauge      1 if the last scrape could read the store, else 0
``fanin_batches_open``                        gauge      batches not finished yet (being written, or running)
``fanin_batches_stuck``                       gauge      open batches without a child starting or finishing for
                                                         `stuck_after` seconds (and older than that)
``fanin_children_finished_total{state}``      counter    children that reached a terminal state since the exporter
                                                         started, by state; ``rate()`` gives children per second
``fanin_outbox_backlog``                      gauge      successors waiting to be published
``fanin_outbox_oldest_pending_seconds``       gauge      age of the oldest of them (0 when none)
``fanin_successor_latency_seconds``           histogram  from a batch's completion to its successor's start
``fanin_relay_reconcile_repairs_total``       counter    batches reconciliation repaired (relay only)
``fanin_relay_*_total``                       counter    the relay's other work: successors and children published,
                                                         children redriven or lost, deadlines, restarts, errors
============================================  =========  ============================================================

Counters derived from the store count what happened since the exporter started, a scrape at a time: each scrape
reads the rows whose timestamp falls between the previous scrape and two seconds ago, so a report whose
transaction stayed open longer than that is missed (they are single statements, so in practice none is). A
child that reaches a terminal state after its batch finished long ago (a revoked leftover) is not counted.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy import Connection
from sqlalchemy.exc import SQLAlchemyError

from ..context import FanIn
from ..store import observability, outbox

logger = logging.getLogger("celery_fanin.metrics")

DEFAULT_PORT = 9808
# Seconds the watermark trails the database clock, so that a report's transaction can commit before it is read.
LAG_SECONDS = 2.0
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0)

# Relay statistics exported as counters: attribute of RelayStats -> (metric name, help).
_RELAY_COUNTERS = {
    "repairs": ("fanin_relay_reconcile_repairs", "Batches whose counters or successor reconciliation repaired."),
    "successors_published": ("fanin_relay_successors_published", "Successors the relay published."),
    "children_published": ("fanin_relay_children_published", "Children the relay published for a dead producer."),
    "children_redriven": ("fanin_relay_children_redriven", "Lost children published again (on_lost=redrive)."),
    "children_lost": ("fanin_relay_children_lost", "Children counted as lost after child_timeout."),
    "children_expired": ("fanin_relay_children_expired", "Children counted as revoked: expired, never taken."),
    "deadlines_applied": ("fanin_relay_deadlines_applied", "Batches finished by their deadline."),
    "successors_restarted": ("fanin_relay_successors_restarted", "Stalled successors published again."),
    "open_batches_sealed": ("fanin_relay_open_batches_sealed", "Open batches sealed after their producer was gone."),
    "errors": ("fanin_relay_errors", "Relay rounds that failed and were retried."),
    "rounds": ("fanin_relay_rounds", "Relay rounds run."),
}


class FanInCollector(Collector):
    """Reads the store on every scrape; keeps the counters and the histogram that scrapes add to."""

    def __init__(self, fanin: FanIn, relay: Any = None, stuck_after: float = 600.0) -> None:
        self.fanin = fanin
        self.relay = relay
        self.stuck_after = stuck_after
        self._lock = threading.Lock()
        self._since: datetime | None = None  # the watermark, in database time
        self._finished = Counter("fanin_children_finished", "Children that reached a terminal state, by state.",
                                 ["state"], registry=None)  # fmt: skip
        self._latency = Histogram("fanin_successor_latency_seconds",
                                  "Seconds from a batch's completion to the start of its successor.",
                                  buckets=LATENCY_BUCKETS, registry=None)  # fmt: skip

    def describe(self) -> Iterable[Metric]:
        return []  # collected on scrape only: registering must not query the store

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            started = time.monotonic()
            up = 1.0
            gauges: list[Metric] = []
            try:
                with self.fanin.engine.connect() as conn:
                    gauges = list(self._read(conn))
                    conn.rollback()
            except SQLAlchemyError as exc:
                up = 0.0
                logger.warning("metrics: cannot read the fan-in store: %s", str(exc).splitlines()[0])
            yield GaugeMetricFamily("fanin_up", "1 if the last scrape could read the fan-in store.", value=up)
            yield from gauges
            yield from self._finished.collect()
            yield from self._latency.collect()
            yield from self._relay_metrics()
            yield GaugeMetricFamily("fanin_scrape_duration_seconds", "Seconds the last scrape took.",
                                    value=time.monotonic() - started)  # fmt: skip

    def _read(self, conn: Connection) -> Iterator[Metric]:
        open_, stuck = observability.open_and_stuck(conn, self.stuck_after)
        yield GaugeMetricFamily("fanin_batches_open", "Batches not finished yet.", value=open_)
        yield GaugeMetricFamily(
            "fanin_batches_stuck", f"Open batches with no child started or finished for {self.stuck_after:g}s.",
            value=stuck,
        )  # fmt: skip
        backlog, oldest = outbox.backlog(conn)
        yield GaugeMetricFamily("fanin_outbox_backlog", "Successors waiting to be published.", value=backlog)
        yield GaugeMetricFamily("fanin_outbox_oldest_pending_seconds", "Age of the oldest unpublished successor.",
                                value=float(oldest or 0.0))  # fmt: skip
        self._advance(conn)

    def _advance(self, conn: Connection) -> None:
        """Add what happened between the watermark and now (less the lag) to the counters and the histogram."""
        until = observability.database_now(conn, LAG_SECONDS)
        since, self._since = self._since, until
        if since is None or until <= since:  # the first scrape sets the watermark: count from here on
            return
        for state, count in observability.finished_by_state(conn, since, until):
            self._finished.labels(state=state).inc(count)
        for seconds in observability.successor_latencies(conn, since, until):
            self._latency.observe(max(0.0, seconds))

    def _relay_metrics(self) -> Iterator[Metric]:
        stats = getattr(self.relay, "stats", None)
        if stats is None:
            return
        for attribute, (name, doc) in _RELAY_COUNTERS.items():
            value = getattr(stats, attribute, None)
            if value is not None:
                family = CounterMetricFamily(name, doc)
                family.add_metric([], float(value))
                yield family


@dataclass
class MetricsServer:
    """A running metrics endpoint; `stop()` shuts it down."""

    port: int
    registry: CollectorRegistry
    collector: FanInCollector
    _server: Any
    _thread: threading.Thread

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)


def registry_for(
    fanin: FanIn, relay: Any = None, stuck_after: float = 600.0
) -> tuple[CollectorRegistry, FanInCollector]:
    """A registry with the fan-in collector and the process's own metrics (CPU, memory, file descriptors, GC)."""
    registry = CollectorRegistry(auto_describe=False)
    collector = FanInCollector(fanin, relay=relay, stuck_after=stuck_after)
    registry.register(collector)
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    return registry, collector


def serve(
    fanin: FanIn, port: int = DEFAULT_PORT, addr: str = "0.0.0.0", *, relay: Any = None, stuck_after: float = 600.0
) -> MetricsServer:
    """Serve the metrics on ``http://addr:port/metrics`` from a daemon thread (port 0: any free port)."""
    registry, collector = registry_for(fanin, relay=relay, stuck_after=stuck_after)
    server, thread = start_http_server(port, addr=addr, registry=registry)
    bound = int(server.server_port)
    logger.info("serving Prometheus metrics on http://%s:%d/metrics", addr, bound)
    return MetricsServer(bound, registry, collector, server, thread)
