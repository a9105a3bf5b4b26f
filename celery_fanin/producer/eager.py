"""`task_always_eager`: a fan-in whose children and successor run inline, counted as a worker counts them
(docs/concepts/producer.md).
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections import OrderedDict
from typing import Any

from celery import signals
from celery.exceptions import NotRegistered
from celery.result import EagerResult

from ..broker import publish
from ..codec import decode_signature
from ..context import FanIn
from ..dispatch.successors import Due, publish_outbox
from ..protocol import (
    HEADER_BATCH,
    HEADER_CHORD,
    HEADER_INDEX,
    HEADER_STEP,
    HEADER_SUCCESSOR,
    ChildState,
    Marker,
    request_header,
)
from ..store import batches, outbox, queries
from ..worker import runtime
from ..worker.guards import guard_tasks
from .result import EagerFanInResult

logger = logging.getLogger("celery_fanin.eager")

_installed = False
_install_lock = threading.Lock()
# Successor task id -> its eager result, for the handle `run_eagerly` returns (bounded: oldest dropped first).
_successor_results: OrderedDict[str, EagerResult] = OrderedDict()
_RESULTS_LIMIT = 1000


class EagerPropagated(Exception):
    """Stands for a child's exception that `task_eager_propagates` carried out of its eager run."""


# --- eager runs as the worker hooks see them ---------------------------------------------------------------------


class _RequestView:
    """An eager request with its headers lifted to attributes, as a worker's request has them."""

    def __init__(self, request: Any) -> None:
        self._request = request

    def get(self, key: str, default: Any = None) -> Any:
        return request_header(self._request, key, default)

    def __getattr__(self, key: str) -> Any:
        return self.get(key)


class _TaskView:
    """The task of an eager run, seen through `_RequestView`; everything else is the task's own."""

    def __init__(self, task: Any) -> None:
        self._task = task
        self.request = _RequestView(task.request)
        self.app = task.app

    def __getattr__(self, key: str) -> Any:
        return getattr(self._task, key)


def _eager_fanin_task(task: Any) -> tuple[_TaskView, Marker] | None:
    request = getattr(task, "request", None)
    if request is None or not getattr(request, "is_eager", False) or not getattr(request, "headers", None):
        return None
    view = _TaskView(task)
    marker = Marker.from_mapping(view.request)
    if marker is None or FanIn.find(task.app) is None:
        return None
    return view, marker


def _on_prerun(sender: Any = None, task_id: str | None = None, task: Any = None, **_: Any) -> None:
    task = task or sender
    found = _eager_fanin_task(task) if task is not None and task_id is not None else None
    if found is None or task_id is None:
        return
    view, marker = found
    if marker.is_successor:
        # What the run guard does on a worker: start a run and move the successor to `running`. An eager run
        # cannot be refused from here; a refusal (it ran already) is logged.
        fanin = FanIn.of(task.app)
        if runtime.current.reporter.admit_successor(fanin, task.request, task_id, marker) is None:
            logger.warning(
                "eager successor batch_id=%s step=%s task_id=%s ran already; running it again",
                marker.batch_id,
                marker.step,
                task_id,
            )
        return
    # An eager child ends within this same call: its terminal report is all there is to record (no start).


def _on_postrun(
    sender: Any = None,
    task_id: str | None = None,
    task: Any = None,
    retval: Any = None,
    state: str | None = None,
    **_: Any,
) -> None:
    task = task or sender
    found = _eager_fanin_task(task) if task is not None and task_id is not None else None
    if found is None or task_id is None:
        return
    view, marker = found
    runtime.current.reporter.postrun(view, task_id, retval, state)
    if marker.is_successor and state in ("SUCCESS", "FAILURE"):
        with _install_lock:
            _successor_results[task_id] = EagerResult(task_id, retval, state, name=task.name)
            while len(_successor_results) > _RESULTS_LIMIT:
                _successor_results.popitem(last=False)


def install() -> None:
    """Connect the eager handlers once per process; they act only on eager runs that carry fan-in headers."""
    global _installed
    with _install_lock:
        if _installed:
            return
        signals.task_prerun.connect(_on_prerun, weak=False, dispatch_uid="celery_fanin.eager.prerun")
        signals.task_postrun.connect(_on_postrun, weak=False, dispatch_uid="celery_fanin.eager.postrun")
        _installed = True


# --- after the producer: what did not run, then the successor ----------------------------------------------------


def run_eagerly(fanin: FanIn, batch_id: uuid.UUID | str) -> EagerFanInResult:
    """Finish an eager fan-in in this process, once the producer has written it; returns its handle.

    The children ran inline as the producer published them. A child that did not (its task is not registered,
    which stopped the producer's publishing there) is recorded as `unknown` as a worker would record it, or run
    now. Then the successor runs inline, if the batch finished. Its exceptions propagate as any eager task's do
    (``task_eager_propagates``); its state is recorded first.
    """
    install()
    app = fanin.app
    bid = uuid.UUID(str(batch_id))
    _finish_children(fanin, bid)
    _run_successors(fanin, bid)
    handle = EagerFanInResult(app, str(bid))
    # The successor may also have run inline before this call (the producer sends an empty batch's at once).
    with _install_lock:
        handle.successor_result = _successor_results.pop(handle.successor_task_id, None)
    return handle


def _finish_children(fanin: FanIn, batch_id: uuid.UUID) -> None:
    app = fanin.app
    with fanin.engine.connect() as conn:
        pending = queries.unfinished_children(conn, batch_id)
        conn.rollback()
    for row in pending:
        marker = Marker(str(batch_id), row.idx, None, task_name=row.task_name)
        if row.state == ChildState.STARTED:
            # It started and never ended: its exception propagated (task_eager_propagates) into the producer,
            # which logged it. On a worker it would have been recorded as failed.
            runtime.current.reporter.record_child(
                fanin,
                row.task_id,
                marker,
                ChildState.FAILED,
                exc=EagerPropagated(
                    "the child raised with task_eager_propagates on; its exception was logged by the producer"
                ),
            )
            continue
        if row.task_name not in app.tasks:
            runtime.current.reporter.record_child(
                fanin, row.task_id, marker, ChildState.UNKNOWN, exc=NotRegistered(row.task_name)
            )
            continue
        sig = decode_signature(app, batches.Encoded(row.content_type, row.content_encoding, bytes(row.message)))
        if publish.is_chain(sig):
            publish.publish_chain(None, str(batch_id), row.idx, row.task_id, sig)  # type: ignore[arg-type]
            continue
        sig.apply(
            task_id=row.task_id,
            throw=False,
            headers={**(sig.options.get("headers") or {}), HEADER_BATCH: str(batch_id), HEADER_INDEX: row.idx},
        )
    with fanin.engine.begin() as conn:
        found = queries.batch(conn, batch_id)
        if found is not None:
            batches.mark_published(conn, batch_id, found.planned)  # so that no relay ever publishes them again


def _run_successors(fanin: FanIn, batch_id: uuid.UUID) -> list[str]:
    """Claim the batch's unsent outbox rows as the relay does (`publish_outbox`), then run their successors inline."""
    with fanin.engine.connect() as conn:
        ids = outbox.pending_ids(conn, batch_id)
    due: list[Due] = []
    if ids:
        publish_outbox(fanin, ids=ids, limit=len(ids), deliver=due.append)
    for d in due:
        sig = d.signature
        headers = {**(sig.options.get("headers") or {}), HEADER_SUCCESSOR: str(d.batch_id), HEADER_STEP: d.step}
        if d.chord is not None:
            # A chord's body that must not run: its run guard fails it, as on a worker (which guards every task).
            headers[HEADER_CHORD] = d.chord
            guard_tasks(fanin.app)
        sig.apply(args=(d.outcome,), task_id=d.task_id, headers=headers)
    return [d.task_id for d in due]
