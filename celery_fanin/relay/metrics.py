"""Prometheus metrics read from the store when Prometheus scrapes, plus the relay's own counters;
`serve(fanin, port, relay=relay)` serves them with the relay's `/healthz` and `/readyz` probes
(docs/reference/metrics.md lists them).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import (
    CollectorRegistry,
    Counter,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    make_wsgi_app,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy import Connection
from sqlalchemy.exc import SQLAlchemyError

from ..context import FanIn
from ..store import observability, outbox
from ..store.statements import q

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
    "replacements_lost": (
        "fanin_relay_replacements_lost",
        "Replaced successors recorded failed (ReplacementLost) after fanin_replaced_timeout.",
    ),
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
        self._finished = Counter(
            "fanin_children_finished", "Children that reached a terminal state, by state.", ["state"], registry=None
        )
        self._latency = Histogram(
            "fanin_successor_latency_seconds",
            "Seconds from a batch's completion to the start of its successor.",
            buckets=LATENCY_BUCKETS,
            registry=None,
        )
        self._successors = Counter(
            "fanin_successors_finished", "Successors that reached a final state, by state.", ["state"], registry=None
        )

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
            yield from self._successors.collect()
            yield from self._latency.collect()
            yield from self._relay_metrics()
            yield GaugeMetricFamily(
                "fanin_scrape_duration_seconds", "Seconds the last scrape took.", value=time.monotonic() - started
            )

    def _read(self, conn: Connection) -> Iterator[Metric]:
        open_, stuck = observability.open_and_stuck(conn, self.stuck_after)
        yield GaugeMetricFamily("fanin_batches_open", "Batches not finished yet.", value=open_)
        yield GaugeMetricFamily(
            "fanin_batches_stuck",
            f"Open batches with no child started or finished for {self.stuck_after:g}s.",
            value=stuck,
        )
        backlog, oldest = outbox.backlog(conn)
        yield GaugeMetricFamily("fanin_outbox_backlog", "Successors waiting to be published.", value=backlog)
        yield GaugeMetricFamily(
            "fanin_outbox_oldest_pending_seconds",
            "Age of the oldest unpublished successor.",
            value=float(oldest or 0.0),
        )
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
        for state, count in observability.successors_finished_by_state(conn, since, until):
            self._successors.labels(state=state).inc(count)

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


def health(fanin: FanIn, relay: Any = None, ready: bool = False) -> tuple[bool, dict[str, str]]:
    """The probes' checks: the relay's loop went round within ``fanin_relay_stall_timeout`` (if a relay is served),
    and for readiness the store answers. Returns (all passed, check -> "ok" or why not)."""
    checks: dict[str, str] = {}
    if relay is not None:
        stalled = relay.stalled_for(fanin.settings.relay_stall_timeout)
        checks["relay_loop"] = "ok" if stalled is None else f"no round for {stalled:.0f}s"
    if ready:
        try:
            with fanin.engine.connect() as conn:
                conn.execute(q("ping").text)
            checks["database"] = "ok"
        except SQLAlchemyError as exc:
            checks["database"] = f"unreachable: {str(exc).splitlines()[0]}"
    return all(v == "ok" for v in checks.values()), checks


def wsgi_app(registry: CollectorRegistry, fanin: FanIn, relay: Any = None) -> Callable[..., Any]:
    """``/healthz`` and ``/readyz`` (JSON, 200 or 503), and the metrics on every other path, as prometheus_client
    serves them."""
    metrics_app = make_wsgi_app(registry)

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path not in ("/healthz", "/readyz"):
            return metrics_app(environ, start_response)  # type: ignore[no-any-return]
        ok, checks = health(fanin, relay, ready=path == "/readyz")
        body = json.dumps({"status": "ok" if ok else "failing", "checks": checks}).encode()
        status = "200 OK" if ok else "503 Service Unavailable"
        start_response(status, [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
        return [body]

    return app


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a slow scrape or probe never holds up the process's exit


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's signature
        """No access log per scrape or probe on stderr."""


def serve(
    fanin: FanIn, port: int = DEFAULT_PORT, addr: str = "127.0.0.1", *, relay: Any = None, stuck_after: float = 600.0
) -> MetricsServer:
    """Serve the metrics on ``http://addr:port/metrics`` (and the ``/healthz``, ``/readyz`` probes) from a daemon
    thread (port 0: any free port). Loopback by default: the counters name queues and tasks, so another host sees
    them only when `addr` says so."""
    registry, collector = registry_for(fanin, relay=relay, stuck_after=stuck_after)
    server = make_server(addr, port, wsgi_app(registry, fanin, relay), _ThreadingServer, handler_class=_QuietHandler)
    thread = threading.Thread(target=server.serve_forever, name="fanin-metrics", daemon=True)
    thread.start()
    bound = int(server.server_port)
    logger.info("serving Prometheus metrics on http://%s:%d/metrics (probes: /healthz, /readyz)", addr, bound)
    return MetricsServer(bound, registry, collector, server, thread)
