"""A prefork worker's group commit of its children's terminal reports (`fanin_report_batching`).

Without it every pool process commits each child's report itself: one durable commit (a WAL flush) per child. With
it, a pool process sends the report to one thread of the worker's main process (`ReportBatcher`, over a Unix socket
in a private directory) and waits for the answer, as it waits for its own statement today. The thread commits every
report that arrived while its previous commit was in flight in one statement (`store.reports.record_terminals`),
so sixteen pool processes share a commit instead of taking sixteen. Nothing waits for a group to fill: a report that
arrives alone is committed at once, alone.

What does not change, because the pool process still waits for its report's commit before its task returns:
- with `acks_late`, the message is acknowledged only after the report is durable (Celery acknowledges once the task
  has returned);
- without it, the window between a body's end and its report's commit grows only by the wait for the commit in
  flight (one commit at most) and the socket's round trip;
- each report is counted exactly as it would be alone (the same function, row by row, in one transaction), and the
  pool process that completed a batch gets its successor back to publish, as it would alone.

Whatever goes wrong on the way sends the report alone, as before: the batcher unreachable (the worker stopping), a
group the database refused for a reason that is not transient (one report's problem must not be the group's). A
transient error (a lost connection, a deadlock between two groups, a failover) is answered as such and the pool
process retries through the batcher, within `fanin_report_timeout`, as it retries its own statement.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import pickle
import selectors
import shutil
import socket
import struct
import tempfile
import threading
from collections.abc import Mapping
from typing import Any

from .. import retry
from ..context import FanIn
from ..store import reports
from ..store.batches import RECORD_TERMINAL, TerminalRecord, terminal_record
from ..store.reports import ReportConnection
from ..store.statements import Runner, Statement
from . import process

logger = logging.getLogger("celery_fanin.hooks")

_FRAME = struct.Struct("!I")  # each message: its length, then a pickle (sender and reader are this worker's own)
# The most reports one statement commits: a group larger than this waits for the next round (one commit later).
MAX_GROUP = 256
# How long a pool process waits for the batcher's answer before it sends its report alone: a group stuck on a row
# lock must not hold every pool process of the worker for `fanin_report_timeout`.
WAIT_SECONDS = 10.0
# The largest report a pool process may send (its result is at most this, and far less in practice).
MAX_FRAME = 512 * 1024 * 1024

# How long the batcher's statement waits for a row lock before its group is given back (SQLSTATE 55P03): a batch row
# another session holds (an operator's transaction, a long reconcile) would otherwise hold up every report queued
# behind it, of every batch, for as long as it is held. Its reports are then sent alone, each waiting on its own
# connection as it would without the batcher; a group commits in about a millisecond.
LOCK_TIMEOUT = 1.0

# The answers a pool process gets: ("row", row) the report's row, or ("alone", why) the group was not committed
# (any error, transient or not), and the report is sent alone on the pool process's own connection: the batcher's
# connection may be what fails (a connection limit, a lock).
_ROW, _ALONE = "row", "alone"

# The batcher's socket, set in the main process before the pool starts (its processes inherit it); None: no batcher.
_address: str | None = None
_main_pid = 0  # the process that runs the batcher: its own reports (main-process signals) never wait for it


class ReportBatcher:
    """The worker main process's thread that commits its pool processes' reports in groups (see the module)."""

    def __init__(self, fanin: FanIn) -> None:
        self._fanin = fanin
        # Its own (nothing else uses these connections), bounded in how long it waits for a lock (LOCK_TIMEOUT).
        self._runner = ReportConnection(fanin.database_url, lock_timeout=LOCK_TIMEOUT)
        self._dir = tempfile.mkdtemp(prefix="celery-fanin-")  # 0700: only this user may connect (and send pickles)
        self.address = os.path.join(self._dir, "reports.sock")
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._listener.bind(self.address)
        except OSError:
            self._listener.close()
            shutil.rmtree(self._dir, ignore_errors=True)
            raise
        self._listener.listen(1024)
        self._listener.setblocking(False)
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._buffers: dict[socket.socket, bytearray] = {}
        self._stopping = False
        self.groups = 0  # statements run, and reports they carried (for the tests and the benchmark)
        self.reports = 0
        self._thread = threading.Thread(target=self._loop, name="celery-fanin-batcher", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop taking reports (a pool process then sends its own), finish the group in flight, remove the socket."""
        self._stopping = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        self._thread.join(timeout)
        shutil.rmtree(self._dir, ignore_errors=True)
        if self.groups:
            logger.info(
                "report batcher: %d reports committed in %d statements (%.1f a commit)",
                self.reports,
                self.groups,
                self.reports / self.groups,
            )

    # --- the thread ---------------------------------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while not self._stopping:
                group = self._receive(self._selector.select())
                while group:
                    self._commit(group[:MAX_GROUP])
                    group = group[MAX_GROUP:]
        except Exception:  # noqa: BLE001 - the pool processes send alone once the socket is gone
            logger.exception("the report batcher stopped; pool processes send their reports alone")
        finally:
            # Gone first, so that no pool process connects to a socket nobody reads (the pool's inherited copies of
            # the listener would still take the connection).
            shutil.rmtree(self._dir, ignore_errors=True)
            for key in list(self._selector.get_map().values()):
                with contextlib.suppress(OSError):
                    key.fileobj.close()  # type: ignore[union-attr]
            self._selector.close()
            self._runner.reset()

    def _receive(self, events: list[tuple[selectors.SelectorKey, int]]) -> list[tuple[socket.socket, dict[str, Any]]]:
        """Accept new pool processes, and read every whole report that has arrived: the next group."""
        group: list[tuple[socket.socket, dict[str, Any]]] = []
        for key, _ in events:
            sock: socket.socket = key.fileobj  # type: ignore[assignment]
            if sock is self._listener:
                with contextlib.suppress(BlockingIOError, InterruptedError):
                    while True:
                        conn, _ = self._listener.accept()
                        conn.setblocking(False)
                        self._buffers[conn] = bytearray()
                        self._selector.register(conn, selectors.EVENT_READ, None)
            elif sock is self._wake_r:
                with contextlib.suppress(OSError):
                    sock.recv(64)
            else:
                group.extend((sock, report) for report in self._read(sock))
        return group

    def _read(self, sock: socket.socket) -> list[dict[str, Any]]:
        buffer = self._buffers[sock]
        try:
            data = sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return []
        except OSError:
            data = b""
        if not data:  # the pool process closed it (exited, or dropped it after an interruption)
            self._forget(sock)
            return []
        buffer += data
        out = []
        try:
            while len(buffer) >= _FRAME.size:
                (size,) = _FRAME.unpack_from(buffer)
                if size > MAX_FRAME:
                    raise ValueError(f"a frame of {size} bytes")
                if len(buffer) < _FRAME.size + size:
                    break
                out.append(pickle.loads(bytes(buffer[_FRAME.size : _FRAME.size + size])))  # noqa: S301 - our own
                del buffer[: _FRAME.size + size]
        except Exception as exc:  # noqa: BLE001 - that pool process's connection is dropped, not the batcher
            logger.warning("dropped a connection to the report batcher that sent something unreadable: %s", exc)
            self._forget(sock)
            return []
        return out

    def _forget(self, sock: socket.socket) -> None:
        self._buffers.pop(sock, None)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(sock)
        with contextlib.suppress(OSError):
            sock.close()

    def _commit(self, group: list[tuple[socket.socket, dict[str, Any]]]) -> None:
        """One statement, one commit, for the whole group (grouped by hand-off, the same for every report of one
        worker's settings); each pool process gets its own row back."""
        by_handoff: dict[object, list[tuple[socket.socket, dict[str, Any]]]] = {}
        for sock, report in group:
            by_handoff.setdefault(report["handoff"], []).append((sock, report))
        for handoff, part in by_handoff.items():
            answers: list[tuple[str, Any]]
            try:
                if len(part) == 1:  # alone: the statement a pool process sends itself (the set-based one costs more)
                    rows = [self._runner.one(RECORD_TERMINAL, part[0][1])]
                else:
                    rows = reports.record_terminals(self._runner, [r for _, r in part], handoff)  # type: ignore[arg-type]
                answers = [(_ROW, row) for row in rows]
                self.groups += 1
                self.reports += len(part)
            except Exception as exc:  # noqa: BLE001 - each pool process sends its report alone
                if not retry.is_transient(exc):
                    logger.warning("a group of %d reports was refused (%s); each is sent alone", len(part), exc)
                answers = [(_ALONE, retry.brief(exc))] * len(part)
            for (sock, _), answer in zip(part, answers, strict=True):
                self._answer(sock, answer)

    def _answer(self, sock: socket.socket, answer: tuple[str, Any]) -> None:
        data = pickle.dumps(answer, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            sock.settimeout(5.0)  # a pool process waiting reads at once; one that stopped reading is dropped
            sock.sendall(_FRAME.pack(len(data)) + data)
            sock.setblocking(False)
        except OSError:  # the pool process is gone (or dropped the socket): nobody is waiting for this answer
            self._forget(sock)


# --- the pool process's side ------------------------------------------------------------------------------------


class _Client:
    """A pool process's connection to its worker's batcher, made on first use (after the fork)."""

    def __init__(self) -> None:
        self.sock: socket.socket | None = None
        self._lock = threading.Lock()  # one report at a time on the socket (a pool process has one task at a time)

    def call(self, report: Mapping[str, object], timeout: float | None = WAIT_SECONDS) -> tuple[str, Any]:
        """Send one report and wait for its answer, for up to `timeout` seconds (connecting too); ("alone", ...) if
        the batcher cannot be reached or does not answer in time."""
        if _address is None:
            return (_ALONE, "no batcher")
        with self._lock:
            return self._call(_address, report, timeout)

    def _call(self, address: str, report: Mapping[str, object], timeout: float | None) -> tuple[str, Any]:
        try:
            sock = self.sock
            if sock is None:
                sock = self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(timeout)
                sock.connect(address)
            sock.settimeout(timeout)
            data = pickle.dumps(dict(report), protocol=pickle.HIGHEST_PROTOCOL)
            sock.sendall(_FRAME.pack(len(data)) + data)
            (size,) = _FRAME.unpack(_receive(sock, _FRAME.size))
            return pickle.loads(_receive(sock, size))  # type: ignore[no-any-return]  # noqa: S301 - our own
        except OSError as exc:
            self.close()
            return (_ALONE, str(exc))
        except BaseException:
            # Interrupted (a soft time limit) with an answer still to come: the socket is dropped, so that the next
            # report does not read this one's answer.
            self.close()
            raise

    def close(self) -> None:
        sock, self.sock = self.sock, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()


def _receive(sock: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionResetError("the report batcher closed the connection")
        data += chunk
    return bytes(data)


def _client() -> _Client:
    return _Client()


def active() -> bool:
    """Whether this process's reports go through a batcher (a pool process of a worker that started one)."""
    return _address is not None and os.getpid() != _main_pid


class Batched:
    """A `statements.Runner` over a pool process's own (`runner`) that sends a child's claimed terminal report
    (RECORD_TERMINAL) through the worker's batcher: what `reports.record_terminal` runs is unchanged. Every other
    statement goes on `runner`, and so does a report the batcher cannot take, could not commit, or has not answered
    within `timeout` seconds (the report is idempotent, so sending it alone too counts nothing twice).

    A report sent alone that comes back late may have been committed by the batcher meanwhile, completing the batch
    with nobody reading the answer: the relay is woken for the batch, as after an interrupted report
    (`report._send_again`), instead of its successor waiting out the hand-off."""

    def __init__(self, runner: Runner, timeout: float = WAIT_SECONDS) -> None:
        self.runner = runner
        self.timeout = timeout

    def one(self, statement: Statement, params: Mapping[str, object]) -> tuple[Any, ...]:
        if statement is not RECORD_TERMINAL:
            return self.runner.one(statement, params)
        kind, what = process.held(_client).call(params, self.timeout)
        if kind == _ROW:
            return tuple(what)
        # Alone, on this process's own connection: after a timeout, a refusal, or a transient error of the group
        # (the batcher's connection lost or refused, its lock wait given up), any of which may be the batcher's
        # alone. A transient error here is retried by the caller, through the batcher again.
        row = self.runner.one(RECORD_TERMINAL, params)
        if terminal_record(row).late and what != "no batcher":
            with contextlib.suppress(Exception):  # the relay's scan publishes it once the hand-off has passed
                reports.wake_relay(self.runner, params["batch_id"])
        return row

    def all(self, statement: Statement, params: Mapping[str, object]) -> list[tuple[Any, ...]]:
        return self.runner.all(statement, params)


def runner(own: Runner) -> Runner:
    """What this process's reports run on: through the batcher in a pool process of a worker that has one, else
    `own` itself."""
    return Batched(own) if active() else own


def record_terminal(runner: Runner, params: Mapping[str, object], timeout: float = WAIT_SECONDS) -> TerminalRecord:
    """One claimed report (`batches.terminal_params` with a claim) through the batcher (`Batched`)."""
    return reports.reported(Batched(runner, timeout).one(RECORD_TERMINAL, params))


_batcher: ReportBatcher | None = None


def _forked() -> None:
    """In a new pool process: close its copies of the batcher's sockets (only the main process reads them)."""
    batcher = _batcher
    if batcher is not None:
        for sock in (batcher._listener, batcher._wake_r, batcher._wake_w, *batcher._buffers):
            with contextlib.suppress(OSError):
                sock.close()  # this process's descriptor only: the main process keeps its own
        with contextlib.suppress(OSError):
            batcher._selector.close()


os.register_at_fork(after_in_child=_forked)


def start(fanin: FanIn, pool: Any) -> ReportBatcher | None:
    """Start the worker's batcher if `fanin_report_batching` is on and `pool` (the worker's pool class, or its
    name) is prefork: in the main process, before the pool starts, so that its processes inherit the address."""
    global _address, _main_pid, _batcher
    if not fanin.settings.report_batching or _batcher is not None:
        return _batcher
    from celery.concurrency import get_implementation
    from celery.concurrency.prefork import TaskPool

    cls = get_implementation(pool) if isinstance(pool, str) else pool
    if not (isinstance(cls, type) and issubclass(cls, TaskPool)):
        logger.info("fanin_report_batching applies to a prefork pool only: each report is sent alone")
        return None
    try:
        _batcher = ReportBatcher(fanin)
    except OSError as exc:  # no socket (a TMPDIR whose path is too long for one): each report is sent alone
        logger.warning("cannot start the report batcher (%s): each report is sent alone", exc)
        return None
    _address, _main_pid = _batcher.address, os.getpid()
    atexit.register(_remove, _batcher, _main_pid)  # a cold shutdown sends no worker_shutdown
    return _batcher


def _remove(batcher: ReportBatcher, pid: int) -> None:
    if os.getpid() == pid:  # not in a pool process, which inherits the handler
        shutil.rmtree(batcher._dir, ignore_errors=True)


def stop() -> None:
    """Stop the worker's batcher (in its main process; a pool process's shutdown leaves it alone)."""
    global _address, _batcher
    batcher = _batcher
    if batcher is None or os.getpid() != _main_pid:
        return
    _address, _batcher = None, None
    batcher.stop()
