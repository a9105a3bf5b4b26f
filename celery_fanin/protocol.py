"""The names celery-fanin's processes agree on: message headers and the marker they make, the library's task names,
and the states of children, batches, successors and sagas (the SQL's CHECK constraints allow exactly these)."""

from __future__ import annotations

from enum import Enum
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
# A fan-in that came out of a message (a chain's next step, a link, a chord's body) or a beat entry: writes it.
RUN_CANVAS_TASK = "celery_fanin.run_canvas"
# The successor of a fan-in whose `then=` is a chain or a group: replaces itself with that canvas.
THEN_CANVAS_TASK = "celery_fanin.then_canvas"
# The subtask type a fan_in_group signature is registered under (`Signature.register_type`).
FAN_IN_GROUP_TYPE = "fan_in_group"

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


class State(str, Enum):
    """A state as the store spells it: equal to, hashed and formatted as its text, so rows compare with it."""

    def __str__(self) -> str:
        return str.__str__(self)

    def __format__(self, spec: str) -> str:
        return str.__format__(self, spec)


class ChildState(State):
    """A child's row: open while `pending` or `started`, then one terminal state (only `succeeded` is a success)."""

    PENDING = "pending"
    STARTED = "started"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    TIME_LIMIT = "time_limit"
    WORKER_LOST = "worker_lost"
    REVOKED = "revoked"
    REJECTED = "rejected"
    UNKNOWN = "unknown"
    LOST = "lost"  # set by recovery (child_timeout), never by a worker
    ABANDONED = "abandoned"  # set when the batch stopped waiting for it (deadline, threshold, cancel)


class BatchState(State):
    """A batch: `open` while a streaming producer writes it, `running` until it finishes in one of the others."""

    OPEN = "open"
    RUNNING = "running"
    COMPLETE = "complete"
    EXPIRED = "expired"
    CANCELLED = "cancelled"
    PARTIAL = "partial"
    FAILED_THRESHOLD = "failed_threshold"


class SuccessorState(State):
    """A successor's row, from its creation with the batch's last outcome to the end of its last run."""

    PENDING = "pending"
    SENT = "sent"
    RUNNING = "running"
    RETRYING = "retrying"
    REQUEUED = "requeued"
    REPLACED = "replaced"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    REVOKED = "revoked"
    IGNORED = "ignored"


class SagaState(State):
    """A saga: its steps run, then (after a step failed for good) its compensations, until one of the final four."""

    RUNNING = "running"
    COMPENSATING = "compensating"
    SUCCEEDED = "succeeded"
    COMPENSATED = "compensated"
    COMPENSATION_FAILED = "compensation_failed"
    MANUAL_ACTION_REQUIRED = "manual_action_required"


# A child not yet terminal: published (or about to be), or started by a worker.
CHILD_OPEN = frozenset({ChildState.PENDING, ChildState.STARTED})
# A batch still counting its children.
BATCH_ACTIVE = frozenset({BatchState.OPEN, BatchState.RUNNING})
# A batch whose successor runs before every child has finished.
BATCH_PARTIAL = frozenset({BatchState.PARTIAL, BatchState.FAILED_THRESHOLD, BatchState.EXPIRED, BatchState.CANCELLED})
# A batch that may end with no successor at all (an abandoned deadline or a cancel, without `on_expire`).
BATCH_ENDED_WITHOUT_SUCCESSOR = frozenset({BatchState.EXPIRED, BatchState.CANCELLED})
# A successor whose run ended for good: nothing runs its body again.
SUCCESSOR_FINAL = frozenset(
    {SuccessorState.SUCCEEDED, SuccessorState.FAILED, SuccessorState.REVOKED, SuccessorState.IGNORED}
)
# A saga after which nothing happens without an operator (`SagaResult.wait()` returns on them).
SAGA_FINAL = frozenset(
    {SagaState.SUCCEEDED, SagaState.COMPENSATED, SagaState.COMPENSATION_FAILED, SagaState.MANUAL_ACTION_REQUIRED}
)
