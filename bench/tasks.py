"""The Celery app the benchmark's workers, relay and producers load (`celery -A bench.tasks ...`).

Configured from the environment the harness gives each process (BENCH_BROKER, BENCH_BACKEND, BENCH_REDIS,
BENCH_QUEUE, FANIN_DATABASE_URL). The children are no-ops that also count themselves in Redis, so that the last
one to finish records the time (the plain group's end); the successor's first line records when it started.

With BENCH_COUNT_SQL=1 every pool process counts the statements and network round trips its psycopg connections
make, by what the fan-in hook was doing (recording a child's start, its terminal outcome, a successor's state), and
adds them to the Redis hash ``bench:sql`` after each task: counted at the driver, not estimated.
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from typing import Any

import redis
from celery import Celery, signals

from celery_fanin import FanIn

app = Celery(
    "bench.tasks",
    broker=os.environ.get("BENCH_BROKER", "redis://127.0.0.1:6379/14"),
    backend=os.environ.get("BENCH_BACKEND", "redis://127.0.0.1:6379/14"),
)
app.conf.update(
    fanin_database_url=os.environ.get("FANIN_DATABASE_URL"),
    fanin_relay_poll_interval=1.0,
    task_default_queue=os.environ.get("BENCH_QUEUE", "bench"),
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    result_expires=3600,
    fanin_track_started=os.environ.get("BENCH_TRACK_STARTED", "1") == "1",
    # "0": every successor through the relay, as before the worker published its own (issue 23 item 1)
    fanin_worker_publishes_successors=os.environ.get("BENCH_WORKER_PUBLISHES", "1") == "1",
    fanin_report_batching=os.environ.get("BENCH_REPORT_BATCHING", "0") == "1",
    # "0": every successor published, as before it could run where its batch completed (issue 41)
    fanin_successor_inline=os.environ.get("BENCH_SUCCESSOR_INLINE", "1") == "1",
)
FanIn(app)

_redis: redis.Redis | None = None


def marks() -> redis.Redis:
    """Where runs record their end and start times (a list per run id: the harness BLPOPs it, no polling)."""
    global _redis
    if _redis is None:
        _redis = redis.Redis.from_url(os.environ.get("BENCH_REDIS", "redis://127.0.0.1:6379/14"))
    return _redis


@app.task(name="bench.child")
def child(i: int, run: str, n: int) -> int:
    """A no-op child; the one that brings the run's count to `n` records the time (the last child finished)."""
    r = marks()
    if r.incr(f"bench:done:{run}") == n:
        r.rpush(f"bench:end:{run}", repr(time.time()))
    return i


@app.task(name="bench.mark")
def mark(first: Any, run: str) -> None:
    """The successor (chord body or fan-in successor): its first line records when it started."""
    marks().rpush(f"bench:start:{run}", repr(time.time()))


# --- counting statements and round trips at the driver ------------------------------------------------------------

_counts: Counter[str] = Counter()
_phase = threading.local()
_counts_lock = threading.RLock()  # the starts thread counts and flushes too


def _count(*keys: str, n: int = 1) -> None:
    with _counts_lock:
        for key in keys:
            _counts[key] += n


def _install_sql_counters() -> None:
    """Count, per phase, each statement psycopg executes and each round trip it makes for it.

    psycopg 3 (not in pipeline mode) makes one round trip per `execute`, plus one for the implicit BEGIN before the
    first statement of a transaction, and one per COMMIT/ROLLBACK of an open transaction. The phase is what the
    fan-in hook is doing (from the name of the store call `_with_retries` runs); anything else counts as "other".
    """
    import psycopg
    from psycopg.pq import TransactionStatus

    from celery_fanin.worker import report, successor_runs

    idle = TransactionStatus.IDLE
    execute, commit, rollback = psycopg.Cursor.execute, psycopg.Connection.commit, psycopg.Connection.rollback

    def counting_execute(self: Any, query: Any, params: Any = None, **kwargs: Any) -> Any:
        phase = getattr(_phase, "name", "other")
        conn = self.connection
        if not conn.autocommit and conn.info.transaction_status == idle:
            _count(f"{phase}.roundtrips", f"{phase}.begin")  # BEGIN
        _count(f"{phase}.statements", f"{phase}.roundtrips")
        return execute(self, query, params, **kwargs)

    def counting_commit(self: Any) -> None:
        if self.info.transaction_status != idle:
            _count(f"{getattr(_phase, 'name', 'other')}.roundtrips")
        commit(self)

    def counting_rollback(self: Any) -> None:
        if self.info.transaction_status != idle:
            _count(f"{getattr(_phase, 'name', 'other')}.roundtrips")
        rollback(self)

    psycopg.Cursor.execute = counting_execute  # type: ignore[method-assign]
    psycopg.Connection.commit = counting_commit  # type: ignore[method-assign]
    psycopg.Connection.rollback = counting_rollback  # type: ignore[method-assign]

    def phased(run: Any) -> Any:
        def wrapper(fanin: Any, what: str, fn: Any, **kwargs: Any) -> Any:
            _phase.name = (
                "terminal" if what.startswith("terminal") else "start" if what.startswith("start") else "successor"
            )
            _count(f"{_phase.name}.events")
            try:
                return run(fanin, what, fn, **kwargs)
            finally:
                _phase.name = "other"

        return wrapper

    # Every store call a hook makes goes through one of these two (a successor's run; one-statement reports).
    successor_runs._store = phased(successor_runs._store)
    report.send_terminal = phased(report.send_terminal)

    # Starts are written by a thread of the worker's main process, many per statement: count each child's start
    # as an event there, and flush that process's counts after each write.
    from celery_fanin.worker import starts

    write = starts.StartRecorder._write

    def counted_write(self: Any, batch: list[Any]) -> None:
        _phase.name = "start"
        try:
            write(self, batch)
        finally:
            _phase.name = "other"
        with _counts_lock:
            _counts["start.events"] += len(batch)
            flush_counts()

    starts.StartRecorder._write = counted_write  # type: ignore[method-assign]

    @signals.task_postrun.connect(weak=False)
    def flush_counts(**_: Any) -> None:
        with _counts_lock:
            if _counts:
                pipe = marks().pipeline()
                for key, value in list(_counts.items()):
                    pipe.hincrby("bench:sql", key, value)
                pipe.execute()
                _counts.clear()


if os.environ.get("BENCH_COUNT_SQL") == "1":
    _install_sql_counters()

if os.environ.get("BENCH_TRACE"):
    from bench import trace

    trace.install()
