"""A fan-in's plan as values: its constants, its recovery policy, and the checks each value passes before anything
is written or published (a child's signature, a chain child, a message's times, a duration, a text).

Nothing here imports the `FanInGroup` class: a nested fan-in is told by the class Celery registered for its subtask
type (`is_fan_in`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, TypeGuard

from celery import Celery
from celery.canvas import Signature

from ..broker import publish
from ..exceptions import InvalidFanIn
from ..protocol import FAN_IN_GROUP_TYPE, OnDeadline, OnLost

MAX_STEP_LENGTH = 200

# The key of a FanInGroup's dict that holds its plan (children, successor, policy); the signature's other keys mean
# what they mean for any Celery signature (`args` and `kwargs` are partial arguments for every child, as a chord
# passes its own to its header).
PLAN_KEY = "fan_in"
# The execution option that fixes the batch id (`freeze` sets it), so a re-delivered message makes one batch.
BATCH_ID_OPTION = "fanin_batch_id"
# Options that place the fan-in in a canvas (a chain's next tasks, callbacks, a group or chord it belongs to): they
# go to its successor, which takes the fan-in's place there, as a chord's body takes the chord's.
SUCCESSOR_OPTIONS = frozenset(
    {"chain", "link", "link_error", "group_id", "group_index", "chord", "root_id", "parent_id", "reply_to"}
)
# Options of the call itself, which no message carries.
CALL_OPTIONS = frozenset(
    {
        "producer",
        "publisher",
        "connection",
        "router",
        "result_cls",
        "add_to_parent",
        "retry",
        "retry_policy",
        "task_id",
        BATCH_ID_OPTION,
        "transaction",
    }
)
# The plan's names: read-only attributes (`evolve` makes a changed copy).
PLAN_NAMES = frozenset(
    {"children", "then", "step", "key", "max_width", "parent_task_id", "round", "retry_of", "policy_options"}
)


def policy_value(value: Any) -> Any:
    """A policy option as the plan keeps it: JSON-able, so the plan can travel in a message (positive durations
    in seconds). Anything else is kept as given, for `Policy.validate` to refuse with its own message."""
    return value.total_seconds() if isinstance(value, timedelta) and value > timedelta(0) else value


def is_fan_in(value: Any) -> TypeGuard[Signature]:
    """A `FanInGroup` (a `celery_fanin.chord` is one): an instance of the class Celery registered for the subtask
    type, looked up rather than imported so that this module does not import `group`. A plain `Signature` copy of
    one is not: it has none of the plan's attributes."""
    fan_in = Signature.TYPES.get(FAN_IN_GROUP_TYPE)
    return fan_in is not None and isinstance(value, fan_in)


def check_plain_signature(value: object, what: str) -> Signature:
    """Only plain task signatures: a group, chain, chord, chunks or map publishes other task ids than the one
    the batch records, so its outcome would never be counted."""
    if not isinstance(value, Signature):
        raise InvalidFanIn(f"{what} is not a task signature (got {type(value).__name__}); use task.s(...)")
    if type(value) is not Signature:  # group, chain, chord, chunks, xmap, xstarmap are all subclasses
        kind = value.get("subtask_type") or type(value).__name__.lstrip("_")
        raise InvalidFanIn(f"{what} is a {kind}; fan_in_group takes plain task signatures (task.s(...))")
    return value


class MessageTimes:
    """A child message's `expires` and `countdown`/`eta` as absolute times, for its row (see `NewChild`).

    Why: RabbitMQ drops a message whose `expires` passed unconsumed, and no worker reports it; the relay counts
    such a child from `expires_at`. A relative `expires` or `countdown` is taken from now (the batch's creation).
    """

    def __init__(self, app: Celery) -> None:
        self.app = app
        self.task_expires: dict[str, Any] = {}  # the task's own default `expires`, per task name
        self.now: datetime | None = None

    def __call__(self, name: str, options: dict[str, Any], what: str) -> tuple[datetime | None, datetime | None]:
        expires = options.get("expires")
        if expires is None:
            if name not in self.task_expires:
                task = self.app.tasks.get(name)
                self.task_expires[name] = getattr(task, "expires", None) if task is not None else None
            expires = self.task_expires[name]
        countdown, eta = options.get("countdown"), options.get("eta")
        if expires is None and countdown is None and eta is None:
            return None, None
        return self._absolute(expires, f"{what}: expires"), self._absolute(eta or countdown, f"{what}: countdown/eta")

    def _absolute(self, value: Any, what: str) -> datetime | None:
        if value is None:
            return None
        if self.now is None:
            self.now = datetime.now(timezone.utc)
        if isinstance(value, datetime):
            return aware(value)
        if isinstance(value, str):
            try:
                return aware(datetime.fromisoformat(value))
            except ValueError:
                raise InvalidFanIn(f"{what} {value!r} is not an ISO 8601 date and time") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise InvalidFanIn(f"{what} must be a number of seconds or a datetime, not {value!r}")
        return self.now + timedelta(seconds=value)


def check_chain(value: Signature, what: str) -> Signature:
    """A chain child holds task signatures only (nested chains are flattened; a nested fan-in at its end is one
    already, `nested_tail`); returns its last task.

    Why: the child is counted when the chain's last task ends; a group or chord inside the chain publishes task
    ids the chain's headers do not reach, and a chain ending in a Celery group or chord has no single last task."""
    tasks = publish.chain_tasks(value)
    if not tasks:
        raise InvalidFanIn(f"{what} is an empty chain")
    for i, task in enumerate(tasks):
        if isinstance(task, Signature) and type(task) is not Signature:
            kind = task.get("subtask_type") or type(task).__name__.lstrip("_")
            raise InvalidFanIn(
                f"{what}: task {i} of the chain is a {kind}; a chain child may hold only task signatures "
                "(task.s(...)), and end with a nested fan-in (a celery_fanin.chord or fan_in_group)"
            )
        check_plain_signature(task, f"{what}: task {i} of the chain")
    return tasks[-1]


# Tuples, not sets: a value given is compared, never hashed (an unhashable one is refused as any other).
ON_LOST = tuple(OnLost)
ON_DEADLINE = tuple(OnDeadline)


@dataclass(frozen=True)
class Policy:
    """A batch's recovery settings, validated: what happens to lost children, at the deadline, on failures."""

    child_timeout: timedelta | None = None
    on_lost: str = OnLost.FAIL
    max_redrives: int = 3
    deadline: timedelta | datetime | None = None
    on_deadline: str = OnDeadline.PROCEED
    on_expire: Signature | None = None
    max_failures: int | float | None = None
    on_failure: Signature | None = None

    def validate(self) -> None:
        if self.child_timeout is not None and (
            not isinstance(self.child_timeout, timedelta) or self.child_timeout <= timedelta(0)
        ):
            raise InvalidFanIn("child_timeout must be a positive timedelta or number of seconds (0 or None: none)")
        if self.on_lost not in ON_LOST:
            raise InvalidFanIn(f"on_lost must be 'fail' or 'redrive', not {self.on_lost!r}")
        if (
            not isinstance(self.max_redrives, int)
            or isinstance(self.max_redrives, bool)
            or not 0 <= self.max_redrives <= MAX_INT
        ):
            raise InvalidFanIn(
                f"max_redrives must be a whole number >= 0 (at most {MAX_INT}), not {self.max_redrives!r}"
            )
        if self.child_timeout is not None and self.child_timeout.total_seconds() > MAX_SECONDS:
            raise InvalidFanIn(f"child_timeout must be at most {MAX_SECONDS:.0f} seconds")
        if self.deadline is not None:
            if isinstance(self.deadline, timedelta):
                if self.deadline <= timedelta(0) or self.deadline.total_seconds() > MAX_SECONDS:
                    raise InvalidFanIn(
                        f"deadline must be a positive timedelta of at most {MAX_SECONDS:.0f} seconds, or a datetime"
                        " in the future"
                    )
            elif isinstance(self.deadline, datetime):
                if aware(self.deadline) <= datetime.now(timezone.utc):
                    raise InvalidFanIn(f"deadline {self.deadline.isoformat()} is in the past")
            else:
                raise InvalidFanIn(
                    f"deadline must be a timedelta, a number of seconds or a datetime, not {self.deadline!r}"
                )
        if self.on_deadline not in ON_DEADLINE:
            raise InvalidFanIn(f"on_deadline must be 'proceed' or 'abandon', not {self.on_deadline!r}")
        if self.on_expire is not None:
            check_plain_signature(self.on_expire, "on_expire")
            if self.deadline is None or self.on_deadline != OnDeadline.ABANDON:
                raise InvalidFanIn(
                    "on_expire runs when a deadline abandons the batch: it needs deadline= and on_deadline='abandon'"
                )
        mf = self.max_failures
        if mf is not None:
            if isinstance(mf, bool) or not isinstance(mf, (int, float)):
                raise InvalidFanIn(f"max_failures must be a count (int >= 0) or a ratio (0 < float < 1), not {mf!r}")
            if isinstance(mf, int) and not 0 <= mf <= MAX_INT:
                raise InvalidFanIn(f"max_failures must be >= 0 and at most {MAX_INT}, not {mf}")
            if isinstance(mf, float) and not 0 < mf < 1:
                raise InvalidFanIn(f"a max_failures ratio must be between 0 and 1 (exclusive), not {mf}")
        if self.on_failure is not None:
            check_plain_signature(self.on_failure, "on_failure")
            if mf is None:
                raise InvalidFanIn("on_failure runs when failures pass max_failures: it needs max_failures=")

    def deadline_at(self) -> datetime | None:
        if self.deadline is None:
            return None
        if isinstance(self.deadline, timedelta):
            return datetime.now(timezone.utc) + self.deadline
        return aware(self.deadline)


def aware(value: datetime) -> datetime:
    """Naive datetimes are taken as UTC, as Celery's own eta and expires are by default."""
    return value if value.tzinfo is not None else value.replace(tzinfo=timezone.utc)


def as_timedelta(value: timedelta | float | int | None, what: str) -> timedelta | None:
    if value is None or isinstance(value, timedelta):
        return value if value else None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidFanIn(f"{what} must be a timedelta or a number of seconds, not {value!r}")
    if value < 0:
        raise InvalidFanIn(f"{what} must not be negative")
    if not math.isfinite(value) or value > MAX_SECONDS:
        raise InvalidFanIn(f"{what} must be a finite number of seconds, at most {MAX_SECONDS:.0f}, not {value!r}")
    return timedelta(seconds=value) if value else None


def relative_seconds(value: Any) -> Any:
    """`deadline=` given in seconds from now (as `child_timeout=` and Celery's `countdown` take them), as a
    timedelta; anything else is left for `Policy.validate` to accept or refuse."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return value
    if not math.isfinite(value) or not 0 < value <= MAX_SECONDS:
        raise InvalidFanIn(f"deadline must be a positive number of seconds, at most {MAX_SECONDS:.0f}, not {value!r}")
    return timedelta(seconds=value)


# What the store's columns hold: counts are PostgreSQL integers, durations and times must stay representable.
MAX_INT = 2**31 - 1
MAX_SECONDS = 100 * 365 * 24 * 3600.0  # a century: beyond it a timeout or deadline is a mistake


def check_text(value: str, what: str) -> None:
    if "\x00" in value:
        raise InvalidFanIn(f"{what} must not contain NUL characters")
