"""The relay sidecar: publishes outbox rows (successors) and children whose producer died before publishing.

It wakes on NOTIFY (sent only by the rare transaction that creates a successor, and not when the worker that
created it publishes it itself) and also polls, because notifications sent while no listener is connected are lost,
and a worker may die before publishing what it created. Database and broker outages are retried with
backoff; SIGTERM and SIGINT finish the current round and stop. Several relays side by side are safe: the outbox
claim skips rows another relay holds, and a batch's children are published under its advisory lock.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import psycopg
from psycopg.conninfo import make_conninfo

from .. import retry
from ..context import FanIn
from ..dispatch import children as child_dispatch
from ..dispatch import successors as successor_dispatch
from ..store.reports import connect_options, libpq_conninfo
from ..store.statements import q
from . import maintenance as maintenance_duties

logger = logging.getLogger("celery_fanin.relay")


@dataclass
class RelayStats:
    successors_published: int = 0
    children_published: int = 0
    children_redriven: int = 0
    children_lost: int = 0
    children_expired: int = 0
    deadlines_applied: int = 0
    successors_restarted: int = 0
    replacements_lost: int = 0
    open_batches_sealed: int = 0
    repairs: int = 0
    rounds: int = 0
    errors: int = 0
    started_at: float = field(default_factory=time.time)


class Relay:
    """One relay loop. `run()` blocks until `stop()` (or SIGTERM/SIGINT when `install_signal_handlers`)."""

    def __init__(self, fanin: FanIn, poll_interval: float | None = None, max_backoff: float = 10.0) -> None:
        self.fanin = fanin
        self.poll_interval = poll_interval if poll_interval is not None else fanin.settings.relay_poll_interval
        self.max_backoff = max_backoff
        self.stats = RelayStats()
        self._stop = threading.Event()
        self._listener: psycopg.Connection[tuple[object, ...]] | None = None
        self._next_reap = 0.0
        self._next_reconcile = 0.0
        # When the loop last went round (or passed from one duty to the next): the liveness probe reads it.
        self._beat = time.monotonic()

    def stop(self, *_: object) -> None:
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def beat(self) -> None:
        self._beat = time.monotonic()

    def stalled_for(self, timeout: float) -> float | None:
        """Seconds since the loop last went round, if that is more than `timeout` (it is stuck); else None."""
        since = time.monotonic() - self._beat
        return since if since > timeout else None

    def install_signal_handlers(self) -> None:
        def handler(signum: int, frame: FrameType | None) -> None:
            logger.info("relay received signal %d, stopping", signum)
            self.stop()

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)

    def run(self) -> RelayStats:
        self.fanin.check_settings()
        self.fanin.check_session_pooling()
        self.fanin.check_schema()
        # The relay never gives up (it is the component that finishes what others could not): a failed round is
        # followed by the shared jittered backoff (celery_fanin.retry), and a fresh LISTEN connection.
        backoff = retry.Backoff(first=0.5, maximum=self.max_backoff)
        failures = 0
        logger.info("relay started (poll every %.1fs)", self.poll_interval)
        while not self._stop.is_set():
            self.beat()
            try:
                self._ensure_listener()
                self.run_once()
                failures = 0
                self._wait()
            except Exception as exc:
                self.stats.errors += 1
                failures += 1
                delay = backoff.delay(failures)
                if retry.is_transient(exc):
                    logger.warning("relay round failed (%s); retrying in %.1fs", retry.brief(exc), delay)
                else:
                    logger.exception("relay round failed; retrying in %.1fs", delay)
                self._close_listener()
                self._stop.wait(delay)
        self._close_listener()
        logger.info("relay stopped: %s", self.stats)
        return self.stats

    def run_once(self, maintenance: bool | None = None) -> int:
        """One round: the periodic duties when due (or when `maintenance` is True), then drain the outbox and
        finish orphaned children. Returns the number of messages published."""
        now = time.monotonic()
        settings = self.fanin.settings
        if maintenance or (maintenance is None and now >= self._next_reap):
            self._next_reap = now + settings.reaper_interval
            lost = maintenance_duties.handle_lost_children(self.fanin)
            self.stats.children_redriven += len(lost.redriven)
            self.stats.children_lost += len(lost.failed)
            self.stats.deadlines_applied += len(maintenance_duties.apply_deadlines(self.fanin))
            self.stats.children_expired += len(maintenance_duties.revoke_expired_children(self.fanin))
            self.stats.successors_restarted += len(maintenance_duties.restart_stalled_successors(self.fanin))
            self.stats.replacements_lost += len(maintenance_duties.fail_lost_replacements(self.fanin))
            self.stats.open_batches_sealed += len(maintenance_duties.seal_lapsed_open_batches(self.fanin))
        if maintenance or (maintenance is None and now >= self._next_reconcile):
            self.beat()
            self._next_reconcile = now + settings.reconcile_interval
            self.stats.repairs += len(maintenance_duties.reconcile(self.fanin))
        published = 0
        while not self._stop.is_set():
            self.beat()
            n = successor_dispatch.publish_outbox(self.fanin)
            published += n
            self.stats.successors_published += n
            if n < settings.relay_batch_size:
                break
        children = child_dispatch.publish_orphaned_children(self.fanin)
        self.stats.children_published += children
        self.stats.rounds += 1
        return published + children

    def _ensure_listener(self) -> None:
        if self._listener is not None and not self._listener.closed:
            return
        url = self.fanin.database_url
        # Named, so that the dashboard's relay panel can see which relays are connected (pg_stat_activity shows
        # every role a session's application_name).
        name = f"celery-fanin relay {socket.gethostname()}:{os.getpid()}"[:63]
        options: dict[str, Any] = {**connect_options(url), "application_name": name}
        conninfo = make_conninfo(libpq_conninfo(url), **options)
        conn = psycopg.connect(conninfo, autocommit=True)
        conn.execute(q("listen_outbox").psycopg)
        self._listener = conn

    def _close_listener(self) -> None:
        if self._listener is not None:
            with contextlib.suppress(Exception):  # closing a broken connection may raise; it is gone either way
                self._listener.close()
        self._listener = None

    def _wait(self) -> None:
        """Sleep until a NOTIFY arrives or the poll interval passes, returning early on stop."""
        assert self._listener is not None
        deadline = time.monotonic() + self.poll_interval
        while not self._stop.is_set():
            self.beat()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            # Short slices so that stop() is honoured promptly.
            for _ in self._listener.notifies(timeout=min(remaining, 0.25), stop_after=1):
                return
