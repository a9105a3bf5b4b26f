"""The retry helper: which errors it retries, its bounds, its jittered backoff (no database needed, a fake clock)."""

from __future__ import annotations

import re
import threading
from pathlib import Path

import psycopg
import pytest
from psycopg import errors as pg_errors
from sqlalchemy import exc as sa_exc

from celery_fanin import retry


class FakeClock:
    """A clock that `sleep` advances: a test of a 300 s bound runs in microseconds."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def _failing(errors: list[BaseException], result: str = "done") -> tuple[list[int], object]:
    calls: list[int] = []

    def fn() -> str:
        calls.append(1)
        if len(calls) <= len(errors):
            raise errors[len(calls) - 1]
        return result

    return calls, fn


def _sa(orig: BaseException, invalidated: bool = False, cls: type[sa_exc.DBAPIError] = sa_exc.OperationalError):
    return cls("SELECT 1", {}, orig, connection_invalidated=invalidated)  # type: ignore[arg-type]


TRANSIENT = [
    psycopg.OperationalError("server closed the connection unexpectedly"),  # no SQLSTATE: the connection broke
    psycopg.OperationalError('connection failed: connection to server at "127.0.0.1" failed: Connection refused'),
    psycopg.OperationalError("connection failed: FATAL:  the database system is starting up"),
    pg_errors.AdminShutdown("terminating connection due to administrator command"),  # 57P01: a server restart
    pg_errors.CannotConnectNow("the database system is starting up"),  # 57P03
    pg_errors.TooManyConnections("too many clients"),  # 53300
    pg_errors.SerializationFailure("could not serialize access"),  # 40001
    pg_errors.DeadlockDetected("deadlock detected"),  # 40P01
    pg_errors.LockNotAvailable("canceling statement due to lock timeout"),  # 55P03: lock_timeout
    pg_errors.QueryCanceled("canceling statement due to statement timeout"),  # 57014: statement_timeout
    pg_errors.QueryCanceled("canceling statement due to user request"),  # 57014: pg_cancel_backend
    pg_errors.ReadOnlySqlTransaction("cannot execute UPDATE in a read-only transaction"),  # 25006: a failover
    _sa(pg_errors.LockNotAvailable("canceling statement due to lock timeout")),
    _sa(pg_errors.ReadOnlySqlTransaction("read-only"), cls=sa_exc.InternalError),
    _sa(psycopg.OperationalError("connection refused")),
    _sa(pg_errors.AdminShutdown("terminating")),
    _sa(psycopg.InterfaceError("connection already closed"), invalidated=True, cls=sa_exc.InterfaceError),
    sa_exc.DisconnectionError("pre-ping failed"),
    sa_exc.TimeoutError("QueuePool limit reached"),
    ConnectionResetError("reset by peer"),
]

PERMANENT = [
    pg_errors.UndefinedTable("relation does not exist"),  # a schema out of date
    pg_errors.InsufficientPrivilege("permission denied"),
    pg_errors.UniqueViolation("duplicate key value"),  # a constraint: a bug, not an outage
    pg_errors.ModifyingSqlDataNotPermitted("a routine that may not modify data"),  # 2F002: a bug, not 25006
    pg_errors.InvalidPassword("password authentication failed"),  # 28P01: an OperationalError, yet permanent
    psycopg.InterfaceError("the cursor is closed"),  # a misuse, not an outage
    # A refused login has no SQLSTATE (libpq's text only): configuration, not an outage.
    psycopg.OperationalError('connection failed: FATAL:  database "x" does not exist'),
    psycopg.OperationalError('connection failed: FATAL:  password authentication failed for user "u"'),
    _sa(psycopg.OperationalError('connection failed: FATAL:  role "u" does not exist')),
    _sa(pg_errors.UndefinedFunction("function fanin_record_terminal does not exist"), cls=sa_exc.ProgrammingError),
    _sa(psycopg.InterfaceError("misuse"), invalidated=False, cls=sa_exc.InterfaceError),
    sa_exc.ArgumentError("bad argument"),
    ValueError("a bug"),
    KeyError("a bug"),
]


@pytest.mark.parametrize("exc", TRANSIENT, ids=lambda e: type(e).__name__)
def test_transient_errors_are_retried_until_success(exc: BaseException) -> None:
    clock = FakeClock()
    calls, fn = _failing([exc, exc, exc])
    assert retry.call(fn, what="x", timeout=60, sleep=clock.sleep, clock=clock) == "done"  # type: ignore[arg-type]
    assert len(calls) == 4 and len(clock.sleeps) == 3


@pytest.mark.parametrize("exc", PERMANENT, ids=lambda e: type(e).__name__)
def test_permanent_errors_are_raised_at_once(exc: BaseException) -> None:
    clock = FakeClock()
    calls, fn = _failing([exc])
    with pytest.raises(type(exc)):
        retry.call(fn, what="x", timeout=60, sleep=clock.sleep, clock=clock)  # type: ignore[arg-type]
    assert len(calls) == 1 and clock.sleeps == []


def test_time_bound_gives_up_with_the_last_error_as_cause() -> None:
    clock = FakeClock()
    last = pg_errors.AdminShutdown("still down")
    calls, fn = _failing([psycopg.OperationalError("down")] * 10_000 + [last])
    with pytest.raises(retry.GaveUp) as info:
        retry.call(fn, what="recording x", timeout=300, sleep=clock.sleep, clock=clock)  # type: ignore[arg-type]
    # Tried throughout the 300 s, the last wait shortened to end on the bound, and not one attempt after it.
    assert clock.now == pytest.approx(1300.0)
    assert sum(clock.sleeps) == pytest.approx(300.0)
    assert max(clock.sleeps) <= retry.DEFAULT_BACKOFF.maximum
    assert info.value.attempts == len(calls) == len(clock.sleeps) + 1
    assert isinstance(info.value.__cause__, psycopg.OperationalError)
    assert "recording x" in str(info.value)


def test_a_60s_outage_fits_in_the_default_report_timeout() -> None:
    from celery_fanin.context import Settings

    clock = FakeClock()
    down_until = clock.now + 60

    def report() -> str:
        if clock.now < down_until:
            raise psycopg.OperationalError("connection refused")
        return "recorded"

    assert Settings().report_timeout >= 120
    got = retry.call(report, what="x", timeout=Settings().report_timeout, sleep=clock.sleep, clock=clock)
    assert got == "recorded"
    # Recorded within one maximum backoff of the database coming back.
    assert clock.now - down_until <= retry.DEFAULT_BACKOFF.maximum


def test_attempt_bound() -> None:
    clock = FakeClock()
    calls, fn = _failing([ConnectionError("x")] * 10)
    with pytest.raises(retry.GaveUp):
        retry.call(fn, what="x", attempts=3, sleep=clock.sleep, clock=clock)  # type: ignore[arg-type]
    assert len(calls) == 3 and len(clock.sleeps) == 2


def test_a_bound_is_required() -> None:
    with pytest.raises(ValueError, match="needs a bound"):
        retry.call(lambda: 1, what="x")
    with pytest.raises(ValueError, match="at least 1"):
        retry.call(lambda: 1, what="x", attempts=0)


def test_backoff_grows_caps_and_is_jittered() -> None:
    b = retry.Backoff(first=0.2, maximum=5.0)
    # Equal jitter: between half and all of the capped exponential delay.
    assert b.delay(1, lambda: 0.0) == pytest.approx(0.1) and b.delay(1, lambda: 1.0) == pytest.approx(0.2)
    assert b.delay(3, lambda: 0.0) == pytest.approx(0.4) and b.delay(3, lambda: 1.0) == pytest.approx(0.8)
    assert b.delay(30, lambda: 1.0) == pytest.approx(5.0) and b.delay(30, lambda: 0.0) == pytest.approx(2.5)
    # With the real random source, workers that failed together do not wait the same time.
    delays = {round(b.delay(10), 6) for _ in range(50)}
    assert len(delays) > 40 and all(2.5 <= d <= 5.0 for d in delays)


def test_stop_event_ends_the_wait() -> None:
    stop = threading.Event()
    stop.set()
    calls, fn = _failing([ConnectionError("x")] * 10)
    with pytest.raises(retry.GaveUp):
        retry.call(fn, what="x", timeout=60, stop=stop)  # type: ignore[arg-type]
    assert len(calls) == 1


# --- the table of docs/concepts/worker.md ("Which errors are transient") against `is_transient` ----------------

WORKER_MD = Path(__file__).resolve().parents[2] / "docs" / "concepts" / "worker.md"


def _documented() -> dict[str, bool]:
    """SQLSTATE (a code, or a two-character class) -> whether the table says it is retried."""
    text = WORKER_MD.read_text()
    table = text.split("### Which errors are transient", 1)[1].split("\n\n")[2]
    rows: dict[str, bool] = {}
    for line in table.splitlines()[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        retried = cells[-1].startswith("retried")
        assert retried or cells[-1].startswith("raised"), line
        codes = re.findall(r"`([0-9A-Z]{5})`", cells[0])
        classes = re.findall(r"^class `([0-9A-Z]{2})`$", cells[0])
        for code in codes + classes:
            rows[code] = retried
    return rows


def test_the_documented_table_lists_every_code_the_code_retries() -> None:
    documented = _documented()
    assert {c for c, retried in documented.items() if retried} == retry._TRANSIENT_CLASSES | retry._TRANSIENT_CODES
    assert {"55P03", "57014", "25006"} <= set(documented)


def test_every_sqlstate_is_transient_exactly_when_the_table_says_so() -> None:
    """All of psycopg's SQLSTATEs (every one PostgreSQL defines), each as the error psycopg raises for it."""
    documented = _documented()
    classes = {cls for cls in pg_errors._sqlcodes.values() if cls.sqlstate}  # keyed by code and by name
    assert len(classes) > 200
    for cls in classes:
        sqlstate = str(cls.sqlstate)
        expected = documented.get(sqlstate, documented.get(sqlstate[:2], False))
        assert retry.is_transient(cls("x")) is expected, f"{sqlstate} {cls.__name__}: the table says {expected}"


def test_an_interrupt_is_never_retried() -> None:
    """Our own cancels: psycopg cancels a statement interrupted by Ctrl-C or a worker's shutdown, swallows the
    57014 it caused and raises the interrupt, which `call` lets through at once."""
    clock = FakeClock()
    for interrupt in (KeyboardInterrupt(), SystemExit(1)):
        calls, fn = _failing([interrupt])
        with pytest.raises(type(interrupt)):
            retry.call(fn, what="x", timeout=60, sleep=clock.sleep, clock=clock)  # type: ignore[arg-type]
        assert len(calls) == 1 and clock.sleeps == []
