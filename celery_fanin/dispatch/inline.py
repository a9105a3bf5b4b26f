"""A completed batch's successor run in the pool process whose report completed the batch (`fanin_successor_inline`).

A successor published to the broker waits for its message to be written, delivered, received by a worker's main
process and handed to a pool process before its run guard even starts: about 1.5 ms of the fan-in's successor
latency on the benchmark's machine (bench/NOTES.md, "the successor run where its batch completed"). Here the
process that completed the batch builds the same message, with the same task id and headers, and runs it through
Celery's own tracer (`celery.app.trace.trace_task`): the same task guards, run guard, signals, result backend and
`link`s as a delivered copy. Nothing is admitted differently: the run guard admits this execution as it would
the message's first delivery, with a durable commit, and any later copy (the relay's, once the handoff passed) is
refused as a duplicate.

Only where the broker's way and this one cannot be told apart by the successor (`reason_not`): a task this worker
runs, routed to a queue this worker consumes, acknowledged early (not `acks_late`: a delivered one would be
redelivered at once if its worker died), with no `rate_limit` (the main process's token bucket throttles a
delivered one), with Celery's own `Request` class, with no `eta`/`countdown` nor a passed `expires`, and no
time limit on the successor or on the child's job it would run inside (the worker enforces a time limit per job,
and this job is the child's).
Otherwise, and whenever building the message fails, the successor is published as before.

A successor whose task id the worker has revoked is published, to be discarded by the worker as its message
would be. Celery sends a revoke to the worker's main process only, and a prefork pool process keeps the revoked
ids it was forked with: the main process mirrors its set into memory its pool processes share (`SharedRevoked`,
made at `worker_init`). Threads, gevent, eventlet and solo pools run tasks in the main process and read its set.

What differs, and is documented (docs/concepts/outbox.md): the worker sends no task events (`task-received`,
`task-started`, `task-succeeded`) for an inline successor, since those come from the main process's request; and
the child's message, under `acks_late`, is acknowledged after the successor's body returns.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import mmap
import threading
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from billiard.process import current_process
from celery import Celery
from celery.app.trace import trace_task
from celery.utils.collections import LimitedSet
from celery.worker import state as worker_state
from celery.worker.request import Request
from kombu.message import Message as KombuMessage
from kombu.serialization import dumps, loads, prepare_accept_content

from ..broker.publish import Built

logger = logging.getLogger("celery_fanin.dispatch")


@dataclass(frozen=True)
class Message:
    """The successor's message as a worker would have received it: what Celery's tracer takes."""

    name: str
    task_id: str
    request: dict[str, Any]
    args: tuple[Any, ...] | list[Any]
    kwargs: dict[str, Any]


def job_reason_not(app: Celery) -> str | None:
    """Why no successor may run in this process now, whatever it is, or None: this must be a worker's task (the
    child whose report completed the batch) whose job has no time limit, the worker enforcing it per job."""
    current = app.current_worker_task  # None outside a worker's task, and in eager mode
    if current is None:
        return "not in a worker's task"
    if any(getattr(current.request, "timelimit", None) or ()) or current.time_limit or current.soft_time_limit:
        return "the child's job has a time limit"
    if app.conf.task_time_limit or app.conf.task_soft_time_limit or any(_worker_limits):
        return "the worker sets time limits"
    return None


# The worker's own default time limits (`celery worker --time-limit/--soft-time-limit`): Celery keeps them on the
# WorkController and hands them to the pool per job, never in `app.conf`, so a pool process cannot read them there.
# Noted by the main process at `worker_init` (`note_worker`), before its pool forks.
_worker_limits: tuple[float | None, float | None] = (None, None)


def note_worker(worker: Any) -> None:
    """In a worker's main process at `worker_init`: its default time limits, inherited by the pool it forks."""
    global _worker_limits
    _worker_limits = (getattr(worker, "time_limit", None) or None, getattr(worker, "soft_time_limit", None) or None)


def reason_not(app: Celery, name: str, declare: tuple[Any, ...], headers: dict[str, Any]) -> str | None:
    """Why this successor must go through the broker, or None when this process may run it now.

    `declare`: the queue its route names (`broker.publish._Route.declare`); `headers`: its message's headers."""
    why = job_reason_not(app)
    if why is not None:
        return why
    task = app.tasks.get(name)
    if task is None:
        return "task not registered in this worker"
    why = _revoked(str(headers.get("id")))
    if why is not None:  # the worker's main process would discard its message
        return why
    if headers.get("eta") is not None:
        return "eta or countdown"
    if any(headers.get("timelimit") or ()) or task.time_limit or task.soft_time_limit:
        return "the successor has a time limit"
    if task.acks_late:
        return "acks_late: a delivered successor is redelivered at once if its worker dies"
    if task.rate_limit and not app.conf.worker_disable_rate_limits:
        return "a rate limit (the worker's main process throttles its messages)"
    if task.Request not in _CELERY_REQUEST:
        return "a custom Request class (its hooks run in the main process, for a message)"
    if not declare or getattr(declare[0], "name", None) not in app.amqp.queues.consume_from:
        return "routed to a queue this worker does not consume"
    if _queues_changed():
        return "the worker's queues or task limits changed since this process started"
    return None


# What `Task.Request` is unless a task sets its own: a custom one's hooks (on_success, on_failure, ...) run in the
# worker's main process for a delivered message, and would not run for a successor run here.
_CELERY_REQUEST = ("celery.worker.request:Request", Request)


# --- the worker's revoked task ids, where its pool processes can read them ----------------------------------------

_SLOT = 16  # bytes of a task id's digest
_SLOTS = 1 << 17  # 2 MiB per table, two tables (touched pages only); rebuilt from the worker's set when half full
_EMPTY = bytes(_SLOT)


class SharedRevoked:
    """The worker's revoked task ids (`celery.worker.state.revoked`: Celery sends a revoke to the main process only,
    and a prefork pool process keeps the copy it was forked with), mirrored where the pool processes read them: an
    anonymous shared mapping made by the main process before its pool forks, written by it alone.

    An open-addressing table of 16-byte digests. Written as the main process's set is (`track`): a revoke is seen
    here as soon as the main process took it, as its own check of a message would see it; a read racing the write
    of that id may miss it, the race a message received just before its revoke has with Celery too. Never shrunk:
    once half full, rebuilt from the set (bounded by Celery) into a second table, which readers then switch to (the
    first byte of the mapping names the live one), so that no reader sees a table being refilled."""

    def __init__(self) -> None:
        self._map = mmap.mmap(-1, 1 + 2 * _SLOTS * _SLOT)  # anonymous: shared with the processes forked later
        self._used = 0
        self._lock = threading.Lock()  # the main process's threads (its consumer, a control command) write

    @staticmethod
    def _digest(task_id: str) -> bytes:
        digest = hashlib.blake2b(task_id.encode(), digest_size=_SLOT).digest()
        return digest if digest != _EMPTY else b"\x01" + digest[1:]

    def _find(self, table: int, digest: bytes) -> tuple[int, bool]:
        """Where `digest` is in `table` (0 or 1), or the empty slot where it would go (and whether it was found)."""
        base = 1 + table * _SLOTS * _SLOT
        i = int.from_bytes(digest[:8], "little") % _SLOTS
        while True:
            at = base + i * _SLOT
            slot = self._map[at : at + _SLOT]
            if slot == digest:
                return at, True
            if slot == _EMPTY:
                return at, False
            i = (i + 1) % _SLOTS

    def add(self, task_id: str) -> None:
        with self._lock:
            live = self._map[0]
            self._used += self._add(live, self._digest(task_id))
            if self._used > _SLOTS // 2:
                spare = 1 - live
                base = 1 + spare * _SLOTS * _SLOT
                self._map[base : base + _SLOTS * _SLOT] = bytes(_SLOTS * _SLOT)
                self._used = sum(self._add(spare, self._digest(str(item))) for item in list(worker_state.revoked))
                self._used += self._add(spare, self._digest(task_id))  # whether or not Celery's set holds it yet
                self._map[0] = spare

    def _add(self, table: int, digest: bytes) -> int:
        at, found = self._find(table, digest)
        if found:
            return 0
        self._map[at : at + _SLOT] = digest
        return 1

    def __contains__(self, task_id: str) -> bool:
        return self._find(self._map[0], self._digest(task_id))[1]

    def track(self, revoked: Any) -> None:
        """Mirror Celery's set from now on (its `add` and `update`, wrapped on the instance every part of Celery
        holds), and what it holds already."""
        add, update = revoked.add, revoked.update

        def tracked_add(item: Any, *args: Any, **kwargs: Any) -> Any:
            result = add(item, *args, **kwargs)
            self.add(str(item))
            return result

        def tracked_update(other: Any) -> Any:
            items = other if isinstance(other, (dict, LimitedSet)) else list(other or ())
            result = update(items)
            for item in list(items):
                self.add(str(item))
            return result

        revoked.add, revoked.update = tracked_add, tracked_update
        for item in list(revoked):
            self.add(str(item))


_shared: SharedRevoked | None = None


def share_revoked_ids() -> None:
    """In a worker's main process, before its pool starts (`worker_init`): its revoked task ids, shared with the pool
    processes it forks from now on."""
    global _shared
    if _shared is None:
        _shared = SharedRevoked()
        _shared.track(worker_state.revoked)


# --- whether the worker's main process changed the queues it consumes since a pool process was forked --------------
# `add_consumer` / `cancel_consumer` change `app.amqp.queues` in the main process only: a prefork pool process keeps
# the set it was forked with, and would run here a successor routed to a queue its worker no longer consumes. The main
# process counts its changes in shared memory; a pool process compares that count with the one it was forked with.

_queues_generation = 0  # the main process's count; a forked pool process's copy is the count at its fork
_queues_shared: mmap.mmap | None = None


def share_queue_changes(app: Celery) -> None:
    """In a worker's main process, before its pool starts (`worker_init`): count its changes of consumed queues, and
    of task limits by the control commands (`_count_control_commands`)."""
    global _queues_shared
    if _queues_shared is not None:
        return
    _queues_shared = mmap.mmap(-1, 8)
    queues = app.amqp.queues
    for method in ("select_add", "select", "deselect"):
        setattr(queues, method, _counted(getattr(queues, method)))
    _count_control_commands()


def _counted(original: Any) -> Any:
    """`original`, counted as a change of the worker's state once it returns (or raises)."""

    def counted(*args: Any, **kwargs: Any) -> Any:
        global _queues_generation
        try:
            return original(*args, **kwargs)
        finally:
            _queues_generation += 1
            if _queues_shared is not None:
                _queues_shared[:8] = _queues_generation.to_bytes(8, "little")

    counted.fanin_counted = True  # type: ignore[attr-defined]
    return counted


# Celery's control commands that change a task's limits in the worker's main process only: `rate_limit` at once (the
# main process's token buckets), `time_limit` once the consumer restarts (Celery builds each task's request class,
# with its limits, per consumer start). A prefork pool process keeps the task as it was forked, so it could not tell
# that a successor, or the child's job it would run in, is now limited.
_LIMIT_COMMANDS = ("rate_limit", "time_limit")


def _count_control_commands() -> None:
    from celery.worker.control import Panel  # the worker's handlers: its pidbox dispatches through this very dict

    for name in _LIMIT_COMMANDS:
        handler = Panel.data.get(name)
        if handler is not None and not getattr(handler, "fanin_counted", False):
            Panel.data[name] = functools.wraps(handler)(_counted(handler))


def _queues_changed() -> bool:
    if _queues_shared is None or not _in_pool_process():
        return False  # the main process reads its own live set (threads, gevent, eventlet, solo)
    return int.from_bytes(_queues_shared[:8], "little") != _queues_generation


def prepare_worker(worker: Any, app: Celery) -> None:
    """In a worker's main process at `worker_init`, before its pool forks: what its pool processes must read of it
    to tell whether a successor may run where its batch completed (its revoked ids, its command line's time limits,
    its changes of consumed queues)."""
    share_revoked_ids()
    note_worker(worker)
    share_queue_changes(app)


def _in_pool_process() -> bool:
    """Whether this is a prefork pool process, which holds copies of its worker's state made when it was forked
    (threads, gevent, eventlet and solo pools run tasks in the main process, which holds the live state)."""
    return current_process().name != "MainProcess"


def _revoked(task_id: str) -> str | None:
    if task_id in worker_state.revoked:  # the worker's own set, live in its main process (threads, gevent, solo)
        return "revoked"
    if not _in_pool_process():
        return None
    if _shared is None:  # a pool process that did not inherit them (spawned, or a worker without the hook)
        return "this process cannot see the worker's revoked task ids"
    return "revoked" if task_id in _shared else None


def message(app: Celery, task_id: str, built: Built) -> Message | None:
    """The built message (`broker.publish.successor_message`), taken through its serializer and back, and read by
    Celery's own `Request` as a worker's main process reads a delivered one; None when it must be published
    (`reason_not`, its content not accepted here, or its `expires` passed: the worker discards that message)."""
    route, headers, properties = built.route, built.headers, built.properties
    name = headers["task"]
    why = reason_not(app, name, route.declare, headers)
    if why is None:
        try:
            content_type, encoding, payload = dumps(built.body, serializer=route.serializer)
            args, kwargs, embed = loads(
                payload, content_type, encoding, accept=prepare_accept_content(app.conf.accept_content)
            )
            received = Request(
                KombuMessage(
                    body=payload,
                    content_type=content_type,
                    content_encoding=encoding,
                    headers=headers,
                    properties=properties,
                    delivery_info={"exchange": route.exchange, "routing_key": route.routing_key},
                ),
                app=app,
                hostname=app.current_worker_task.request.hostname,  # type: ignore[union-attr]  # reason_not checked
                task=app.tasks[name],
                body=(args, kwargs, embed),
                decoded=True,
            )
            if received.expires is not None and datetime.now(received.expires.tzinfo) >= received.expires:
                why = "its expires passed"
        except Exception as exc:  # noqa: BLE001 - a worker would refuse it too: the broker's way says so properly
            why = f"its body cannot be read back here ({exc.__class__.__name__})"
    if why is not None:
        logger.debug("successor task_id=%s published, not run here: %s", task_id, why)
        return None
    # What a pool process adds to the main process's request (`celery.app.trace.fast_trace_task`).
    request = {**received.request_dict, "is_eager": False, **(embed or {})}
    return Message(name, task_id, request, args, kwargs)


# The outbox rows of the successors running here, by task id: marked sent by the run guard's thread once it admitted
# the run (`take_unsent`), off the path to the body's first line and before a long body lets the relay publish a
# copy once the handoff passed; else by `dispatch.successors` after the run. (Not in the request: Celery copies a
# request's fields into the messages a retry or a replacement publishes.)
_unsent: dict[str, list[int]] = {}
_unsent_lock = threading.Lock()


def hold_unsent(task_id: str, ids: list[int]) -> None:
    with _unsent_lock:
        _unsent[task_id] = ids


def take_unsent(task_id: str) -> list[int]:
    """The outbox rows of the successor `task_id` running here, to the first caller only ([] for any other)."""
    with _unsent_lock:
        return _unsent.pop(task_id, [])


def run(app: Celery, msg: Message) -> None:
    """Run the successor through Celery's tracer, as a pool process runs a delivered message: the tracer stores
    its result, sends its signals and runs its links and error callbacks, and the task guards admit it. (A
    `Reject(requeue=True)` it raises requeues nothing, as for any message acknowledged when received.)"""
    trace_task(app.tasks[msg.name], msg.task_id, msg.args, msg.kwargs, msg.request, app=app)
