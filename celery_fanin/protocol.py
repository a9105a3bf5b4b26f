"""What a celery-fanin message says about itself: the header names, the marker they make, the library's task names.

The producer and the relay write these headers; the worker hooks, eager mode and the built-in tasks read them.
"""

from __future__ import annotations

from typing import Any

HEADER_BATCH = "fanin_batch"
HEADER_INDEX = "fanin_index"
HEADER_SUCCESSOR = "fanin_successor"
HEADER_STEP = "fanin_step"
# On every task of a chain child: the child's task id (the chain's last task's), which each task reports for.
HEADER_CHAIN = "fanin_chain"
# On a chain child's tasks and on a replacement: the task name the child was published as (its row's task_name),
# which its report names instead of the running task's own (see docs/concepts/trust.md).
HEADER_TASK = "fanin_task"
# On a child created with `compensated(sig, undo)`: the undo's signature, stored with the child's message.
HEADER_UNDO = "fanin_undo"
# On a compensation task: the task id of the work it undoes (`task.request.fanin_undo_of`), its idempotency key.
HEADER_UNDO_OF = "fanin_undo_of"

# The library's own tasks (`celery_fanin.builtin_tasks`). Messages in flight and users' routes name them: never
# rename one.
RUN_GROUP_TASK = "celery_fanin.run_group"
SAGA_STEP_DONE_TASK = "celery_fanin.saga_step_done"
COMPENSATION_DONE_TASK = "celery_fanin.compensation_done"
PRUNE_TASK = "celery_fanin.prune"

# The NOTIFY channel a new successor's transaction signals and the relay listens on.
OUTBOX_CHANNEL = "fanin_outbox"


def request_header(request: Any, name: str, default: Any = None) -> Any:
    """A header of the running task's message. A worker lifts custom headers onto the request as attributes;
    under `task_always_eager` Celery leaves them in ``request.headers``. The attribute wins when both are set."""
    value = getattr(request, name, None)
    if value is None:
        value = (getattr(request, "headers", None) or {}).get(name)
    return default if value is None else value


class Marker:
    """The fan-in headers of one task message: a child (batch + index) or a successor (batch + step)."""

    __slots__ = ("batch_id", "index", "step", "chain", "task_name")

    def __init__(
        self, batch_id: str, index: int | None, step: str | None, chain: str | None = None, task_name: str | None = None
    ) -> None:
        self.batch_id = batch_id
        self.index = index
        self.step = step
        self.chain = chain  # a chain child's task id (its last task's), on each of the chain's tasks
        # The task the child was published as, which its report claims (None: unknown, a chain from before
        # HEADER_TASK existed): the message's own task name, or HEADER_TASK on a chain's tasks and replacements.
        self.task_name = task_name

    def child_id(self, task_id: str) -> str:
        """The task id of the child this message reports for: its own, or its chain's."""
        return self.chain or task_id

    @property
    def is_successor(self) -> bool:
        return self.step is not None

    def headers(self) -> dict[str, Any]:
        """The message headers that carry this marker (what a replacement task must be given)."""
        if self.is_successor:
            return {HEADER_SUCCESSOR: self.batch_id, HEADER_STEP: self.step}
        headers: dict[str, Any] = {HEADER_BATCH: self.batch_id, HEADER_INDEX: self.index}
        if self.task_name is not None:
            headers[HEADER_TASK] = self.task_name  # a replacement reports as the task it replaced
        return headers

    @classmethod
    def from_mapping(cls, data: Any) -> Marker | None:
        if not data:
            return None
        get = data.get if hasattr(data, "get") else (lambda k, d=None: getattr(data, k, d))
        successor = get(HEADER_SUCCESSOR, None)
        if successor:
            return cls(str(successor), None, str(get(HEADER_STEP, "")))
        batch_id = get(HEADER_BATCH, None)
        if batch_id:
            index = get(HEADER_INDEX, None)
            chain = get(HEADER_CHAIN, None)
            named = get(HEADER_TASK, None) or (None if chain else get("task", None))
            return cls(
                str(batch_id),
                int(index) if index is not None else None,
                None,
                str(chain) if chain else None,
                named if isinstance(named, str) else None,
            )
        return None
