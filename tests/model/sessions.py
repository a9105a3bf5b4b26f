"""Database sessions for the protocol model: each a psycopg connection (through SQLAlchemy) driven by a thread.

The model runs every operation in one of a few sessions. An operation is one transaction; a *held* operation
leaves its transaction open (its locks held) until the model releases it, so other sessions' statements really
wait on its locks and, at READ COMMITTED, re-evaluate their WHERE clauses on the row versions it commits.
After each step the model waits until every session is settled: idle, holding, or waiting on a lock (as
`pg_stat_activity` reports it), so that the same steps give the same interleaving, which shrinking needs.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import psycopg
from sqlalchemy import Connection, Engine

from celery_fanin import retry

# Bounds: nothing in the model waits longer than these (a stuck session fails the example instead of hanging).
SETTLE_TIMEOUT = 60.0
HOLD_LIMIT = 120.0
# Set on every session: a lock wait or a statement longer than this is an error (a hang, not a protocol step).
SESSION_SETTINGS = "SET lock_timeout = '30s'; SET statement_timeout = '45s'; SET deadlock_timeout = '200ms'"


@dataclass
class Op:
    """One transaction the model runs: `fn(conn)` and what to do once it committed or aborted."""

    label: str
    fn: Callable[[Connection], Any]
    on_commit: Callable[[Any], None] = lambda result: None
    on_abort: Callable[[BaseException | None], None] = lambda exc: None
    # Errors that end this operation without a violation (besides transient ones, which its caller retries).
    expected: tuple[type[BaseException], ...] = ()


class Rollback(Exception):
    """Raised by an operation to end its transaction with a rollback (a producer whose chunk was refused)."""


@dataclass
class Completion:
    op: Op
    committed: bool
    result: Any = None
    error: BaseException | None = None


@dataclass
class Shared:
    """What the sessions hand back to the model: completions, in the order their transactions ended."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    completions: list[Completion] = field(default_factory=list)
    transient_aborts: int = 0


class Session:
    """One database session and the thread that runs its statements."""

    def __init__(self, engine: Engine, name: str, shared: Shared) -> None:
        self.name = name
        self.shared = shared
        self.conn = engine.connect()
        self.conn.exec_driver_sql(SESSION_SETTINGS)
        self.pid = int(self.conn.exec_driver_sql("SELECT pg_backend_pid()").scalar_one())
        self.conn.commit()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"model-{name}")
        self._future: Future[None] | None = None
        self._op_done = threading.Event()
        self._release = threading.Event()
        self._rollback = False
        self.label: str | None = None
        self.holding_requested = False

    @property
    def busy(self) -> bool:
        return self._future is not None and not self._future.done()

    @property
    def holding(self) -> bool:
        """Its operation ran and its transaction is open, waiting for `release`."""
        return self.busy and self.holding_requested and self._op_done.is_set()

    def submit(self, op: Op, hold: bool) -> None:
        assert not self.busy, f"session {self.name} is busy with {self.label}"
        self.label = op.label
        self.holding_requested = hold
        self._op_done = threading.Event()
        self._release = threading.Event()
        self._rollback = False
        self._future = self._executor.submit(self._run, op, hold)

    def release(self, *, commit: bool) -> None:
        """End the held transaction. The session is running again from here until its commit or rollback is done
        (and its completion handed back), so that `settle` waits for it: left `holding` until its thread ended,
        it let the model check the database while that commit landed, and the invariants saw a commit whose
        completion the model had not had yet (a successor's run counted in the table, not in the model)."""
        self.holding_requested = False
        self._rollback = not commit
        self._release.set()

    def _run(self, op: Op, hold: bool) -> None:
        conn = self.conn
        try:
            tx = conn.begin()
            try:
                result = op.fn(conn)
                if hold:
                    self._op_done.set()
                    self._release.wait(HOLD_LIMIT)
                    if self._rollback:
                        raise Rollback("released with a rollback")
                with self.shared.lock:
                    tx.commit()
                    self.shared.completions.append(Completion(op, True, result))
            except BaseException as exc:
                if tx.is_active:
                    tx.rollback()
                with self.shared.lock:
                    self.shared.completions.append(Completion(op, False, error=exc))
        finally:
            self._op_done.set()

    def close(self) -> None:
        self._release.set()
        self._rollback = True
        if self._future is not None:
            self._future.result(timeout=HOLD_LIMIT)
        self._executor.shutdown(wait=True)
        try:
            self.conn.close()
        except Exception:  # a connection broken by a failed example: nothing to keep
            self.conn.invalidate()


def lock_waiters(monitor: psycopg.Connection[Any], pids: list[int]) -> set[int]:
    """Which of these backends are waiting on a lock now."""
    rows = monitor.execute(
        "SELECT pid FROM pg_stat_activity WHERE pid = ANY(%s) AND wait_event_type = 'Lock'", [pids]
    ).fetchall()
    return {int(r[0]) for r in rows}


def settle(sessions: list[Session], monitor: psycopg.Connection[Any]) -> None:
    """Wait until every session is idle, holding its transaction, or waiting on a lock."""
    deadline = time.monotonic() + SETTLE_TIMEOUT
    while True:
        running = [s for s in sessions if s.busy and not s.holding]
        if not running:
            return
        waiting = lock_waiters(monitor, [s.pid for s in running])
        if all(s.pid in waiting for s in running):
            # Check again a moment later: a waiter granted its lock just now is running, not waiting.
            time.sleep(0.005)
            running = [s for s in sessions if s.busy and not s.holding]
            if all(s.pid in lock_waiters(monitor, [s.pid for s in running]) for s in running):
                return
        if time.monotonic() > deadline:
            stuck = ", ".join(f"{s.name}: {s.label}" for s in running)
            raise AssertionError(f"sessions neither finished nor waiting on a lock after {SETTLE_TIMEOUT}s: {stuck}")
        time.sleep(0.002)


# The library retries a lock or statement timeout (celery_fanin.retry), but here they are SESSION_SETTINGS' guards
# against a hang: a violation, never an abort to retry.
_HANG_GUARDS = frozenset({"55P03", "57014"})


def is_transient(exc: BaseException) -> bool:
    """A deadlock or serialization failure: the library's callers run the transaction again (celery_fanin.retry)."""
    sqlstate = getattr(getattr(exc, "orig", None) or exc, "sqlstate", None)
    return sqlstate not in _HANG_GUARDS and retry.is_transient(exc)
