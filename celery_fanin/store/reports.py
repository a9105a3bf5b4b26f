"""The workers' reports (children's terminal outcomes, their starts) over a psycopg connection of their own.

Each report is one statement, a whole transaction by itself (`fanin_report_terminal` and `fanin_record_starts` in
sql/schema.sql), so they run in autocommit: one round trip, no
BEGIN/COMMIT, no liveness ping. They are sent on a plain psycopg connection rather than through SQLAlchemy because
they sit on every child's path: SQLAlchemy's pool checkout, statement compilation and result wrapping cost about
as much CPU as the round trip itself. psycopg prepares them server-side after a few uses (its
`prepare_threshold`), so a report is a Bind/Execute of a prepared plan.

One connection per thread and process: created lazily, created again after a fork (a pool process never uses the
connection it inherited), dropped after an error so that the next attempt reconnects.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import psycopg
from psycopg.conninfo import make_conninfo

from .batches import (
    NOTE_TRACEBACK,
    RECORD_STARTS,
    RECORD_TERMINAL,
    RECOVERY_TERMINAL,
    REPORT_UNRUN,
    SUCCESSOR_PUBLISHER_SQL,
    WAKE_RELAY,
    Claim,
    Encoded,
    Start,
    TerminalRecord,
    starts_params,
    terminal_params,
    terminal_record,
)
from .outbox import HANDED_OFF, MARK_SENT_ASYNC, OutboxRow, handed_off_rows
from .statements import Statement
from .successors import CLAIM_RUN, COUNT_DUPLICATE, NOTE_SUCCESSOR_TRACEBACK
from .urls import libpq_conninfo, sqlalchemy_url

__all__ = ["CONNECT_OPTIONS", "ReportConnection", "connect_options", "libpq_conninfo"]

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


class ReportConnection:
    """Sends the hooks' reports (a child's terminal outcome, starts) and a successor's admission by its run guard;
    every error is psycopg's own (the hooks retry them)."""

    def __init__(
        self,
        sqlalchemy_url: str,
        publishes_successors: Callable[[], bool] = lambda: False,
        handoff: Callable[[], float] = lambda: 0.0,
    ) -> None:
        self._conninfo = make_conninfo(libpq_conninfo(sqlalchemy_url), **connect_options(sqlalchemy_url))
        self._local = threading.local()
        # Whether this process publishes the successors its reports create (`fanin_worker_publishes_successors`):
        # then each connection says so once, with the seconds the relay leaves a completed batch's successor to it
        # (`fanin_successor_handoff`), and the report that creates a successor sends no NOTIFY for it.
        self._publishes_successors = publishes_successors
        self._handoff = handoff

    def _connection(self) -> psycopg.Connection[tuple[Any, ...]]:
        conn: psycopg.Connection[tuple[Any, ...]] | None = getattr(self._local, "conn", None)
        if conn is not None and getattr(self._local, "pid", None) == os.getpid() and not conn.closed:
            return conn
        # An inherited connection's socket belongs to the parent: forget it without closing it.
        conn = psycopg.connect(self._conninfo, autocommit=True, application_name="celery-fanin worker")
        if self._publishes_successors():
            try:
                conn.execute(SUCCESSOR_PUBLISHER_SQL, {"handoff": str(max(0.0, float(self._handoff())))})
            except psycopg.Error:
                conn.close()
                raise
        self._local.conn, self._local.pid, self._local.cursor = conn, os.getpid(), conn.cursor()
        return conn

    def record_terminal(
        self,
        task_id: str,
        state: str,
        *,
        result: Encoded | None = None,
        exc_type: str | None = None,
        exc_message: str | None = None,
        start: Start | None = None,
        claim: Claim | None = None,
        unrun: bool = False,
    ) -> TerminalRecord:
        """`batches.record_terminal` over this connection: the same statement, the same invariant (and the child's
        start, if it was not written yet). The hooks always pass `claim`: what the message says the child is.
        `unrun`: the report is about a copy that never ran (`fanin_report_unrun`): a started child is not ended."""
        params = terminal_params(task_id, state, result, exc_type, exc_message, start, claim)
        if unrun and claim is not None:
            row = self._run(REPORT_UNRUN, params)
        else:
            row = self._run(RECOVERY_TERMINAL if claim is None else RECORD_TERMINAL, params)
        rec = terminal_record(row)
        if len(row) > 5 and row[5] is not None:  # it created a successor: the one handed to this session, if any
            rec = replace(rec, handed_off=handed_off_rows(row[5]))
        return rec

    def record_starts(self, starts: Sequence[Start]) -> int:
        """Many children's starts in one round trip, committed asynchronously; how many children moved."""
        return int(self._run(RECORD_STARTS, starts_params(starts))[0])

    def claim_run(self, params: dict[str, object]) -> tuple[Any, ...]:
        """The successor run guard's statement (`store.successors.claim_run`, parameters from `claim_params`):
        a successor's admission on its critical path, one round trip on a connection already open."""
        return self._run(CLAIM_RUN, params)

    def note_traceback(self, task_id: str, traceback: str) -> bool:
        """Keep a failed child's traceback (`fanin_note_traceback`: once, bounded); False if nothing took it."""
        return bool(self._run(NOTE_TRACEBACK, {"task_id": task_id, "traceback": traceback})[0])

    def note_successor_traceback(self, batch_id: object, step: str, traceback: str) -> bool:
        """Keep a failed successor's traceback (`fanin_note_successor_traceback`)."""
        params = {"id": batch_id, "step": step, "traceback": traceback}
        return bool(self._run(NOTE_SUCCESSOR_TRACEBACK, params)[0])

    def count_duplicate(self, batch_id: object, step: str) -> None:
        """Count a delivery the guard refused (`store.successors.count_duplicate`)."""
        self._run(COUNT_DUPLICATE, {"id": batch_id, "step": step})

    def wake_relay(self, batch_id: object) -> None:
        """Leave the successor this connection's report created for `batch_id` to the relay: its outbox row due at
        once (it was handed to this worker, see `handed_off`) and a NOTIFY (the report sent none)."""
        self._run(WAKE_RELAY, {"batch": batch_id})

    def handed_off(self, batch_id: object) -> list[OutboxRow]:
        """The batch's successor that this connection's report created and the relay leaves to this worker for
        `fanin_successor_handoff` seconds, with its batch's and successor's rows; [] if there is none (the batch
        finished past its failure threshold, the handoff is off or passed, or the row went out already).

        The report that created it returns the same (`TerminalRecord.handed_off`); this reads it again. A read,
        not a claim: nothing is locked while the worker publishes (`dispatch.successors.publish_created_successor`).
        """
        return handed_off_rows(self._run(HANDED_OFF, {"batch": batch_id})[0])

    def mark_sent(self, ids: Sequence[int]) -> None:
        """`store.outbox.mark_sent` (not durable) for rows published from `handed_off`: one statement, its own
        transaction, its commit not waiting for the WAL flush (a mark lost in a crash only publishes again)."""
        self._run(MARK_SENT_ASYNC, {"ids": list(ids)})

    def _run(self, statement: Statement, params: dict[str, object]) -> tuple[Any, ...]:
        self._connection()
        cursor: psycopg.Cursor[tuple[Any, ...]] = self._local.cursor  # made with the connection, kept with it
        text, names = statement.positional
        try:
            row = cursor.execute(text, [params[name] for name in names]).fetchone()
        except psycopg.Error:
            # Whatever the error: a broken connection, but also a read-only session (25006, a failover), which
            # stays on that server until it reconnects; the next attempt opens a new one.
            self.reset()
            raise
        assert row is not None  # every statement sent here returns exactly one row
        return row

    def reset(self) -> None:
        """Drop this thread's connection (after an error, or at shutdown); the next report reconnects."""
        conn = getattr(self._local, "conn", None)
        self._local.conn = self._local.cursor = None
        if conn is not None and getattr(self._local, "pid", None) == os.getpid():
            with contextlib.suppress(psycopg.Error):
                conn.close()
