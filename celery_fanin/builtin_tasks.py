"""The library's own Celery tasks, defined on every app wired with `FanIn(app)` by `register`.

- ``celery_fanin.run_group``: a nested fan-in, as a child or as `then=` (a pipeline stage);
- ``celery_fanin.run_canvas``: a fan-in that came out of a message (a chain's next step, a link, a chord's body);
- ``celery_fanin.then_canvas``: the successor of a fan-in whose `then=` is a chain or a group;
- ``celery_fanin.group_results``: the successor of such a group, written as a fan-in of its own;
- ``celery_fanin.saga_step_done`` and ``celery_fanin.compensation_done``: the successors that move a saga on;
- ``celery_fanin.prune``: retention, for celery beat.

Their names are in `celery_fanin.protocol`: messages in flight and users' routes name them.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
import weakref
from typing import Any

from celery import Celery
from celery.canvas import Signature, _chain, group, maybe_signature
from celery.exceptions import ChordError, Ignore, Reject
from celery.utils.functional import maybe_list
from sqlalchemy.exc import InterfaceError, OperationalError

from .codec import decode_result
from .context import FanIn
from .exceptions import FanInDatabaseError, InvalidFanIn
from .ops.retention import prune
from .producer.group import FanInGroup
from .producer.result import rebuilt_exception
from .producer.schedule import key_of_slot
from .protocol import (
    COMPENSATION_DONE_TASK,
    GROUP_RESULTS_TASK,
    HEADER_BATCH,
    HEADER_STEP,
    HEADER_SUCCESSOR,
    PRUNE_TASK,
    RUN_CANVAS_TASK,
    RUN_GROUP_TASK,
    SAGA_STEP_DONE_TASK,
    THEN_CANVAS_TASK,
    UNPUBLISHABLE_TASK,
    OutcomePayload,
    request_header,
)
from .sagas.driver import kick, settle_stage, settle_step
from .store import admin, queries
from .store import sagas as store

logger = logging.getLogger("celery_fanin.canvas")

# A saga's successors retry database errors (a restart, a failover), not bugs.
_SAGA_TASK_OPTIONS: dict[str, Any] = {
    "bind": True,
    "shared": False,
    "autoretry_for": (OperationalError, InterfaceError, FanInDatabaseError),
    "retry_backoff": True,
    "retry_backoff_max": 60,
    "max_retries": 20,
}

# A fan-in written from a message retries database errors (an outage must not lose it), never a bad plan.
_CANVAS_TASK_OPTIONS: dict[str, Any] = {
    "bind": True,
    "shared": False,
    "ignore_result": True,
    "acks_late": True,
    "autoretry_for": (OperationalError, InterfaceError, FanInDatabaseError),
    "retry_backoff": True,
    "retry_backoff_max": 60,
    "max_retries": None,
}

_registered: weakref.WeakSet[Celery] = weakref.WeakSet()
_register_lock = threading.Lock()


def register(app: Celery) -> None:
    """Define the built-in tasks on `app`, once; `FanIn(app)` calls this. Lazy, like any `@app.task`: it does not
    finalize the app."""
    with _register_lock:
        if app in _registered:
            return
        _registered.add(app)

    @app.task(name=RUN_GROUP_TASK, bind=True, shared=False)
    def run_group(self: Any, *args: Any) -> dict[str, Any]:
        """A nested fan-in: as a child, create the inner batch and end IGNORED (counted when its successor ends);
        as a successor, start the next stage of a pipeline."""
        spec = args[-1]
        group = FanInGroup.from_spec(self.app, spec)
        finished = request_header(self.request, HEADER_SUCCESSOR)
        if finished:
            first = args[0]
            if isinstance(first, list):
                # A chord's body that is a chord: the header's results (args[0]) go to each of its header tasks,
                # as Celery's chord passes them on; the batch that finished names its key.
                key = f"then:{finished}:{request_header(self.request, HEADER_STEP)}"
                return {"batch_id": group.evolve(key=key).apply_async(args=(first,)).batch_id}
            # A pipeline stage: the batch that just finished (its outcome is args[0]) starts the next one.
            handle = group.evolve(key=f"then:{first['batch_id']}:{first['step']}").apply_async()
            return {"batch_id": handle.batch_id}
        if request_header(self.request, HEADER_BATCH):
            # A child: the inner batch's successor will report this child; until then it is not finished. At the
            # end of a chain child, the value of the task before it (args[0]) goes to each of its children first.
            nested = group.evolve(key=f"nested:{self.request.id}", parent_task_id=self.request.id)
            nested.apply_async(args=tuple(args[:-1]))
            raise Ignore()
        # Called on its own (not through a fan-in): just start the group.
        return {"batch_id": group.apply_async().batch_id}

    @app.task(name=RUN_CANVAS_TASK, **_CANVAS_TASK_OPTIONS)
    def run_canvas(
        self: Any, canvas: dict[str, Any], key: str | None = None, slot: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """Write the fan-in a chain, a link or a chord's body reached (`FanInGroup.apply_async` sends it here
        rather than writing it in the trace of the task before), or a beat entry (`fan_in_schedule`: its `slot`,
        stamped with the time beat sent it, names the key; `key`, an entry from before 0.1, is the key itself).
        Its batch id was fixed when it was sent, or its key names the slot, so a re-delivered message, a second
        beat's, or a retry after a database error finds the batch the first run wrote."""
        group = FanInGroup._restore(canvas, self.app, from_message=False)
        if slot is not None:
            key, stamped = key_of_slot(slot, time.time())
            if not stamped:
                logger.warning(
                    "scheduled fan-in %s came without its send time (is FanIn(app) called where beat loads the "
                    "app?): its slot is the one it runs in",
                    key,
                )
        if key is not None:
            group = group.evolve(key=key)
        return {"batch_id": group.apply_async().batch_id}

    @app.task(name=THEN_CANVAS_TASK, bind=True, shared=False)
    def then_canvas(self: Any, outcome: Any, canvas: dict[str, Any]) -> Any:
        """The successor of `fan_in_group(..., then=chain(...) or group(...))` (or a chord's body), the outcome
        (a chord's: the header's results) the first argument of the canvas's first tasks.

        A group is written as a fan-in of its own, the next stage (`_group_stage`), whose successor returns the
        members' values: Celery's `replace` would make it a chord, which needs a result backend. A chain, and a
        group the fan-in cannot take as children, replace this task: the replacement ends the successor, and takes
        its task id."""
        replacement = _with_first_argument(self.app.signature(canvas), outcome)
        if isinstance(replacement, group):
            written = _group_stage(self, replacement)
            if written is not None:
                return written
        if self.request.parent_id:  # its canvas is its parent's child, as a chord's body is of its last header task
            _set_first_parent(replacement, self.request.parent_id)
        raise self.replace(replacement)

    @app.task(name=GROUP_RESULTS_TASK, bind=True, shared=False)
    def group_results(self: Any, outcome: OutcomePayload) -> list[Any]:
        """The successor of a group that `then_canvas` wrote: its members' values in order, as a group's result
        is; if one did not succeed, the first such member's error (as `GroupResult.get()` raises it)."""
        if outcome.get("failures"):
            first = min(outcome["failures"], key=lambda f: f.get("index", 0))
            raise rebuilt_exception(first.get("exc_type"), first.get("exc_message"))
        if outcome.get("failed") or outcome.get("succeeded") != outcome.get("planned"):
            raise ChordError(
                f"group {outcome.get('batch_id')}: {outcome.get('succeeded')} of {outcome.get('planned')} members "
                f"succeeded ({outcome.get('state')})"
            )
        engine = FanIn.of(self.app).engine
        rows = queries.child_results(
            engine, uuid.UUID(outcome["batch_id"]), across_rounds=int(outcome.get("round") or 1) > 1
        )
        return [decode_result(self.app, encoded) if encoded is not None else None for *_, encoded in rows]

    @app.task(name=SAGA_STEP_DONE_TASK, **_SAGA_TASK_OPTIONS)
    def saga_step_done(self: Any, outcome: OutcomePayload, saga_id: str, position: int) -> dict[str, Any]:
        """The successor of every saga step's batch: advance the saga, or start its rollback."""
        fanin = FanIn.of(self.app)
        sid = uuid.UUID(saga_id)
        settle_step(fanin, sid, position)
        kick(fanin, sid)
        return {
            "saga_id": saga_id,
            "step": position,
            "succeeded": outcome.get("succeeded"),
            "failed": outcome.get("failed"),
        }

    @app.task(name=COMPENSATION_DONE_TASK, **_SAGA_TASK_OPTIONS)
    def compensation_done(self: Any, outcome: OutcomePayload) -> dict[str, Any]:
        """The successor of every compensation batch: move each saga waiting on it to its next stage."""
        fanin = FanIn.of(self.app)
        with fanin.engine.connect() as conn:
            waiting = store.waiting_on(conn, uuid.UUID(outcome["batch_id"]))
        for saga_id, stage in waiting:
            settle_stage(fanin, saga_id, stage)
            kick(fanin, saga_id)
        return {
            "succeeded": outcome.get("succeeded"),
            "failed": outcome.get("failed"),
            "sagas": [str(s) for s, _ in waiting],
        }

    @app.task(name=UNPUBLISHABLE_TASK, shared=False, ignore_result=True)
    def unpublishable(reason: str) -> None:
        """Stand in for a child the relay could not publish (`dispatch.children`): rejected, with why, so that the
        worker hooks count that child `rejected` through the worker's own checked report."""
        raise Reject(reason, requeue=False)

    @app.task(name=PRUNE_TASK, bind=True, shared=False)
    def prune_task(
        self: Any,
        older_than: float | str = "30d",
        chunk: int = 500,
        max_children: int = 20_000,
        limit: int | None = None,
        max_seconds: float | None = None,
    ) -> dict[str, Any]:
        """Delete finished batches older than `older_than` (see `celery_fanin.ops.retention.prune`)."""
        return prune(
            FanIn.of(self.app), older_than, chunk=chunk, max_children=max_children, limit=limit, max_seconds=max_seconds
        ).as_dict()


# A group's options that place it in a canvas or name it, not message options its members take.
_GROUP_OWN_OPTIONS = frozenset({"task_id", "group_id", "group_index", "chord", "chain", "link", "link_error"})


def _group_stage(task: Any, members: group) -> dict[str, Any] | None:
    """Write the group `then_canvas` was given as the next stage of its batch: a fan-in of its members (each with
    the successor's errbacks, as `group.link_error` gives them) whose successor, `celery_fanin.group_results`,
    takes the successor's callbacks and chain. Keyed by the batch and step it follows, so a second run of
    `then_canvas` finds the stage the first wrote. The handle's `get()` follows it (`FanInResult.get`). None for a
    group the fan-in cannot take as children (a group or chord inside it), and for a batch that stands for a child
    of another (nested): Celery's `replace` runs it then, as before, and needs a result backend. (A nested batch
    counts its child when its successor ends, with its value: a stage would leave the child counted before the
    group ran, with the stage's id for its value.)"""
    request = task.request
    finished = request_header(request, HEADER_SUCCESSOR)
    if finished:
        with FanIn.of(task.app).engine.connect() as conn:
            found = admin.node(conn, uuid.UUID(finished))
        if found is not None and found.parent_task_id is not None:
            return None
    errbacks = [maybe_signature(e, app=task.app) for e in maybe_list(request.errbacks) or []]
    tasks = []
    shared = {k: v for k, v in members.options.items() if k not in _GROUP_OWN_OPTIONS}
    for member in members.tasks:
        member = maybe_signature(member, app=task.app).clone()
        member.options = {**shared, **member.options}  # the group's message options (queue, ...) under its members'
        for errback in errbacks:
            member.link_error(errback.clone())
        tasks.append(member)
    collector = task.app.signature(GROUP_RESULTS_TASK)
    for callback in maybe_list(request.callbacks) or []:
        collector.link(maybe_signature(callback, app=task.app))
    if request.chain:
        collector.options["chain"] = list(request.chain)
    stage = FanInGroup(tasks, then=collector, app=task.app)
    if finished:
        stage = stage.evolve(key=f"then:{finished}:{request_header(request, HEADER_STEP)}")
    try:
        handle = stage.apply_async()
    except InvalidFanIn as exc:
        logger.info("then_canvas %s: the group is not a fan-in's children (%s): Celery runs it", request.id, exc)
        return None
    # Its callbacks and chain went to the stage's successor: Celery must not send them this task's return value.
    request.callbacks, request.chain = None, None
    return {"batch_id": handle.batch_id}


def _set_first_parent(sig: Signature, parent_id: str) -> None:
    """Make `parent_id` the parent of the tasks `sig` publishes first (a chain's first task, each member of a
    group): Celery's `replace` publishes them from this task, which would be their parent otherwise."""
    if isinstance(sig, _chain):
        _set_first_parent(sig.tasks[0], parent_id)
    elif isinstance(sig, group):
        for member in sig.tasks:
            _set_first_parent(member, parent_id)
    else:
        sig.options["parent_id"] = parent_id


def _with_first_argument(sig: Signature, value: Any) -> Signature:
    """`sig` with `value` before its own arguments where a chord body's first task would get its header's
    results: a chain's first task, every member of a group (not `clone(args)`: a chain or group rebuilt from its
    dict drops the arguments given to it as a whole)."""
    if isinstance(sig, _chain):
        tasks = [maybe_signature(t, app=sig._app) for t in sig.tasks]
        return _chain(_with_first_argument(tasks[0], value), *tasks[1:], app=sig._app, **sig.options)
    if isinstance(sig, group):
        members = [_with_first_argument(maybe_signature(t, app=sig._app), value) for t in sig.tasks]
        return group(members, app=sig._app, **sig.options)
    return sig.clone((value,))
