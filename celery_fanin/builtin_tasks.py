"""The library's own Celery tasks, defined on every app wired with `FanIn(app)` by `register`.

- ``celery_fanin.run_group``: a nested fan-in, as a child or as `then=` (a pipeline stage);
- ``celery_fanin.saga_step_done`` and ``celery_fanin.compensation_done``: the successors that move a saga on;
- ``celery_fanin.prune``: retention, for celery beat.

Their names are in `celery_fanin.protocol`: messages in flight and users' routes name them.
"""

from __future__ import annotations

import threading
import uuid
import weakref
from typing import Any

from celery import Celery
from celery.exceptions import Ignore
from sqlalchemy.exc import InterfaceError, OperationalError

from .context import FanIn
from .exceptions import FanInDatabaseError
from .ops.retention import prune
from .producer.group import FanInGroup
from .protocol import (
    COMPENSATION_DONE_TASK,
    HEADER_BATCH,
    HEADER_SUCCESSOR,
    PRUNE_TASK,
    RUN_GROUP_TASK,
    SAGA_STEP_DONE_TASK,
    request_header,
)
from .sagas.driver import kick, settle_stage, settle_step
from .store import sagas as store

# Database errors worth retrying a saga's internal task for (a restart, a failover), not bugs.
_RETRYABLE = (OperationalError, InterfaceError, FanInDatabaseError)

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
        if request_header(self.request, HEADER_SUCCESSOR):
            # A pipeline stage: the batch that just finished (its outcome is args[0]) starts the next one.
            outcome = args[0]
            group.key = f"then:{outcome['batch_id']}:{outcome['step']}"
            handle = group.apply_async()
            return {"batch_id": handle.batch_id}
        if request_header(self.request, HEADER_BATCH):
            # A child: the inner batch's successor will report this child; until then it is not finished.
            group.key = f"nested:{self.request.id}"
            group.parent_task_id = self.request.id
            group.apply_async()
            raise Ignore()
        # Called on its own (not through a fan-in): just start the group.
        return {"batch_id": group.apply_async().batch_id}

    @app.task(name=SAGA_STEP_DONE_TASK, bind=True, shared=False, autoretry_for=_RETRYABLE, retry_backoff=True,
              retry_backoff_max=60, max_retries=20)  # fmt: skip
    def saga_step_done(self: Any, outcome: dict[str, Any], saga_id: str, position: int) -> dict[str, Any]:
        """The successor of every saga step's batch: advance the saga, or start its rollback."""
        fanin = FanIn.of(self.app)
        sid = uuid.UUID(saga_id)
        settle_step(fanin, sid, position)
        kick(fanin, sid)
        return {"saga_id": saga_id, "step": position, "succeeded": outcome.get("succeeded"),
                "failed": outcome.get("failed")}  # fmt: skip

    @app.task(name=COMPENSATION_DONE_TASK, bind=True, shared=False, autoretry_for=_RETRYABLE, retry_backoff=True,
              retry_backoff_max=60, max_retries=20)  # fmt: skip
    def compensation_done(self: Any, outcome: dict[str, Any]) -> dict[str, Any]:
        """The successor of every compensation batch: move each saga waiting on it to its next stage."""
        fanin = FanIn.of(self.app)
        with fanin.engine.connect() as conn:
            waiting = store.waiting_on(conn, uuid.UUID(outcome["batch_id"]))
        for saga_id, stage in waiting:
            settle_stage(fanin, saga_id, stage)
            kick(fanin, saga_id)
        return {"succeeded": outcome.get("succeeded"), "failed": outcome.get("failed"),
                "sagas": [str(s) for s, _ in waiting]}  # fmt: skip

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
        return prune(FanIn.of(self.app), older_than, chunk=chunk, max_children=max_children, limit=limit,
                     max_seconds=max_seconds).as_dict()  # fmt: skip
