"""The names celery-fanin's processes agree on: message headers and the marker they make, the library's task names,
and the states of children, batches, successors and sagas (the SQL's CHECK constraints allow exactly these)."""

from __future__ import annotations

import time
from enum import Enum
from typing import Any, TypedDict

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
# On a successor's replacement (`Task.replace`): the token its run guard admits from then on, instead of any copy of
# the message it replaced (which keeps the same task id).
HEADER_CARRIER = "fanin_carrier"
# On every other task of a successor's replacement (a chain's earlier tasks, a chord's header): the successor's
# batch, with its HEADER_STEP, HEADER_CARRIER and HEADER_PART_OF (the successor's task id, which its carrier takes).
# Such a task is not the successor: it runs freely, and its failure ends the successor (the carrier will not come).
HEADER_PART = "fanin_part"
HEADER_PART_OF = "fanin_part_of"
# On a compensation task: the task id of the work it undoes (`task.request.fanin_undo_of`), its idempotency key.
HEADER_UNDO_OF = "fanin_undo_of"

# On a `celery_fanin.chord` body's message whose header did not all succeed (or whose results are too large to
# send, or that its serializer cannot carry): "failed", "too_large" or "unencodable". Its run guard then fails the
# body with `ChordHeaderFailed` instead of running it.
HEADER_CHORD = "fanin_chord"
# Not a header: the option, in the stored successor signature of a chord's batch, that makes the relay send the
# header's results as a list (the body's first argument) instead of the outcome; removed before publishing.
CHORD_OPTION = "fanin_chord"

# Not a header: the key, in a protocol-2 body's embed (its third part), of the fan-in claim. Celery's message signing
# covers the body and not the headers, so the claim binds the fan-in headers to the signed body (see `claim`).
BODY_CLAIM = "fanin_claim"
# The dispatch uid of the worker hooks' before_task_publish receiver, which puts the claim into Celery's messages.
CLAIM_RECEIVER = "celery_fanin.claim"
# What a claim holds: the message's task id and task name, every fan-in header it carries, and the headers that can
# end a child without its body failing (expiry, time limits, the retry count that max_retries is checked against) or
# hold it back (eta): a forger must not turn a genuine signed message into a revoked, timed-out or failed child.
CLAIMED = (
    "id",
    "task",
    "eta",
    "expires",
    "timelimit",
    "retries",
    HEADER_BATCH,
    HEADER_INDEX,
    HEADER_CHAIN,
    HEADER_TASK,
    HEADER_SUCCESSOR,
    HEADER_STEP,
    HEADER_CARRIER,
    HEADER_CHORD,
    HEADER_PART,
    HEADER_PART_OF,
)

# The library's own tasks (`celery_fanin.builtin_tasks`). Messages in flight and users' routes name them: never
# rename one.
RUN_GROUP_TASK = "celery_fanin.run_group"
SAGA_STEP_DONE_TASK = "celery_fanin.saga_step_done"
COMPENSATION_DONE_TASK = "celery_fanin.compensation_done"
PRUNE_TASK = "celery_fanin.prune"
# Published by the relay in place of a child it cannot publish (arguments that do not fit its task, a stored message
# it cannot decode): the worker that takes it counts the child `rejected`, as it would a message it cannot run.
UNPUBLISHABLE_TASK = "celery_fanin.unpublishable"
# A fan-in that came out of a message (a chain's next step, a link, a chord's body) or a beat entry: writes it.
RUN_CANVAS_TASK = "celery_fanin.run_canvas"
# The successor of a fan-in whose `then=` is a chain or a group: replaces itself with a chain; writes a group as a
# fan-in of its own (a next stage) whose successor is GROUP_RESULTS_TASK.
THEN_CANVAS_TASK = "celery_fanin.then_canvas"
# The successor of a group written by THEN_CANVAS_TASK: the members' values as a list, or the first failure's error.
GROUP_RESULTS_TASK = "celery_fanin.group_results"
# The subtask type a fan_in_group signature is registered under (`Signature.register_type`).
FAN_IN_GROUP_TYPE = "fan_in_group"
# ... and a `celery_fanin.chord`'s.
FAN_IN_CHORD_TYPE = "fan_in_chord"

# The NOTIFY channel a new successor's transaction signals and the relay listens on.
OUTBOX_CHANNEL = "fanin_outbox"


# The key, in the `slot` argument of a scheduled fan-in's `run_canvas` message (`fan_in_schedule`), of the time the
# message was sent (seconds since the epoch): its schedule slot, and so its batch's key, is counted from it.
SLOT_SENT_AT = "sent_at"


def stamp_slot(task: Any, body: Any) -> None:
    """Stamp the send time into a scheduled fan-in's message, in place (the publisher's `before_task_publish`,
    in beat); a message that has one keeps it, so a republished copy stays in its slot."""
    if task != RUN_CANVAS_TASK or not (isinstance(body, (tuple, list)) and len(body) == 3):
        return
    kwargs = body[1]
    slot = kwargs.get("slot") if isinstance(kwargs, dict) else None
    if isinstance(slot, dict) and SLOT_SENT_AT not in slot:
        slot[SLOT_SENT_AT] = time.time()


def request_header(request: Any, name: str, default: Any = None) -> Any:
    """A header of the running task's message. A worker lifts custom headers onto the request as attributes;
    under `task_always_eager` Celery leaves them in ``request.headers``. The attribute wins when both are set."""
    value = getattr(request, name, None)
    if value is None:
        value = (getattr(request, "headers", None) or {}).get(name)
    return default if value is None else value


def claim(headers: Any) -> dict[str, str] | None:
    """The fan-in claim of a message with these headers (a mapping, or a worker's request with them as attributes),
    or None for a message without fan-in headers.

    The publisher puts it into the body, which `task_serializer = "auth"` signs; the worker computes it again from
    the headers it received and refuses the message if the two differ. A replayed signed body under another task id,
    task name, batch, index or successor is thereby refused. Values are compared as text (a broker may turn an int
    header into another integer type).
    """
    get = headers.get if hasattr(headers, "get") else (lambda k, d=None: getattr(headers, k, d))
    if not (get(HEADER_BATCH, None) or get(HEADER_SUCCESSOR, None) or get(HEADER_PART, None)):
        return None
    return {key: str(value) for key in CLAIMED if (value := get(key, None)) is not None}


def body_claim(body: Any) -> Any:
    """The claim a protocol-2 body (args, kwargs, embed) carries, or None."""
    if isinstance(body, (tuple, list)) and len(body) == 3 and isinstance(body[2], dict):
        return body[2].get(BODY_CLAIM)
    return None


def put_claim(body: Any, headers: Any) -> None:
    """Put the claim of `headers` into `body`'s embed, in place (a protocol-2 body; anything else is left alone)."""
    if isinstance(body, (tuple, list)) and len(body) == 3 and isinstance(body[2], dict):
        found = claim(headers)
        if found is not None:
            body[2][BODY_CLAIM] = found


class Marker:
    """The fan-in headers of one task message: a child (batch + index), a successor (batch + step), or a part of a
    successor's replacement (batch + step + `part_of`: a task that is not the successor, whose failure ends it)."""

    __slots__ = ("batch_id", "index", "step", "chain", "task_name", "carrier", "part_of", "stands_for")

    def __init__(
        self,
        batch_id: str,
        index: int | None,
        step: str | None,
        chain: str | None = None,
        task_name: str | None = None,
        carrier: str | None = None,
        part_of: str | None = None,
        stands_for: str | None = None,
    ) -> None:
        self.batch_id = batch_id
        self.index = index
        self.step = step
        self.chain = chain  # a chain child's task id (its last task's), on each of the chain's tasks
        # The task the child was published as, which its report claims (None: unknown, a chain from before
        # HEADER_TASK existed): the message's own task name, or HEADER_TASK on a chain's tasks and replacements.
        self.task_name = task_name
        self.carrier = carrier  # a successor's replacement: the token its run guard admits (HEADER_CARRIER)
        self.part_of = part_of  # a part of a successor's replacement: the successor's task id (HEADER_PART_OF)
        # A replacement's carrier whose own task id was frozen before (not the replaced one's): the successor's task
        # id, under which its run guard admits it, or the child's, which it reports for (HEADER_PART_OF).
        self.stands_for = stands_for

    def child_id(self, task_id: str) -> str:
        """The task id of the child this message reports for: its own, its chain's, or the one its replacement's
        carrier stands for."""
        return self.chain or self.stands_for or task_id

    def successor_id(self, task_id: str) -> str:
        """The task id of the successor this message speaks of: its own, or the one its carrier stands for."""
        return self.stands_for or self.part_of or task_id

    @property
    def is_successor(self) -> bool:
        """A successor's message, or a part of its replacement (`is_part`): either speaks of the successor."""
        return self.step is not None

    @property
    def is_part(self) -> bool:
        """A task of a successor's replacement other than its carrier: never admitted as a run of the successor;
        its failure (after retries) ends the successor `failed`, as long as the carrier has not started."""
        return self.part_of is not None

    def headers(self) -> dict[str, Any]:
        """The message headers that carry this marker (what a replacement's carrier must be given)."""
        if self.is_part:
            return {
                HEADER_PART: self.batch_id,
                HEADER_STEP: self.step,
                HEADER_CARRIER: self.carrier,
                HEADER_PART_OF: self.part_of,
            }
        if self.is_successor:
            own: dict[str, Any] = {HEADER_SUCCESSOR: self.batch_id, HEADER_STEP: self.step}
            if self.stands_for is not None:
                own[HEADER_PART_OF] = self.stands_for
            return own
        headers: dict[str, Any] = {HEADER_BATCH: self.batch_id, HEADER_INDEX: self.index}
        if self.task_name is not None:
            headers[HEADER_TASK] = self.task_name  # a replacement reports as the task it replaced
        if self.chain is not None:
            headers[HEADER_CHAIN] = self.chain  # a chain child's task replaced: it still reports for the chain
        if self.stands_for is not None:
            headers[HEADER_PART_OF] = self.stands_for  # a carrier with its own task id, replaced in turn
        return headers

    def part_headers(self, task_id: str, carrier: str | None) -> dict[str, Any]:
        """The headers of the other tasks (not its carrier) of a replacement of the task `task_id`: for a child,
        each reports for the child as a chain's earlier task does (HEADER_CHAIN); for a successor, whose carrier
        comes with the token `carrier`, each is a part whose failure ends it; a part's parts are parts too."""
        if self.is_part:
            return self.headers()
        if self.is_successor:
            return {
                HEADER_PART: self.batch_id,
                HEADER_STEP: self.step,
                HEADER_CARRIER: carrier,
                HEADER_PART_OF: task_id,
            }
        own = {key: value for key, value in self.headers().items() if key != HEADER_PART_OF}
        return {**own, HEADER_CHAIN: self.chain or task_id}

    @classmethod
    def from_mapping(cls, data: Any) -> Marker | None:
        if not data:
            return None
        get = data.get if hasattr(data, "get") else (lambda k, d=None: getattr(data, k, d))
        successor = get(HEADER_SUCCESSOR, None)
        if successor:
            carrier = get(HEADER_CARRIER, None)
            stands_for = get(HEADER_PART_OF, None)
            return cls(
                str(successor),
                None,
                str(get(HEADER_STEP, "")),
                carrier=str(carrier) if carrier else None,
                stands_for=str(stands_for) if stands_for else None,
            )
        batch_id = get(HEADER_BATCH, None)
        if batch_id:
            index = get(HEADER_INDEX, None)
            chain = get(HEADER_CHAIN, None)
            stands_for = get(HEADER_PART_OF, None)
            named = get(HEADER_TASK, None) or (None if chain else get("task", None))
            return cls(
                str(batch_id),
                int(index) if index is not None else None,
                None,
                str(chain) if chain else None,
                named if isinstance(named, str) else None,
                stands_for=str(stands_for) if stands_for else None,
            )
        part = get(HEADER_PART, None)
        part_of = get(HEADER_PART_OF, None)
        carrier = get(HEADER_CARRIER, None)
        if part and part_of and carrier:
            return cls(str(part), None, str(get(HEADER_STEP, "")), carrier=str(carrier), part_of=str(part_of))
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


class SagaStepState(State):
    """A saga's step: run (`pending` to `succeeded` or `failed`), then, in a rollback, what became of its undo."""

    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    SKIPPED = "skipped"  # after the failed step: never run
    NOTHING_TO_UNDO = "nothing_to_undo"  # succeeded, with no compensation declared
    COMPENSATING = "compensating"
    COMPENSATED = "compensated"
    COMPENSATION_FAILED = "compensation_failed"
    MANUAL_ACTION_REQUIRED = "manual_action_required"
    ACKNOWLEDGED = "acknowledged"  # an operator acked its manual undo


class CompensationState(State):
    """A compensation (an undo task, or a manual undo an operator acknowledges)."""

    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    MANUAL_ACTION_REQUIRED = "manual_action_required"
    ACKNOWLEDGED = "acknowledged"


class OutcomePayload(TypedDict):
    """What a successor gets as its first argument (a chord's body: the results instead), built when it is
    published (`store.outcomes.build_outcome`) and read back by `BatchOutcome.from_message`: plain JSON."""

    batch_id: str
    step: str
    # complete | partial (deadline passed with on_deadline="proceed", or cancelled --proceed) | failed_threshold |
    # expired | cancelled
    state: str
    partial: bool
    planned: int
    succeeded: int
    failed: int
    abandoned: int
    unfinished: int
    # The failed children in child order (index, task_id, task_name, state, exc_type, exc_message, attempts, and
    # their arguments when JSON), cut at fanin_outcome_failures_limit entries and fanin_outcome_max_bytes.
    failures: list[dict[str, Any]]
    failures_truncated: bool
    failures_truncated_by: str | None  # "count" or "bytes": which budget cut the list short
    # 1, or the number of a retry round (`celery -A proj fanin retry-failed`) and the batch of round 1
    round: int
    retry_of: str | None


class SuccessorKind(State):
    """Which stored signature a successor runs: `then`, or instead of it `on_expire` (a deadline abandoned the
    batch) or `on_failure` (failures passed `max_failures`)."""

    THEN = "then"
    ON_EXPIRE = "on_expire"
    ON_FAILURE = "on_failure"


class OnLost(State):
    """What happens to a child past its `child_timeout`: counted `lost`, or published again (`max_redrives`)."""

    FAIL = "fail"
    REDRIVE = "redrive"


class OnDeadline(State):
    """What a passed deadline does: run the successor with what arrived, or end the batch `expired`."""

    PROCEED = "proceed"
    ABANDON = "abandon"


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
