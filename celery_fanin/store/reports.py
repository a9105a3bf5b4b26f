"""The workers' reports (children's terminal outcomes, their starts) over a psycopg connection of their own.

Each report is one statement, a whole transaction by itself (`fanin_report_terminal_v2` and `fanin_record_starts` in
sql/schema.sql), so they run in autocommit: one round trip, no
BEGIN/COMMIT, no liveness ping. They are sent on a plain psycopg connection rather than through SQLAlchemy because
they sit on every child's path: SQLAlchemy's pool checkout, statement compilation and result wrapping cost about
as much CPU as the round trip itself. psycopg prepares them server-side after a few uses (its
`prepare_threshold`), so a report is a Bind/Execute of a prepared plan.

A connection per statement in flight, not per thread: a statement takes an idle one (or opens one) and gives it
back. A prefork pool process keeps up to three (its task's reports, its start writer, a successor's lease
heartbeat); a threads, gevent or eventlet pool at most one per statement running at once, reused from task to task
(a gevent or eventlet task is a new greenlet), and those a burst opened are closed after a minute unused.
Connections a fork inherited are forgotten (never used); one that met an error is closed, and after a lost server
(a restart, a failover) the idle ones with it, so that the retry reconnects at once.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any, NamedTuple, TypeVar

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from . import cooperative
from .batches import (
    NOTE_TRACEBACK,
    RECORD_STARTS,
    RECORD_TERMINAL,
    RECORD_TERMINAL_MANY,
    RECOVERY_TERMINAL,
    REPORT_UNRUN,
    WAKE_RELAY,
    Claim,
    Encoded,
    Start,
    TerminalRecord,
    starts_params,
    terminal_params,
    terminal_record,
)
from .outbox import MARK_SENT_ASYNC, handed_off_rows
from .statements import Runner, Statement
from .urls import libpq_conninfo, sqlalchemy_url

__all__ = [
    "CONNECT_OPTIONS",
    "ReportConnection",
    "connect_options",
    "libpq_conninfo",
    "mark_sent",
    "note_traceback",
    "record_starts",
    "record_terminal",
    "record_terminals",
    "wake_relay",
]

# Every connection the library opens itself: give up connecting after 10 s, and let TCP find a peer that vanished
# without closing (a network cut, a host gone) in well under a minute, instead of a report hanging on it for the
# kernel's default of hours. The retry policy (celery_fanin.retry) then reconnects.
CONNECT_OPTIONS: dict[str, int] = {
    "connect_timeout": 10,
    "keepalives": 1,
    "keepalives_idle": 15,
    "keepalives_interval": 5,
    "keepalives_count": 3,
    "tcp_user_timeout": 30_000,
}


def connect_options(url: str) -> dict[str, int]:
    """`CONNECT_OPTIONS` less those the URL sets itself (the URL wins)."""
    given = sqlalchemy_url(url).query
    return {k: v for k, v in CONNECT_OPTIONS.items() if k not in given}


_R = TypeVar("_R")


class ReportConnection:
    """The worker's one transport for its runtime statements (a `statements.Runner`): a child's terminal outcome,
    starts and traceback, below; a successor's admission, hand-over, lease renewals and end (`store.successors`);
    the successor handed to it (`store.outbox`). A statement that raises, whatever the exception, drops the
    connection; the callers retry psycopg's errors."""

    def __init__(self, sqlalchemy_url: str, lock_timeout: float | None = None) -> None:
        """`lock_timeout`: seconds a statement waits for a lock before it fails (SQLSTATE 55P03, transient); None,
        the server's setting."""
        cooperative.ensure()  # under eventlet, before its first connection
        conninfo = libpq_conninfo(sqlalchemy_url)
        options: dict[str, str | int] = dict(connect_options(sqlalchemy_url))
        if lock_timeout is not None:  # added to the URL's own `options`, if it has any
            own = conninfo_to_dict(conninfo).get("options")
            setting = f"-c lock_timeout={int(lock_timeout * 1000)}"
            options["options"] = f"{own} {setting}" if own else setting
        self._conninfo = make_conninfo(conninfo, **options)
        # Connections no statement is using now, the latest returned last, each with when it was returned.
        self._idle: list[tuple[_Held, float]] = []
        self._pid = os.getpid()
        # Raised whenever the idle connections are dropped (`reset`, a lost server, a fork): a connection taken
        # before that is closed when its statement ends, not given back.
        self._generation = 0

    def _take(self) -> _Held:
        """A connection for one statement, which no other thread or greenlet uses until it is given back: the one
        returned last, else a new one. A thread of a threads pool, a greenlet of a gevent or eventlet pool (a new one
        per task) and a prefork pool process all reuse what the statement before them returned."""
        if self._pid != os.getpid():
            # A forked copy: the inherited connections' sockets belong to the parent. Forgotten, never closed here.
            self._idle, self._pid, self._generation = [], os.getpid(), self._generation + 1
        try:
            return self._idle.pop()[0]
        except IndexError:
            conn = psycopg.connect(self._conninfo, autocommit=True, application_name="celery-fanin worker")
            return _Held(conn, conn.cursor(), self._pid, self._generation)

    def _give_back(self, held: _Held) -> None:
        if held.generation == self._generation:
            now = time.monotonic()
            self._idle.append((held, now))
            # A burst (a gevent pool's 100 tasks at once) opens as many connections; once it is over, those not
            # used for IDLE_SECONDS are closed, one per statement, the least recently used first (the list's head),
            # so that a quiet worker keeps what it needs, not its peak. The one just returned is never closed.
            if len(self._idle) > 1:
                try:  # another thread may take the rest meanwhile: the head is read, and taken, only in here
                    if now - self._idle[0][1] <= IDLE_SECONDS:
                        return
                    stale, _ = self._idle.pop(0)
                except IndexError:
                    return
                with contextlib.suppress(psycopg.Error):
                    stale.conn.close()
        elif held.pid == os.getpid():  # taken before the idle ones were dropped: dropped too
            with contextlib.suppress(psycopg.Error):
                held.conn.close()
        # else: the parent's, carried across a fork by a statement in flight (a green thread): forgotten

    def one(self, statement: Statement, params: Mapping[str, object]) -> tuple[Any, ...]:
        """Run one statement on a connection of its own, its own transaction (autocommit); its one row."""
        row = self._run(statement, params, psycopg.Cursor.fetchone)
        assert row is not None, "every statement sent through `one` returns exactly one row"
        return row

    def all(self, statement: Statement, params: Mapping[str, object]) -> list[tuple[Any, ...]]:
        """Run one statement as `one` does; all its rows."""
        return self._run(statement, params, psycopg.Cursor.fetchall)

    def _run(
        self, statement: Statement, params: Mapping[str, object], fetch: Callable[[psycopg.Cursor[Any]], _R]
    ) -> _R:
        held = self._take()
        text, names = statement.positional
        try:
            result = fetch(held.cursor.execute(text, [params[name] for name in names]))
        except BaseException as exc:
            # Whatever the error, the connection is closed, not given back: a broken one, but also a read-only
            # session (25006, a failover), which stays on that server, and one that an exception raised into the
            # wait (a soft time limit, a gevent Timeout) left busy with a result nobody reads. The next attempt
            # takes another, or opens a new one.
            lost = held.conn.broken or getattr(exc, "sqlstate", None) in _SERVER_LOST
            with contextlib.suppress(psycopg.Error):
                held.conn.close()
            if lost:
                # The server went away or turned read-only (a restart, a failover, a cut): the idle connections are
                # most likely no better. Dropped together, so that the retry opens a new one instead of meeting
                # each stale one in turn, a backoff apart.
                self.reset()
            raise
        self._give_back(held)
        return result

    def reset(self) -> None:
        """Close the idle connections, and each one in use when its statement ends (at shutdown, after a lost
        server); the next statement reconnects."""
        if self._pid != os.getpid():
            self._idle, self._pid, self._generation = [], os.getpid(), self._generation + 1
            return
        self._generation += 1  # a statement running now closes its connection when it ends
        idle, self._idle = self._idle, []
        for held, _ in idle:
            with contextlib.suppress(psycopg.Error):
                held.conn.close()


class _Held(NamedTuple):
    conn: psycopg.Connection[tuple[Any, ...]]
    cursor: psycopg.Cursor[tuple[Any, ...]]  # made with the connection, kept with it
    pid: int  # the process that opened it
    generation: int  # `ReportConnection._generation` when it was opened


# How long a connection may stay idle, beyond the one used last, before a statement's end closes it.
IDLE_SECONDS = 60.0

# Errors after which a session's siblings are no better: read-only (a failover), the server shutting down or
# restarting (57P01-57P03). A lost connection (`broken`) counts too.
_SERVER_LOST = frozenset({"25006", "57P01", "57P02", "57P03"})


# --- the workers' report statements, each defined once (run by a `Runner`: the worker's `ReportConnection`) -----


def record_terminal(
    runner: Runner,
    task_id: str,
    state: str,
    *,
    result: Encoded | None = None,
    exc_type: str | None = None,
    exc_message: str | None = None,
    start: Start | None = None,
    claim: Claim | None = None,
    unrun: bool = False,
    handoff: float | None = None,
) -> TerminalRecord:
    """Count one child's terminal outcome, at most once however often it is reported: one round trip.

    With `claim` (what the message says the child is: the hooks always pass it), only if the child has the claimed
    batch, index and task name; without (a caller that read the child from the store), by task id. `unrun`: the
    report is about a copy that never ran (`fanin_report_unrun_v2`): a started child is not ended. `start`: the
    child's start, when it was not written yet (see `worker.starts`), recorded with the outcome. `handoff`: None when
    a successor the report creates is the relay's (NOTIFY); else the calling worker publishes it, and the relay leaves
    a completed batch's successor to it for `handoff` seconds (`FanIn.report_handoff`).

    Invariant (see `fanin_record_terminal_v2` and `fanin_settle` in sql/schema.sql): a child row moves from
    pending/started to a terminal state at most once (a concurrent or repeated report finds it terminal, is recorded
    as late and changes no counter); only the report that made that move decrements its batch, never below zero;
    exactly one transaction finishes a batch, and that one settles its parent (a leaf) or inserts its successor and
    outbox row (a root). A successor handed to the caller (`handoff` over 0) comes back in `handed_off`.
    """
    params = terminal_params(task_id, state, result, exc_type, exc_message, start, claim, handoff)
    if unrun and claim is not None:
        row = runner.one(REPORT_UNRUN, params)
    else:
        row = runner.one(RECOVERY_TERMINAL if claim is None else RECORD_TERMINAL, params)
    return reported(row)


def reported(row: Sequence[Any]) -> TerminalRecord:
    """The `TerminalRecord` of a report's row (RECORD_TERMINAL's, or one of RECORD_TERMINAL_MANY's less its n)."""
    rec = terminal_record(row)
    if len(row) > 5 and row[5] is not None:  # it created a successor: the one handed to this session, if any
        rec = replace(rec, handed_off=handed_off_rows(row[5]))
    return rec


# The columns of RECORD_TERMINAL_MANY's arrays, each from the parameter of RECORD_TERMINAL of the same meaning.
_MANY = (
    ("task_ids", "task_id"),
    ("batch_ids", "batch_id"),
    ("indexes", "index"),
    ("task_names", "task_name"),
    ("states", "state"),
    ("results", "result"),
    ("rcts", "rct"),
    ("rces", "rce"),
    ("exc_types", "exc_type"),
    ("exc_messages", "exc_message"),
    ("started_ats", "started_at"),
    ("attempts", "attempt"),
    ("workers", "worker"),
)


def record_terminals(
    runner: Runner, reports: Sequence[Mapping[str, object]], handoff: float | None
) -> list[tuple[Any, ...]]:
    """Many claimed terminal reports (each `terminal_params` with a claim) in one statement and one commit: each
    counted exactly as `record_terminal` would count it alone, in the order of their batches and indexes, so that
    two groups lock the leaves they share in the same order. Their rows, in the order given (each as
    RECORD_TERMINAL's: `reported` reads it). `handoff`: the one every report of the group passes."""
    order = sorted(range(len(reports)), key=lambda i: (str(reports[i]["batch_id"]), int(reports[i]["index"])))  # type: ignore[call-overload]
    params: dict[str, object] = {many: [reports[i][one] for i in order] for many, one in _MANY}
    params["handoff"] = handoff
    rows: list[tuple[Any, ...] | None] = [None] * len(reports)
    for n, *row in runner.all(RECORD_TERMINAL_MANY, params):
        rows[order[n - 1]] = tuple(row)
    assert all(row is not None for row in rows), "RECORD_TERMINAL_MANY returns a row for every report"
    return rows  # type: ignore[return-value]


def record_starts(runner: Runner, starts: Sequence[Start]) -> int:
    """Many children's starts in one round trip, committed asynchronously; how many children moved."""
    return int(runner.one(RECORD_STARTS, starts_params(starts))[0])


def note_traceback(runner: Runner, task_id: str, traceback: str, exc_type: str | None, exc_message: str | None) -> bool:
    """Keep a failed child's traceback (`fanin_note_traceback_v2`: once, bounded, and only onto a counted failure
    with this error type and text, as this copy reported them); False if nothing took it."""
    params = {"task_id": task_id, "traceback": traceback, "exc_type": exc_type, "exc_message": exc_message}
    return bool(runner.one(NOTE_TRACEBACK, params)[0])


def wake_relay(runner: Runner, batch_id: object) -> None:
    """Leave the successor this session's report created for `batch_id` to the relay: its outbox row due at once
    (it was handed to this worker: `TerminalRecord.handed_off`) and a NOTIFY (the report sent none)."""
    runner.one(WAKE_RELAY, {"batch": batch_id})


def mark_sent(runner: Runner, ids: Sequence[int]) -> None:
    """`store.outbox.mark_sent` (not durable) for the rows a report handed to this worker: one statement, its own
    transaction, its commit not waiting for the WAL flush (a mark lost in a crash only publishes again)."""
    runner.one(MARK_SENT_ASYNC, {"ids": list(ids)})
