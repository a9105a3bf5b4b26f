"""A worker's successor runs: admitted by the store's run guard, kept alive by a heartbeat, handed over or finished.

The Celery side (which signal or task method calls what) is in `hooks`, `guards` and `reporter`; the statements
are in `store.successors`, each one round trip on the process's report connection (`FanIn.reports`), the one a
child's report takes, with no pool checkout.
A run belongs to one execution of the task (it hangs off that execution's request context), never to a task id or
a process: with thread-based pools (threads, gevent, eventlet) a duplicate delivery of the same task id runs in
the same process as the live run, and must neither see nor release it.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import uuid
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any, TypeVar

import psycopg
from celery.exceptions import SoftTimeLimitExceeded
from sqlalchemy import Connection

from .. import retry
from ..context import FanIn
from ..exceptions import ChordHeaderFailed
from ..protocol import SuccessorState
from ..store import outcomes, queries, successors
from ..store.batches import Encoded
from ..store.statements import Runner
from . import process
from .report import REPORTS_GIVEN_UP

logger = logging.getLogger("celery_fanin.successors")

T = TypeVar("T")


class LiveRun:
    """A run this process admitted and has not ended yet; `ended` once it is finished, handed over or fenced."""

    __slots__ = ("fanin", "run", "carrier", "ended", "fenced")

    def __init__(self, fanin: FanIn, run: successors.Run, carrier: str | None = None) -> None:
        self.fanin = fanin
        self.run = run
        self.carrier = carrier  # the token this run's delivery came with (a replacement's carrier), or None
        self.ended = False
        self.fenced = False

    @property
    def key(self) -> tuple[uuid.UUID, str, int]:
        return (self.run.batch_id, self.run.step, self.run.number)


def _store(fanin: FanIn, what: str, fn: Callable[[Runner], T]) -> T:
    """One statement on the report connection (autocommit: one round trip), retried over transient errors for up
    to `fanin_report_timeout` seconds (`retry.GaveUp` after that; a permanent error at once)."""
    return retry.call(lambda: fn(fanin.reports), what=what, timeout=float(fanin.settings.report_timeout))


def _read(fanin: FanIn, what: str, fn: Callable[[Connection], T]) -> T:
    """A read through the app's engine (the outcome's queries are SQLAlchemy's), in autocommit (no BEGIN and
    ROLLBACK around it), retried as `_store` is."""

    def once() -> T:
        with fanin.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            return fn(conn)

    return retry.call(once, what=what, timeout=float(fanin.settings.report_timeout))


def chord_failure(fanin: FanIn, batch_id: str, why: str) -> ChordHeaderFailed:
    """The error a chord's body fails with when its header did not all succeed: its batch's outcome, read again
    here (the body's message carries the results' place, not the outcome, when the body is immutable)."""
    bid = uuid.UUID(batch_id)

    def read(conn: Connection) -> dict[str, Any]:
        batch = queries.batch(conn, bid)
        if batch is None:
            return {"batch_id": batch_id, "failures": []}
        limit, max_bytes = fanin.settings.outcome_failures_limit, fanin.settings.outcome_max_bytes
        return dict(outcomes.build_outcome(conn, batch, limit, max_bytes=max_bytes))

    return ChordHeaderFailed.from_outcome(_read(fanin, f"the outcome of chord {batch_id}", read), why)


BOOT_ID = "/proc/sys/kernel/random/boot_id"
PID_NAMESPACE = "/proc/self/ns/pid"


def machine_id(boot_id: str = BOOT_ID, pid_namespace: str = PID_NAMESPACE) -> str:
    """This machine's processes as a name: the kernel's boot id (random at every boot, so two hosts, two VMs from one
    image, or one host before and after a reboot differ) and the PID namespace's inode (which tells containers of
    one kernel apart). The hostname is not enough: VMs cloned from one image and containers sharing the host's PID
    namespace have the same one, and the init namespace's inode is the same number on every Linux kernel.
    Empty when either is unreadable: no holder is then ever judged gone locally."""
    try:
        with open(boot_id) as f:
            boot = f.read().strip()
        pidns = os.stat(pid_namespace).st_ino
    except OSError:
        return ""
    return f"{boot}/{pidns}" if boot and ":" not in boot else ""


_MACHINE = machine_id()
# A worker's key: made by its main process at start (`new_worker_key`, from `worker_init`) and inherited by its pool
# processes (by fork, or through the environment when they are spawned). A run is stored with the key's digest;
# only a caller holding the key may end that run before its lease lapses, so another worker's credentials cannot.
WORKER_KEY_ENV = "CELERY_FANIN_WORKER_KEY"


def new_worker_key() -> None:
    """Give this worker (this process and the pool processes it starts from now on) a key of its own."""
    os.environ[WORKER_KEY_ENV] = secrets.token_hex(16)


def worker_key() -> str:
    key = os.environ.get(WORKER_KEY_ENV)
    if not key:  # not a worker (eager mode, a script): a key of this process's own
        new_worker_key()
        key = os.environ[WORKER_KEY_ENV]
    return key


def owner() -> str:
    """Who holds a run: host, machine (`machine_id`), process and thread (also read back by `_gone`)."""
    return f"{process_prefix(os.getpid())}{threading.get_ident()}"


def process_prefix(pid: int) -> str:
    """The start of `owner()` for every thread of process `pid` of this machine: what a worker's main process
    names a run of its pool process by (`record_final`'s `ran_in`)."""
    return f"{socket.gethostname()}:{_MACHINE}:{pid}:"


def _gone(holder: str | None) -> bool:
    """Whether `holder` is a process of this machine (same host and `machine_id`) that no longer exists.

    A pool process killed mid-body (OOM, SIGKILL) leaves a live-looking lease; with `acks_late` Celery redelivers
    its message at once, usually to the same worker. Seeing that the holder is gone lets that delivery run now
    instead of after the lease lapses. Anything not provably gone is treated as alive. (The store names a holder
    only to a caller with its worker's key, and lets only that caller take its run over early.)
    """
    if not holder or not _MACHINE:
        return False
    host, _, rest = holder.rpartition(":")[0].partition(":")
    machine, _, pid = rest.partition(":")
    if host != socket.gethostname() or machine != _MACHINE or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


def admit(
    fanin: FanIn, batch_id: str, step: str, task_id: str, retries: int, carrier: str | None = None
) -> LiveRun | None:
    """Start a run for this delivery, or None for a duplicate (or when the store cannot be reached: refusing is
    safe, since the relay republishes a successor that never starts).

    The guard's statement goes on the process's report connection (`FanIn.reports`), as every run statement does:
    it stands between the successor's delivery and its first line, and a pool checkout with its pre-ping would
    cost a round trip more. Its commit is durable (the connection's `synchronous_commit` is the server's): see
    docs/concepts/outbox.md for why an admission must never be lost in a crash.
    """
    bid = uuid.UUID(batch_id)
    lease, grace, me = float(fanin.settings.successor_lease), float(fanin.settings.successor_lease_grace), owner()
    key = worker_key()

    def claim() -> successors.Run | None:
        reports = fanin.reports

        def attempt(dead_owner: str | None = None) -> successors.Run | successors.Refusal:
            return successors.claim_run(
                reports, bid, step, task_id, retries, lease=lease, grace=grace, owner=me, owner_key=key,
                carrier=carrier, dead_owner=dead_owner,
            )  # fmt: skip

        got = attempt()
        if isinstance(got, successors.Refusal) and got.state == SuccessorState.RUNNING and _gone(got.owner):
            got = attempt(dead_owner=got.owner)
        if isinstance(got, successors.Refusal):
            successors.count_duplicate(reports, bid, step)
            return None
        return got

    timeout = float(fanin.settings.report_timeout)
    try:
        run = retry.call(claim, what=f"successor start of batch {batch_id}", timeout=timeout)
    except (retry.GaveUp, psycopg.Error):
        logger.exception("cannot start successor batch_id=%s: refused (the relay publishes it again)", batch_id)
        return None
    if run is None:
        return None
    live = LiveRun(fanin, run, carrier)
    _heartbeat().add(live)
    return live


def count_refused(fanin: FanIn, batch_id: str, step: str) -> None:
    """Count a delivery refused before the run guard saw it (its claim disagrees with its headers) as the guard
    counts one it refuses: in the successor's `duplicates`. One attempt: the caller retries (`report.send`)."""
    try:
        bid = uuid.UUID(batch_id)
    except ValueError:
        return  # names no batch: nothing to count it on
    successors.count_duplicate(fanin.reports, bid, step)


def due_at(eta: datetime | None, countdown: float | None) -> datetime:
    """When a handed-over run's next delivery is due: Celery's `eta` (UTC if naive), else `countdown` from now."""
    if eta is not None:
        return eta if eta.tzinfo is not None else eta.replace(tzinfo=timezone.utc)
    return datetime.now(timezone.utc) + timedelta(seconds=float(countdown or 0))


def hand_over(live: LiveRun, state: str, due_at: datetime | None = None, carrier: str | None = None) -> bool:
    """End the run and leave the successor to its next delivery (see `store.successors.hand_over`): for a
    replacement, only the delivery bringing `carrier`."""
    _heartbeat().remove(live)
    try:
        moved = _store(
            live.fanin,
            f"handing over successor of batch {live.run.batch_id}",
            lambda runner: successors.hand_over(runner, live.run, state, due_at, carrier),
        )
    except (retry.GaveUp, psycopg.Error):
        moved = False  # the run's lease lapses; the relay republishes the successor once it is dead
    live.ended = True
    if not moved:
        _log_fenced(live, state)
    return moved


def take_back(live: LiveRun) -> None:
    """The retry or replacement was never published: the run goes on, under its lease again."""
    lease = live.fanin.settings.successor_lease
    try:
        back = _store(
            live.fanin,
            "successor run taken back",
            lambda runner: successors.take_back(runner, live.run, lease, live.carrier),
        )
    except (retry.GaveUp, psycopg.Error):  # GaveUp too: an outage (or a lock held) past report_timeout
        back = False
    if back:
        live.ended = False
        _heartbeat().add(live)


def abandon(live: LiveRun) -> None:
    """Stop renewing the run's lease without recording anything: the relay republishes it once it is dead."""
    _heartbeat().remove(live)
    live.ended = True


def end_replacement(
    fanin: FanIn,
    batch_id: str,
    step: str,
    task_id: str,
    carrier: str,
    state: str,
    exc_type: str | None = None,
    exc_message: str | None = None,
) -> bool:
    """One attempt at ending a replaced successor for a part of its replacement that failed or was revoked
    (`store.successors.end_replacement`); the caller retries."""
    return successors.end_replacement(
        fanin.reports, uuid.UUID(batch_id), step, task_id, carrier, state, exc_type=exc_type, exc_message=exc_message
    )


def record_final(
    fanin: FanIn,
    batch_id: str,
    step: str,
    state: str,
    *,
    run: int | None = None,
    task_id: str | None = None,
    result: Encoded | None = None,
    exc_type: str | None = None,
    exc_message: str | None = None,
    carrier: str | None = None,
    retries: int | None = None,
    ran_in: int | None = None,
) -> bool:
    """One attempt at recording a final state (`store.successors.record_state`); the caller retries. Unfenced
    (no `run`), the worker's main process speaks of one copy of the message, whose `task_id` must be the
    successor's: one that ran in its pool process `ran_in` (a pid of this machine) or, without it, one that never
    ran (its `carrier` and `retries` say which copy it was)."""
    return successors.record_state(
        fanin.reports,
        uuid.UUID(batch_id),
        step,
        state,
        run=run,
        task_id=task_id,
        result=result,
        exc_type=exc_type,
        exc_message=exc_message,
        carrier=carrier,
        retries=retries,
        ran_in=None if ran_in is None else process_prefix(ran_in),
        owner_key=None if ran_in is None else worker_key(),
    )


def finish(
    live: LiveRun,
    state: str,
    *,
    result: Encoded | None = None,
    exc_type: str | None = None,
    exc_message: str | None = None,
) -> bool:
    """Record the final state of the pool process's own run, fenced to it, retried like any report."""
    _heartbeat().remove(live)
    live.ended = True
    run = live.run

    def record() -> bool:
        return retry.call(
            lambda: record_final(
                live.fanin,
                str(run.batch_id),
                run.step,
                state,
                run=run.number,
                result=result,
                exc_type=exc_type,
                exc_message=exc_message,
            ),
            what=f"recording successor state of batch {run.batch_id}",
            timeout=float(live.fanin.settings.report_timeout),
        )

    resent = False
    try:
        try:
            moved = record()
        except SoftTimeLimitExceeded:
            # The body has ended and the soft time limit hit this wait (or its backoff): the end is sent again, or
            # the run's lease would lapse and the relay run the body a second time. Fenced to this run, a second
            # send moves nothing if the first committed.
            logger.warning("recording the successor of batch %s was interrupted; sending it again", run.batch_id)
            resent = True
            moved = record()
    except (retry.GaveUp, psycopg.Error):
        REPORTS_GIVEN_UP.labels(kind="successor").inc()
        logger.exception(
            "gave up recording successor batch_id=%s as %s: its lease lapses, the relay reruns it", run.batch_id, state
        )
        return False
    if not moved and not resent:  # after a resend, the first send may be what moved it
        _log_fenced(live, state)
    return moved


def _log_fenced(live: LiveRun, state: str) -> None:
    logger.error(
        "successor batch_id=%s step=%s run %d could not record %s: the successor is final already, or its lease "
        "lapsed and another run took it over",
        live.run.batch_id,
        live.run.step,
        live.run.number,
        state,
        extra={"batch_id": str(live.run.batch_id), "step": live.run.step},
    )


class _Heartbeat:
    """Renews the leases of this process's live runs, from a thread of its own (a greenlet under gevent/eventlet).

    Renewals are conditional on the run number: a run whose lease was taken over learns it here (`fenced`) and is
    logged; its body cannot be stopped, but nothing it records later is kept.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._runs: dict[int, LiveRun] = {}
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, live: LiveRun) -> None:
        with self._lock:
            self._runs[id(live)] = live
            if self._thread is None:  # the first run (this object is per process: `worker.process`)
                self._thread = threading.Thread(target=self._loop, name="fanin-successor-heartbeat", daemon=True)
                self._thread.start()

    def remove(self, live: LiveRun) -> None:
        with self._lock:
            self._runs.pop(id(live), None)

    def live(self) -> list[LiveRun]:
        with self._lock:
            return list(self._runs.values())

    def _loop(self) -> None:
        delay = 0.0
        while True:
            self._wake.wait(delay)
            runs = self.live()
            if not runs:
                delay = 1.0
                continue
            delay = min(live.fanin.settings.successor_lease for live in runs) / 4
            by_app: dict[int, list[LiveRun]] = {}
            for live in runs:
                by_app.setdefault(id(live.fanin), []).append(live)
            for group in by_app.values():
                if not self._renew(group):
                    delay = min(delay, 1.0)  # the store is unreachable: try again soon, the lease is running out

    def _renew(self, group: list[LiveRun]) -> bool:
        fanin = group[0].fanin
        lease = fanin.settings.successor_lease
        try:
            held = successors.renew_leases(fanin.reports, [live.run for live in group], lease)
        except psycopg.Error as exc:
            logger.warning("could not renew successor leases (retrying): %s", exc.__class__.__name__)
            return False
        for live in group:
            if live.key not in held and not live.ended:
                self.remove(live)
                live.fenced = True
                logger.error(
                    "successor batch_id=%s step=%s run %d lost its lease while its body runs (the database was "
                    "unreachable for longer than fanin_successor_lease + fanin_successor_lease_grace?): its end "
                    "will not be recorded",
                    live.run.batch_id,
                    live.run.step,
                    live.run.number,
                    extra={"batch_id": str(live.run.batch_id), "step": live.run.step},
                )
        return True


def _heartbeat() -> _Heartbeat:
    return process.held(_Heartbeat)


def request_run(request: Any) -> LiveRun | None:
    """The run of the task execution whose request context this is (a custom `__call__` copies it)."""
    live = getattr(request, "_fanin_run", None)
    return live if isinstance(live, LiveRun) else None


def attach(request: Any, live: LiveRun) -> None:
    request._fanin_run = live
