"""One retry policy for every store call that must outlive a PostgreSQL outage: transient errors only,
jittered exponential backoff, bounded by time or by attempts (docs/concepts/worker.md).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import psycopg
from sqlalchemy import Connection, Engine, event
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import ExceptionContext

logger = logging.getLogger("celery_fanin.retry")

T = TypeVar("T")

# SQLSTATE classes and codes that say "try again" (the table in docs/concepts/worker.md, "Which errors are
# transient"; tests/store/test_retry.py checks that the two agree): 08 connection exception, 53 insufficient resources
# (too many connections, out of memory or disk), 57P01-57P05 the server shutting down or starting up, 40001
# serialization failure and 40P01 deadlock (the transaction was rolled back and can simply run again), 55P03
# lock_not_available (`lock_timeout`) and 57014 query_canceled (`statement_timeout`, or a `pg_cancel_backend`):
# the same statement succeeds once the lock's holder or the load is gone; and 25006 read_only_sql_transaction, a
# session on a server that is read-only now (a demoted primary, a standby behind the DNS name), which is retried
# on a new connection: the report connection drops its connection after any error, and `reconnect_on_read_only`
# makes it a disconnect for the SQLAlchemy engines (`context.FanIn.engine`), so that their pools discard it. Our code
# never cancels its own statements: psycopg's cancel on Ctrl-C or a worker's shutdown raises KeyboardInterrupt or
# SystemExit, which `call` does not catch, so a 57014 always comes from the server's timeout or another session.
READ_ONLY = "25006"
_TRANSIENT_CLASSES = frozenset({"08", "53"})
_TRANSIENT_CODES = frozenset(
    {"57P01", "57P02", "57P03", "57P04", "57P05", "40001", "40P01", "55P03", "57014", READ_ONLY}
)
# libpq's text for a login the server refused for good (in the server's lc_messages; English by default).
_REFUSED_LOGIN = (
    "does not exist",
    "password authentication failed",
    "authentication failed",
    "no pg_hba.conf entry",
    "permission denied",
    "no password supplied",
)


def is_transient(exc: BaseException) -> bool:
    """True for errors a later attempt can cure (see the module docstring); False for everything else."""
    if isinstance(exc, sa_exc.DBAPIError):
        if exc.connection_invalidated:
            return True
        return exc.orig is not None and is_transient(exc.orig)
    if isinstance(exc, (sa_exc.DisconnectionError, sa_exc.TimeoutError)):
        return True  # a pre-ping that found the connection dead; no pooled connection free in time
    sqlstate = getattr(exc, "sqlstate", None)
    if isinstance(sqlstate, str):  # psycopg's errors, and any driver error that carries its SQLSTATE the same way
        return sqlstate[:2] in _TRANSIENT_CLASSES or sqlstate in _TRANSIENT_CODES
    if isinstance(exc, psycopg.OperationalError):
        # No server error: the client lost or could not make the connection ("server closed the connection
        # unexpectedly", "connection refused", "the connection is closed"). A refused login carries no SQLSTATE
        # either (libpq reports it as text): a wrong database, role or password is configuration, not an outage.
        message = str(exc)
        return not any(m in message for m in _REFUSED_LOGIN)
    if isinstance(exc, psycopg.Error):
        return False  # InterfaceError and the like: a misuse of the connection
    return isinstance(exc, (ConnectionError, TimeoutError))


def reconnect_on_read_only(engine: Engine) -> Engine:
    """Make `engine` treat 25006 (a read-only session) as a lost connection: the connection is invalidated, and the
    pool's other connections with it (SQLAlchemy's `handle_error` event, `is_disconnect`), so that the next attempt
    connects anew and reaches the server that takes writes now. The setting applies at a session's start: a
    connection kept in the pool would stay on the read-only server for good, its pre-ping passing every time."""
    event.listen(engine, "handle_error", _read_only_is_a_disconnect)
    return engine


def _read_only_is_a_disconnect(context: ExceptionContext) -> None:
    if getattr(context.original_exception, "sqlstate", None) == READ_ONLY:
        context.is_disconnect = True


@dataclass(frozen=True)
class Backoff:
    """Exponential delays with "equal jitter": attempt n waits between half and all of min(maximum, first * 2**n).

    The jitter keeps the workers that lost the database at the same moment from reconnecting in lockstep when it
    comes back; the floor of half the delay keeps the backoff a backoff.
    """

    first: float = 0.2
    maximum: float = 5.0
    factor: float = 2.0

    def delay(self, attempt: int, rng: Callable[[], float] = random.random) -> float:
        """The wait after failed attempt number `attempt` (1-based)."""
        cap = min(self.maximum, self.first * self.factor ** max(0, attempt - 1))
        return cap / 2 + cap / 2 * rng()


DEFAULT_BACKOFF = Backoff()


class GaveUp(Exception):
    """A transient error outlasted the bound; the last error is the `__cause__`."""

    def __init__(self, what: str, attempts: int, elapsed: float) -> None:
        super().__init__(f"gave up {what} after {attempts} attempts in {elapsed:.1f}s")
        self.what = what
        self.attempts = attempts
        self.elapsed = elapsed


def call(
    fn: Callable[[], T],
    *,
    what: str,
    timeout: float | None = None,
    attempts: int | None = None,
    backoff: Backoff = DEFAULT_BACKOFF,
    transient: Callable[[BaseException], bool] = is_transient,
    stop: threading.Event | None = None,
    sleep: Callable[[float], object] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
    rng: Callable[[], float] = random.random,
) -> T:
    """Run `fn` until it returns, retrying transient errors with backoff.

    Bounded by `timeout` seconds (no attempt starts after it; the last wait is shortened to end on it) and/or by
    `attempts`; at least one is required. A permanent error is raised as it is, at once; a transient one past
    the bound is raised as `GaveUp` from it. `stop` (an event) ends the waiting early, as the bound would.
    """
    if timeout is None and attempts is None:
        raise ValueError("retry.call needs a bound: timeout or attempts")
    if attempts is not None and attempts < 1:
        raise ValueError(f"attempts must be at least 1, got {attempts}")
    started = clock()
    deadline = None if timeout is None else started + max(0.0, timeout)
    attempt = 0
    while True:
        attempt += 1
        try:
            return fn()
        except Exception as exc:
            if not transient(exc):
                raise
            now = clock()
            wait = backoff.delay(attempt, rng)
            if deadline is not None:
                wait = min(wait, deadline - now)
            if (attempts is not None and attempt >= attempts) or wait <= 0 or (stop is not None and stop.is_set()):
                raise GaveUp(what, attempt, now - started) from exc
            logger.info("%s failed (attempt %d, %s); retrying in %.2fs", what, attempt, brief(exc), wait)
            if stop is not None:
                if stop.wait(wait):
                    raise GaveUp(what, attempt, clock() - started) from exc
            else:
                sleep(wait)


def transaction(
    engine: Engine,
    fn: Callable[[Connection], T],
    *,
    what: str,
    timeout: float | None = None,
    attempts: int | None = None,
    backoff: Backoff = DEFAULT_BACKOFF,
    stop: threading.Event | None = None,
) -> T:
    """`call` for a store transaction: each attempt runs `fn` in a transaction of its own (`engine.begin()`)."""

    def once() -> T:
        with engine.begin() as conn:
            return fn(conn)

    return call(once, what=what, timeout=timeout, attempts=attempts, backoff=backoff, stop=stop)


def brief(exc: BaseException) -> str:
    """The error's type and the first line of its message, for a log line."""
    text = str(getattr(exc, "orig", None) or exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]
