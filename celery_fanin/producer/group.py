"""`fan_in_group`: the plan of a fan-in, validated, and `apply_async`, which writes it and publishes its children.

``fan_in_group(children, then=successor).apply_async()`` validates and encodes everything first, then writes the
batch, its planned count and every child in one transaction, and only then publishes the children itself (the
fast path). A producer that dies after the commit loses nothing: the relay publishes what it did not.
"""

from __future__ import annotations

import logging
import math
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

from celery import Celery, current_app, current_task
from celery.canvas import Signature
from celery.utils import uuid as new_task_id
from kombu.exceptions import EncodeError

from ..broker import publish
from ..codec import encode_signature
from ..context import FanIn
from ..exceptions import FanInDepthExceeded, InvalidFanIn
from ..protocol import HEADER_BATCH, HEADER_SUCCESSOR, RUN_GROUP_TASK, request_header
from ..relay.outbox import publish_outbox
from ..store import batches, queries
from . import eager, write
from .result import FanInResult, parse_batch_id
from .task_ids import random_ids

logger = logging.getLogger("celery_fanin.canvas")

MAX_STEP_LENGTH = 200


def _check_plain_signature(value: object, what: str) -> Signature:
    """Only plain task signatures: a group, chain, chord, chunks or map publishes other task ids than the one
    the batch records, so its outcome would never be counted."""
    if not isinstance(value, Signature):
        raise InvalidFanIn(f"{what} is not a task signature (got {type(value).__name__}); use task.s(...)")
    if type(value) is not Signature:  # group, chain, chord, chunks, xmap, xstarmap are all subclasses
        kind = value.get("subtask_type") or type(value).__name__.lstrip("_")
        raise InvalidFanIn(f"{what} is a {kind}; fan_in_group takes plain task signatures (task.s(...))")
    return value


class _MessageTimes:
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
            return _aware(value)
        if isinstance(value, str):
            try:
                return _aware(datetime.fromisoformat(value))
            except ValueError:
                raise InvalidFanIn(f"{what} {value!r} is not an ISO 8601 date and time") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise InvalidFanIn(f"{what} must be a number of seconds or a datetime, not {value!r}")
        return self.now + timedelta(seconds=value)


def _check_chain(value: Signature, what: str) -> Signature:
    """A chain child holds task signatures only (nested chains are flattened); returns its last task.

    Why: the child is counted when the chain's last task ends; a group or chord inside the chain publishes task
    ids the chain's headers do not reach, and a chain ending in one has no single last task."""
    tasks = publish.chain_tasks(value)
    if not tasks:
        raise InvalidFanIn(f"{what} is an empty chain")
    for i, task in enumerate(tasks):
        if isinstance(task, Signature) and type(task) is not Signature:
            kind = task.get("subtask_type") or type(task).__name__.lstrip("_")
            raise InvalidFanIn(f"{what}: task {i} of the chain is a {kind}; a chain child may hold only task "
                               "signatures (task.s(...))")  # fmt: skip
        _check_plain_signature(task, f"{what}: task {i} of the chain")
    return tasks[-1]


@dataclass(frozen=True)
class Policy:
    """A batch's recovery settings, validated: what happens to lost children, at the deadline, on failures."""

    child_timeout: timedelta | None = None
    on_lost: str = "fail"
    max_redrives: int = 3
    deadline: timedelta | datetime | None = None
    on_deadline: str = "proceed"
    on_expire: Signature | None = None
    max_failures: int | float | None = None
    on_failure: Signature | None = None

    def validate(self) -> None:
        if self.child_timeout is not None and (
            not isinstance(self.child_timeout, timedelta) or self.child_timeout <= timedelta(0)
        ):
            raise InvalidFanIn("child_timeout must be a positive timedelta or number of seconds (0 or None: none)")
        if self.on_lost not in ("fail", "redrive"):
            raise InvalidFanIn(f"on_lost must be 'fail' or 'redrive', not {self.on_lost!r}")
        if (
            not isinstance(self.max_redrives, int)
            or isinstance(self.max_redrives, bool)
            or not 0 <= self.max_redrives <= _MAX_INT
        ):
            raise InvalidFanIn(
                f"max_redrives must be a whole number >= 0 (at most {_MAX_INT}), not {self.max_redrives!r}"
            )
        if self.child_timeout is not None and self.child_timeout.total_seconds() > _MAX_SECONDS:
            raise InvalidFanIn(f"child_timeout must be at most {_MAX_SECONDS:.0f} seconds")
        if self.deadline is not None:
            if isinstance(self.deadline, timedelta):
                if self.deadline <= timedelta(0) or self.deadline.total_seconds() > _MAX_SECONDS:
                    raise InvalidFanIn(
                        f"deadline must be a positive timedelta of at most {_MAX_SECONDS:.0f} seconds, or a datetime"
                        " in the future"
                    )
            elif isinstance(self.deadline, datetime):
                if _aware(self.deadline) <= datetime.now(timezone.utc):
                    raise InvalidFanIn(f"deadline {self.deadline.isoformat()} is in the past")
            else:
                raise InvalidFanIn(f"deadline must be a timedelta or a datetime, not {type(self.deadline).__name__}")
        if self.on_deadline not in ("proceed", "abandon"):
            raise InvalidFanIn(f"on_deadline must be 'proceed' or 'abandon', not {self.on_deadline!r}")
        if self.on_expire is not None:
            _check_plain_signature(self.on_expire, "on_expire")
            if self.deadline is None or self.on_deadline != "abandon":
                raise InvalidFanIn("on_expire runs when a deadline abandons the batch: it needs deadline= and "
                                   "on_deadline='abandon'")  # fmt: skip
        mf = self.max_failures
        if mf is not None:
            if isinstance(mf, bool) or not isinstance(mf, (int, float)):
                raise InvalidFanIn(f"max_failures must be a count (int >= 0) or a ratio (0 < float < 1), not {mf!r}")
            if isinstance(mf, int) and not 0 <= mf <= _MAX_INT:
                raise InvalidFanIn(f"max_failures must be >= 0 and at most {_MAX_INT}, not {mf}")
            if isinstance(mf, float) and not 0 < mf < 1:
                raise InvalidFanIn(f"a max_failures ratio must be between 0 and 1 (exclusive), not {mf}")
        if self.on_failure is not None:
            _check_plain_signature(self.on_failure, "on_failure")
            if mf is None:
                raise InvalidFanIn("on_failure runs when failures pass max_failures: it needs max_failures=")

    def deadline_at(self) -> datetime | None:
        if self.deadline is None:
            return None
        if isinstance(self.deadline, timedelta):
            return datetime.now(timezone.utc) + self.deadline
        return _aware(self.deadline)

    def failure_threshold(self, planned: int) -> int | None:
        """The count of failures the batch tolerates; one more finishes it early."""
        if self.max_failures is None:
            return None
        if isinstance(self.max_failures, float):
            return math.floor(self.max_failures * planned)
        return self.max_failures


def _aware(value: datetime) -> datetime:
    """Naive datetimes are taken as UTC, as Celery's own eta and expires are by default."""
    return value if value.tzinfo is not None else value.replace(tzinfo=timezone.utc)


def _as_timedelta(value: timedelta | float | int | None, what: str) -> timedelta | None:
    if value is None or isinstance(value, timedelta):
        return value if value else None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidFanIn(f"{what} must be a timedelta or a number of seconds, not {value!r}")
    if value < 0:
        raise InvalidFanIn(f"{what} must not be negative")
    if not math.isfinite(value) or value > _MAX_SECONDS:
        raise InvalidFanIn(f"{what} must be a finite number of seconds, at most {_MAX_SECONDS:.0f}, not {value!r}")
    return timedelta(seconds=value) if value else None


# What the store's columns hold: counts are PostgreSQL integers, durations and times must stay representable.
_MAX_INT = 2**31 - 1
_MAX_SECONDS = 100 * 365 * 24 * 3600.0  # a century: beyond it a timeout or deadline is a mistake


def _check_text(value: str, what: str) -> None:
    if "\x00" in value:
        raise InvalidFanIn(f"{what} must not contain NUL characters")


_DEFAULT = object()


class FanInGroup:
    """A group of children and the one successor that runs after every child has reached a terminal outcome."""

    def __init__(
        self,
        children: Iterable[Signature],
        then: Signature | None = None,
        step: str | None = None,
        app: Celery | None = None,
        *,
        child_timeout: Any = _DEFAULT,
        on_lost: str | None = None,
        max_redrives: int | None = None,
        deadline: timedelta | datetime | None = None,
        on_deadline: str = "proceed",
        on_expire: Signature | None = None,
        max_failures: int | float | None = None,
        on_failure: Signature | None = None,
        key: str | None = None,
        max_width: int | None = None,
    ) -> None:
        self.children = children
        self.then = then
        self.step = step
        self._app = app
        self.key = key
        self.max_width = max_width
        # Set by `celery_fanin.run_group` for a nested batch: the outer child its successor completes.
        self.parent_task_id: str | None = None
        # Set by `celery_fanin.ops.rounds` for a retry round: its number, and the batch of round 1 it retries.
        self.round = 1
        self.retry_of: uuid.UUID | None = None
        self.options: dict[str, Any] = {
            "child_timeout": child_timeout, "on_lost": on_lost, "max_redrives": max_redrives,
            "deadline": deadline, "on_deadline": on_deadline, "on_expire": on_expire,
            "max_failures": max_failures, "on_failure": on_failure,
        }  # fmt: skip

    # The options a nested group may carry, all JSON-able once durations are in seconds.
    _NESTED_OPTIONS = ("child_timeout", "on_lost", "max_redrives", "deadline", "on_deadline", "on_expire",
                       "max_failures", "on_failure", "max_width")  # fmt: skip

    def to_spec(self, what: str) -> dict[str, Any]:
        """The group as plain data, to travel nested in a message: its children must be a list."""
        children = self.children
        if not isinstance(children, (list, tuple)):
            raise InvalidFanIn(f"{what}: a nested fan_in_group needs a list of children, not a generator")
        if self.then is None:
            raise InvalidFanIn(f"{what}: a nested fan_in_group needs then=")
        items: list[Any] = []
        for i, child in enumerate(children):
            if isinstance(child, FanInGroup):
                items.append({"group": child.to_spec(f"{what}, child {i}")})
            elif isinstance(child, Signature):
                items.append({"sig": dict(child)})
            else:
                raise InvalidFanIn(f"{what}, child {i} is not a task signature (got {type(child).__name__})")
        then = self.then
        options: dict[str, Any] = {}
        for name in self._NESTED_OPTIONS:
            value = self.options.get(name) if name != "max_width" else self.max_width
            if value is None or (name == "child_timeout" and value is _DEFAULT):
                continue
            if isinstance(value, timedelta):
                value = value.total_seconds()
            if isinstance(value, Signature):
                value = {"sig": dict(value)}
            options[name] = value
        if "deadline" in options and not isinstance(options["deadline"], (int, float)):
            raise InvalidFanIn(f"{what}: a nested fan_in_group's deadline must be relative (a timedelta)")
        spec: dict[str, Any] = {
            "children": items,
            "then": {"group": then.to_spec(f"{what}, then")} if isinstance(then, FanInGroup) else {"sig": dict(then)},
            "step": self.step,
        }
        if options:
            spec["options"] = options
        return spec

    @classmethod
    def from_spec(cls, app: Celery, spec: dict[str, Any]) -> FanInGroup:
        """The group `to_spec` described."""

        def item(data: dict[str, Any]) -> Any:
            if "group" in data:
                return cls.from_spec(app, data["group"])
            return app.signature(data["sig"])

        options = dict(spec.get("options") or {})
        for name in ("on_expire", "on_failure"):
            if isinstance(options.get(name), dict):
                options[name] = app.signature(options[name]["sig"])
        if "deadline" in options:
            options["deadline"] = timedelta(seconds=options["deadline"])
        max_width = options.pop("max_width", None)
        return cls(
            [item(c) for c in spec["children"]], then=item(spec["then"]), step=spec.get("step"), app=app,
            max_width=max_width, **options,
        )  # fmt: skip

    def as_signature(self, app: Celery, what: str) -> Signature:
        """The message that stands for this group nested in another: `celery_fanin.run_group(spec)`."""
        return app.signature(RUN_GROUP_TASK, args=(self.to_spec(what),))

    def _policy(self, fanin: FanIn) -> Policy:
        settings = fanin.settings
        opts = self.options
        timeout = settings.child_timeout if opts["child_timeout"] is _DEFAULT else opts["child_timeout"]
        policy = Policy(
            child_timeout=_as_timedelta(timeout, "child_timeout"),
            on_lost=opts["on_lost"] if opts["on_lost"] is not None else settings.on_lost,
            max_redrives=opts["max_redrives"] if opts["max_redrives"] is not None else settings.max_redrives,
            deadline=opts["deadline"],
            on_deadline=opts["on_deadline"],
            on_expire=opts["on_expire"],
            max_failures=opts["max_failures"],
            on_failure=opts["on_failure"],
        )
        policy.validate()
        return policy

    @property
    def app(self) -> Celery:
        """The app given, else the one the successor (or a listed child) was made with, else Celery's current."""
        if self._app is not None:
            return self._app
        if isinstance(self.then, Signature) and self.then._app is not None:
            return self.then._app
        if isinstance(self.then, FanInGroup):
            return self.then.app
        if isinstance(self.children, (list, tuple)):
            for child in self.children:
                if isinstance(child, Signature) and child._app is not None:
                    return child._app
        return current_app

    def _validate_head(self) -> tuple[Signature, str]:
        if self.then is None:
            raise InvalidFanIn("fan_in_group needs then=: the signature of the successor to run after the children")
        if isinstance(self.then, FanInGroup):  # a pipeline: the next stage starts when this batch finishes
            then = self.then.as_signature(self.app, "then")
            step = self.step or "then"
        else:
            then = _check_plain_signature(self.then, "then")
            step = then.task if self.step is None else self.step
        if not isinstance(step, str) or not step.strip():
            raise InvalidFanIn("step must be a non-empty string")
        if len(step) > MAX_STEP_LENGTH:
            raise InvalidFanIn(f"step is {len(step)} characters long; at most {MAX_STEP_LENGTH} are allowed")
        _check_text(step, "step")
        if isinstance(self.children, (Signature, str, bytes)) or not isinstance(self.children, Iterable):
            raise InvalidFanIn("children must be an iterable of task signatures")
        if self.key is not None and (not isinstance(self.key, str) or not self.key or len(self.key) > 500):
            raise InvalidFanIn("key must be a non-empty string of at most 500 characters")
        if self.key is not None:
            _check_text(self.key, "key")
        if self.max_width is not None and (
            not isinstance(self.max_width, int) or isinstance(self.max_width, bool) or self.max_width < 1
        ):
            raise InvalidFanIn(f"max_width must be a whole number >= 1, not {self.max_width!r}")
        return then, step

    def apply_async(self) -> FanInResult:
        """Record the batch, then publish the children; returns at once with the handle.

        A list of children is validated and encoded whole before anything is written. Any other iterable is
        consumed in chunks (see `celery_fanin.producer`): if it raises (or yields a bad child, which raises with
        its index), the error propagates; with a `key` the batch stays open with the children written so far, for
        a rerun with the same key to resume, and without one the batch is cancelled (nothing could resume it).
        """
        app = self.app
        fanin = FanIn.of(app)
        then, step = self._validate_head()
        policy = self._policy(fanin)
        depth, lineage = lineage_of_current_task(fanin)
        if depth > fanin.settings.max_depth:
            raise FanInDepthExceeded(
                f"this fan-in would be at depth {depth}, past fanin_max_depth={fanin.settings.max_depth} "
                f"(created from batch {lineage}); nothing was written or published"
            )
        root = batches.NewBatch(
            id=uuid.uuid4(),
            step=step,
            successor_task_id=then.options.get("task_id") or new_task_id(),
            successor_name=then.task,
            successor_message=_encode(app, then, "then"),
            child_timeout=policy.child_timeout,
            on_lost=policy.on_lost,
            max_redrives=policy.max_redrives,
            deadline_at=policy.deadline_at(),
            on_deadline=policy.on_deadline,
            max_failures=policy.max_failures if isinstance(policy.max_failures, int) else None,
            on_expire=_encode(app, policy.on_expire, "on_expire") if policy.on_expire is not None else None,
            on_failure=_encode(app, policy.on_failure, "on_failure") if policy.on_failure is not None else None,
            app_name=app.main or "",
            key=self.key,
            depth=depth,
            lineage=lineage,
            parent_task_id=self.parent_task_id,
            round=self.round,
            retry_of=self.retry_of,
        )

        serializer = app.conf.task_serializer  # read once: the configuration's lookup costs a child's JSON
        ids = random_ids()
        message_times = _MessageTimes(app)

        def encode(index: int, item: Any) -> tuple[batches.NewChild, Signature]:
            if isinstance(item, FanInGroup):  # a nested fan-in: counted when its own successor finishes
                sig = item.as_signature(app, f"child {index}")
            elif publish.is_chain(item):  # counted when its last task ends (or any task fails)
                tail = _check_chain(item, f"child {index}")
                task_id = item.options.get("task_id") or tail.options.get("task_id") or next(ids)
                first = publish.chain_tasks(item)[0]  # its message is the one published now, with the chain's options
                expires_at, eta_at = message_times(first.task, {**first.options, **item.options}, f"child {index}")
                encoded = _encode(app, item, f"child {index}", serializer)
                return batches.NewChild(task_id, tail.task, encoded, expires_at, eta_at), item
            else:
                sig = _check_plain_signature(item, f"child {index}")
            expires_at, eta_at = message_times(sig.task, sig.options, f"child {index}")
            child = batches.NewChild(sig.options.get("task_id") or next(ids), sig.task,
                                     _encode(app, sig, f"child {index}", serializer), expires_at, eta_at)  # fmt: skip
            return child, sig

        ratio = policy.max_failures if isinstance(policy.max_failures, float) else None
        written = write.write(
            fanin, root, self.children, encode, ratio=ratio, max_width=self.max_width or fanin.settings.max_width
        )
        if app.conf.task_always_eager:  # the children ran inline as they were published; now the successor
            return eager.run_eagerly(fanin, written.batch_id)
        if written.successor_outbox_id is not None:  # an empty group: send its successor now rather than on NOTIFY
            try:
                publish_outbox(fanin, ids=[written.successor_outbox_id])
            except Exception:
                logger.warning("could not publish successor of empty batch_id=%s; the relay will", root.id,
                               exc_info=True, extra={"batch_id": str(root.id), "step": step})  # fmt: skip
        if not written.existing:
            logger.info("created batch_id=%s step=%s children=%d depth=%d", written.batch_id, step, written.created,
                        depth, extra={"batch_id": str(written.batch_id), "step": step})  # fmt: skip
        return FanInResult(app, str(written.batch_id))

    __call__ = apply_async


def lineage_of_current_task(fanin: FanIn) -> tuple[int, uuid.UUID | None]:
    """The depth and parent of a fan-in created now: inside a fan-in child or successor, one below its batch."""
    request = getattr(current_task, "request", None) if current_task else None
    if request is None or getattr(request, "called_directly", True):
        return 0, None
    parent = request_header(request, HEADER_BATCH) or request_header(request, HEADER_SUCCESSOR)
    if not parent:
        return 0, None
    parent_id = parse_batch_id(str(parent))
    with fanin.engine.connect() as conn:
        depth = queries.depth(conn, parent_id)
    return (0 if depth is None else depth + 1), parent_id


def _encode(app: Celery, sig: Signature, what: str, serializer: str | None = None) -> batches.Encoded:
    try:
        return encode_signature(app, sig, serializer)
    except EncodeError as exc:
        raise InvalidFanIn(f"{what}: its arguments cannot be encoded with the app's serializer: {exc}") from exc


def fan_in_group(
    children: Iterable[Signature],
    then: Signature | None = None,
    step: str | None = None,
    app: Celery | None = None,
    **options: Any,
) -> FanInGroup:
    """Run `children` in parallel, then `then` once with the outcome of all of them, whatever each ended in.

    `step` names the successor within the batch (default: its task name). The successor receives the outcome
    mapping as its first argument, before its own arguments, as a chord body receives the header's results.

    Recovery options (keyword only): `child_timeout` (timedelta or seconds; default `fanin_child_timeout`) with
    `on_lost` ("fail": count the child as `lost`; "redrive": re-publish it, up to `max_redrives` times);
    `deadline` (timedelta or datetime) with `on_deadline` ("proceed": run the successor with a partial outcome;
    "abandon": mark the batch expired and run `on_expire` if given); `max_failures` (a count, or a ratio of the
    children) after which the batch finishes early and `on_failure` (or the successor) runs.

    Scale options: `key` (an idempotency key, unique per app: a second call returns the existing batch, and
    resumes it if its producer died mid-stream); `max_width` (default `fanin_max_width`): above it, the batch
    becomes a tree of counters. `children` may be any iterable, consumed in chunks of `fanin_chunk_size`.
    """
    return FanInGroup(children, then=then, step=step, app=app, **options)
