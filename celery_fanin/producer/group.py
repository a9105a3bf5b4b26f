"""`fan_in_group`: the fan-in as a Celery signature, and `apply_async`, which writes it and publishes its children.

Its plan's values are checked in `plan`, its children encoded in `encoder`.

``fan_in_group(children, then=successor).apply_async()`` validates and encodes everything first, then writes the
batch, its planned count and every child in one transaction, and only then publishes the children itself (the
fast path). A producer that dies after the commit loses nothing: the relay publishes what it did not.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterable, Mapping
from copy import deepcopy
from datetime import datetime, timedelta
from types import MappingProxyType
from typing import Any

from celery import Celery, current_app, current_task
from celery.canvas import Signature, _chain, maybe_signature
from celery.canvas import group as _group
from celery.utils import uuid as new_task_id

from ..broker import publish
from ..context import FanIn, eagerly, is_eager
from ..dispatch.successors import publish_outbox
from ..exceptions import FanInDepthExceeded, InvalidFanIn
from ..protocol import (
    CHORD_OPTION,
    FAN_IN_GROUP_TYPE,
    HEADER_BATCH,
    HEADER_SUCCESSOR,
    RUN_CANVAS_TASK,
    RUN_GROUP_TASK,
    THEN_CANVAS_TASK,
    OnDeadline,
    request_header,
)
from ..store import batches, queries
from . import eager, write
from .encoder import Arguments, ChildEncoder, encode
from .plan import (
    BATCH_ID_OPTION,
    CALL_OPTIONS,
    MAX_STEP_LENGTH,
    PLAN_KEY,
    PLAN_NAMES,
    SUCCESSOR_OPTIONS,
    Policy,
    as_timedelta,
    check_plain_signature,
    check_text,
    policy_value,
    relative_seconds,
)
from .result import FanInResult, parse_batch_id
from .transaction import adopt

logger = logging.getLogger("celery_fanin.canvas")

_DEFAULT = object()


@Signature.register_type(name=FAN_IN_GROUP_TYPE)
class FanInGroup(Signature):  # type: ignore[misc]  # Celery's Signature is an untyped dict subclass
    """A group of children and the one successor that runs after every child has reached a terminal outcome.

    A Celery signature (subtask type ``fan_in_group``), so it composes where a chord does: in a chain, a group, a
    chord, as a link. Its plan is immutable once built (`evolve` makes a changed copy); its execution options
    change as any signature's do (`set`, `freeze`, `link`).
    """

    def __init__(
        self,
        children: Iterable[Signature] = (),
        then: Signature | None = None,
        step: str | None = None,
        app: Celery | None = None,
        *,
        child_timeout: Any = _DEFAULT,
        on_lost: str | None = None,
        max_redrives: int | None = None,
        deadline: timedelta | datetime | float | None = None,
        on_deadline: str = OnDeadline.PROCEED,
        on_expire: Signature | None = None,
        max_failures: int | float | None = None,
        on_failure: Signature | None = None,
        key: str | None = None,
        max_width: int | None = None,
        args: Iterable[Any] | None = None,
        kwargs: Mapping[str, Any] | None = None,
        options: Mapping[str, Any] | None = None,
        immutable: bool = False,
    ) -> None:
        policy: dict[str, Any] = {
            "on_lost": on_lost,
            "max_redrives": max_redrives,
            "deadline": policy_value(deadline),
            "on_deadline": on_deadline,
            "on_expire": on_expire,
            "max_failures": max_failures,
            "on_failure": on_failure,
        }
        if child_timeout is not _DEFAULT:  # absent: the app's fanin_child_timeout
            policy["child_timeout"] = policy_value(child_timeout)
        listed = isinstance(children, (list, tuple))
        plan = {
            "children": list(children) if listed else None,
            "then": then,
            "step": step,
            "key": key,
            "max_width": max_width,
            "policy": policy,
            "parent_task_id": None,
            "round": 1,
            "retry_of": None,
        }
        super().__init__(
            RUN_CANVAS_TASK,
            args=args,
            kwargs=dict(kwargs or {}),
            options=dict(options or {}),
            subtask_type=FAN_IN_GROUP_TYPE,
            immutable=immutable,
            app=app,
        )
        dict.__setitem__(self, PLAN_KEY, plan)
        object.__setattr__(self, "_source", None if listed else children)
        object.__setattr__(self, "_from_message", False)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in PLAN_NAMES:
            raise AttributeError(f"a FanInGroup is immutable once built: use .evolve({name}=...) for a changed copy")
        object.__setattr__(self, name, value)

    # --- as a signature ------------------------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], app: Celery | None = None) -> FanInGroup:
        """The fan-in a message carried (a chain's next step, a link, a chord's body): applying it sends
        `celery_fanin.run_canvas`, which writes the batch on a worker (see `apply_async`)."""
        return cls._restore(d, app, from_message=True)

    @classmethod
    def _restore(cls, d: Mapping[str, Any], app: Celery | None, from_message: bool) -> FanInGroup:
        plan = dict(d.get(PLAN_KEY) or {})
        if plan.get("children") is None:
            raise InvalidFanIn("a fan_in_group in a message needs a list of children, not a generator")
        plan["children"] = [maybe_signature(c, app=app) for c in plan["children"]]
        plan["then"] = maybe_signature(plan.get("then"), app=app)
        policy = dict(plan.get("policy") or {})
        for name in ("on_expire", "on_failure"):
            policy[name] = maybe_signature(policy.get(name), app=app)
        plan["policy"] = policy
        group = cls.__new__(cls)
        dict.__init__(group, d)
        dict.__setitem__(group, PLAN_KEY, plan)
        dict.__setitem__(group, "args", tuple(d.get("args") or ()))
        dict.__setitem__(group, "kwargs", dict(d.get("kwargs") or {}))
        dict.__setitem__(group, "options", dict(d.get("options") or {}))
        object.__setattr__(group, "_app", app)
        object.__setattr__(group, "_source", None)
        object.__setattr__(group, "_from_message", from_message)
        return group

    def clone(self, args: Any = None, kwargs: Any = None, **opts: Any) -> FanInGroup:
        """A copy, with partial `args`/`kwargs` for the children and `opts` merged as `Signature.clone` merges
        them; the plan is shared (it is never changed in place)."""
        if args or kwargs or opts:
            args, kwargs, opts = self._merge(args, kwargs, opts)
        else:
            args, kwargs, opts = self.args, self.kwargs, self.options
        group = type(self).__new__(type(self))
        dict.__init__(group, self)
        dict.__setitem__(group, PLAN_KEY, dict(self[PLAN_KEY]))
        dict.__setitem__(group, "args", tuple(args))
        dict.__setitem__(group, "kwargs", dict(kwargs))
        dict.__setitem__(group, "options", deepcopy(opts))
        for name in ("_app", "_source", "_from_message"):
            object.__setattr__(group, name, getattr(self, name))
        return group

    partial = clone

    def s(self, *args: Any, **kwargs: Any) -> FanInGroup:
        """A copy with partial arguments for every child (prepended to theirs, as a chord passes its own)."""
        return self.clone(args, kwargs)

    def si(self, *args: Any, **kwargs: Any) -> FanInGroup:
        """An immutable copy: a chain's previous result (or a callback's argument) does not reach the children."""
        group = self.clone()
        dict.__setitem__(group, "args", tuple(args) + tuple(group.args))
        dict.__setitem__(group, "kwargs", {**group.kwargs, **kwargs})
        dict.__setitem__(group, "immutable", True)
        return group

    def freeze(
        self,
        _id: str | None = None,
        group_id: str | None = None,
        chord: Any = None,
        root_id: str | None = None,
        parent_id: str | None = None,
        group_index: int | None = None,
    ) -> FanInResult:
        """Fix the successor's task id and the batch id now, before anything is written; returns the handle.

        As `Signature.freeze`: ids already set are kept, and the other arguments place the fan-in in a group or
        chord (its successor then reports where the fan-in stands)."""
        opts = self.options
        if "task_id" not in opts:
            then = self.then
            given = then.options.get("task_id") if isinstance(then, Signature) else None
            opts["task_id"] = _id or given or new_task_id()
        opts.setdefault(BATCH_ID_OPTION, str(uuid.uuid4()))
        if root_id:
            opts["root_id"] = root_id
        if parent_id:
            opts["parent_id"] = parent_id
        if "reply_to" not in opts:
            opts["reply_to"] = self.app.thread_oid
        if group_id and "group_id" not in opts:
            opts["group_id"] = group_id
        if chord:
            opts["chord"] = chord
        if group_index is not None:
            opts["group_index"] = group_index
        return FanInResult(self.app, opts[BATCH_ID_OPTION], opts["task_id"])

    _freeze = freeze

    def __call__(self, *args: Any, **kwargs: Any) -> FanInResult:
        return self.apply_async(args, kwargs)

    def __repr__(self) -> str:
        children = self.children
        count = f"{len(children)} children" if isinstance(children, (list, tuple)) else "streamed children"
        then = self.then
        name = then.get("task") if isinstance(then, Signature) else None
        return f"fan_in_group({count}, then={name})"

    # --- the plan ------------------------------------------------------------------------------------------------

    @property
    def children(self) -> Iterable[Any]:
        return self._source if self._source is not None else self[PLAN_KEY]["children"]

    @property
    def then(self) -> Signature | None:
        return self[PLAN_KEY]["then"]  # type: ignore[no-any-return]

    @property
    def step(self) -> str | None:
        return self[PLAN_KEY]["step"]  # type: ignore[no-any-return]

    @property
    def key(self) -> str | None:
        return self[PLAN_KEY]["key"]  # type: ignore[no-any-return]

    @property
    def max_width(self) -> int | None:
        return self[PLAN_KEY]["max_width"]  # type: ignore[no-any-return]

    @property
    def parent_task_id(self) -> str | None:
        """Set through `evolve` by `celery_fanin.run_group` for a nested batch: the outer child its successor
        completes."""
        return self[PLAN_KEY]["parent_task_id"]  # type: ignore[no-any-return]

    @property
    def round(self) -> int:
        """Set through `evolve` by `celery_fanin.ops.rounds` for a retry round, with `retry_of`."""
        return int(self[PLAN_KEY]["round"])

    @property
    def retry_of(self) -> uuid.UUID | None:
        value = self[PLAN_KEY]["retry_of"]
        return uuid.UUID(str(value)) if value is not None else None

    @property
    def policy_options(self) -> Mapping[str, Any]:
        """The recovery options given to `fan_in_group` (durations in seconds); absent `child_timeout`: the
        app's default."""
        return MappingProxyType(self[PLAN_KEY]["policy"])

    # What `evolve` may change (the options of `fan_in_group` are set when it is built).
    _EVOLVABLE = frozenset({"children", "then", "step", "key", "max_width", "parent_task_id", "round", "retry_of"})

    def evolve(self, **changes: Any) -> FanInGroup:
        """A copy of this plan with `changes` (children, then, step, key, max_width; and the library's own
        parent_task_id, round and retry_of); this one is left as it was. (Not `replace`: that is
        `Signature.replace`, which changes args, kwargs or options.)"""
        unknown = sorted(set(changes) - self._EVOLVABLE)
        if unknown:
            raise TypeError(f"FanInGroup.evolve() cannot change {', '.join(unknown)}")
        group = self.clone()
        plan = group[PLAN_KEY]
        for name, value in changes.items():
            if name == "children":
                listed = isinstance(value, (list, tuple))
                plan["children"] = list(value) if listed else None
                object.__setattr__(group, "_source", None if listed else value)
            elif name == "retry_of":
                plan["retry_of"] = str(value) if value is not None else None
            else:
                plan[name] = value
        return group

    def _partial_children(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Iterable[Any]:
        """The children with the fan-in's partial arguments, as a chord's header tasks get the chord's: prepended
        to each child's own (a chain child's first task's), unless the child is immutable."""
        children = self.children
        if not args and not kwargs:
            return children

        def merged(child: Any) -> Any:
            if isinstance(child, FanInGroup) or not isinstance(child, Signature):
                return child.clone(args, kwargs) if isinstance(child, FanInGroup) else child
            if publish.is_chain(child):
                chained = child.clone()
                tasks = chained.tasks
                if tasks:
                    first = maybe_signature(tasks[0], app=self._app)
                    tasks[0] = merged(first)
                return chained
            return child.clone(args, kwargs)

        if isinstance(children, (list, tuple)):
            return [merged(c) for c in children]
        return (merged(c) for c in children)

    # The options a nested group may carry, all JSON-able once durations are in seconds.
    _NESTED_OPTIONS = (
        "child_timeout",
        "on_lost",
        "max_redrives",
        "deadline",
        "on_deadline",
        "on_expire",
        "max_failures",
        "on_failure",
        "max_width",
    )

    def to_spec(self, what: str) -> dict[str, Any]:
        """The group as plain data, to travel nested in a message: its children must be a list."""
        children = self._partial_children(tuple(self.args), self.kwargs)
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
        policy = self.policy_options
        for name in self._NESTED_OPTIONS:
            value = policy.get(name) if name != "max_width" else self.max_width
            if value is None:
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
        if self.is_chord:
            spec["chord"] = True
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
        group = cls(
            [item(c) for c in spec["children"]],
            then=item(spec["then"]),
            step=spec.get("step"),
            app=app,
            max_width=max_width,
            **options,
        )
        if spec.get("chord"):
            group[PLAN_KEY]["chord"] = True
        return group

    def as_signature(self, app: Celery, what: str) -> Signature:
        """The message that stands for this group nested in another: `celery_fanin.run_group(spec)`."""
        return app.signature(RUN_GROUP_TASK, args=(self.to_spec(what),))

    def _policy(self, fanin: FanIn) -> Policy:
        settings = fanin.check_settings()  # all of them checked before anything is written
        opts = self.policy_options
        timeout = opts.get("child_timeout", settings.child_timeout)
        policy = Policy(
            child_timeout=as_timedelta(timeout, "child_timeout"),
            on_lost=opts["on_lost"] if opts["on_lost"] is not None else settings.on_lost,
            max_redrives=opts["max_redrives"] if opts["max_redrives"] is not None else settings.max_redrives,
            deadline=relative_seconds(opts["deadline"]),
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
        then = self.then
        if isinstance(then, FanInGroup):
            return then.app
        if isinstance(then, Signature) and then._app is not None:
            return then._app
        children = self.children
        if isinstance(children, (list, tuple)):
            for child in children:
                if isinstance(child, Signature) and child._app is not None:
                    return child._app
        return current_app

    def _successor(self, app: Celery) -> tuple[Signature, str]:
        """The successor's signature and step: `then` itself, a pipeline's next stage, or a chain or group run
        by `celery_fanin.then_canvas` (which replaces itself with it, so its end is the successor's)."""
        then = self.then
        if then is None:
            raise InvalidFanIn("fan_in_group needs then=: the signature of the successor to run after the children")
        if isinstance(then, FanInGroup):  # a pipeline: the next stage starts when this batch finishes
            return then.as_signature(app, "then"), self.step or "then"
        if isinstance(then, (_chain, _group)):
            kind = then.get("subtask_type") or type(then).__name__.lstrip("_")
            if isinstance(then, _chain) and not then.tasks:
                raise InvalidFanIn("then= is an empty chain")
            if isinstance(then, _group) and not then.tasks:
                raise InvalidFanIn("then= is an empty group")
            wrapped = app.signature(THEN_CANVAS_TASK, kwargs={"canvas": dict(then)})
            return wrapped, self.step or kind
        sig = check_plain_signature(then, "then")
        return sig, sig.task if self.step is None else self.step

    @property
    def is_chord(self) -> bool:
        """Made by `celery_fanin.chord`: the successor (the body) gets the header's results as a list, and does not
        run unless every child succeeded (see `producer.chord`)."""
        return bool(self[PLAN_KEY].get("chord"))

    def _chord_successor(self, app: Celery, then: Signature) -> Signature:
        """A chord's body, checked and marked for the relay (`CHORD_OPTION`: send the results, not the outcome)."""
        if isinstance(self.then, FanInGroup) and not self.then.is_chord:
            raise InvalidFanIn(
                "a chord's body is a task, a chain, a group or a chord; for a fan-in after a fan-in use "
                "fan_in_group(children, then=fan_in_group(...))"
            )
        children = self.children
        if not isinstance(children, (list, tuple)):
            raise InvalidFanIn("a chord's header must be a list of signatures (its body gets one result for each)")
        limit = FanIn.of(app).settings.chord_max_header
        if len(children) > limit:
            raise InvalidFanIn(
                f"this chord's header has {len(children)} tasks, more than fanin_chord_max_header={limit}: a chord's "
                "body gets every result in one message. Use fan_in_group(children, then=...): its successor streams "
                "the results from PostgreSQL (BatchOutcome.values()) whatever their number"
            )
        marked = then.clone()
        marked.options[CHORD_OPTION] = True
        return marked

    def _validate_head(self, app: Celery) -> tuple[Signature, str]:
        then, step = self._successor(app)
        if self.is_chord:
            then = self._chord_successor(app, then)
        if not isinstance(step, str) or not step.strip():
            raise InvalidFanIn("step must be a non-empty string")
        if len(step) > MAX_STEP_LENGTH:
            raise InvalidFanIn(f"step is {len(step)} characters long; at most {MAX_STEP_LENGTH} are allowed")
        check_text(step, "step")
        children = self.children
        if isinstance(children, (Signature, str, bytes)) or not isinstance(children, Iterable):
            raise InvalidFanIn("children must be an iterable of task signatures")
        if self.key is not None and (not isinstance(self.key, str) or not self.key or len(self.key) > 500):
            raise InvalidFanIn("key must be a non-empty string of at most 500 characters")
        if self.key is not None:
            check_text(self.key, "key")
        if self.max_width is not None and (
            not isinstance(self.max_width, int) or isinstance(self.max_width, bool) or self.max_width < 1
        ):
            raise InvalidFanIn(f"max_width must be a whole number >= 1, not {self.max_width!r}")
        return then, step

    # --- running it ----------------------------------------------------------------------------------------------

    def apply_async(self, args: Any = None, kwargs: Any = None, **options: Any) -> FanInResult:
        """Record the batch, then publish the children; returns at once with the handle.

        `args`/`kwargs` are partial arguments for every child and `options` are merged as for any signature:
        those that place the fan-in in a canvas (`chain`, `link`, `link_error`, `group_id`, `chord`, ...) go to
        its successor; message options (`queue`, `priority`, `countdown`, ...) to the children and the
        successor, under their own. A `task_id` is the successor's; a frozen batch id is the batch's, and makes
        a second call with it return the first batch.

        A fan-in that came out of a message (a chain's next step, a link, a chord's body, applied by a worker)
        is not written in the worker's trace: it is sent as `celery_fanin.run_canvas`, which writes it.

        `transaction=` (a SQLAlchemy `Session` or `Connection`, or a Django connection in `atomic()`) writes the
        batch in the caller's own transaction on the same database, and publishes its children only after that
        commits (see `celery_fanin.producer.transaction`).

        A list of children is validated and encoded whole before anything is written. Any other iterable is
        consumed in chunks (see `celery_fanin.producer`): if it raises (or yields a bad child, which raises with
        its index), the error propagates; with a `key` the batch stays open with the children written so far, for
        a rerun with the same key to resume, and without one the batch is cancelled (nothing could resume it).
        """
        transaction = options.pop("transaction", None)
        options = {k: v for k, v in options.items() if v is not None}
        args, kwargs, options = self._merge(tuple(args or ()), dict(kwargs or {}), options)
        if self._from_message:
            return self._send_to_worker(tuple(args), dict(kwargs), dict(options))
        return self._write(tuple(args), dict(kwargs), dict(options), transaction)

    def delay(self, *args: Any, **kwargs: Any) -> FanInResult:
        return self.apply_async(args, kwargs)

    def apply(self, args: Any = None, kwargs: Any = None, **options: Any) -> FanInResult:
        """Run the fan-in eagerly, in this process, as `task_always_eager` would.

        Eager for this call only (`context.eagerly`): `app.conf` is not changed, so other threads' fan-ins and
        tasks still go to the broker, and nothing is left switched on when the call returns or raises.
        """
        with eagerly():
            options = {k: v for k, v in options.items() if v is not None}
            args, kwargs, options = self._merge(tuple(args or ()), dict(kwargs or {}), options)
            return self._write(tuple(args), dict(kwargs), dict(options))

    def _send_to_worker(self, args: tuple[Any, ...], kwargs: dict[str, Any], options: dict[str, Any]) -> FanInResult:
        """Send this fan-in as `celery_fanin.run_canvas`, with its batch id fixed: a worker writes it, and a
        re-delivered message writes the same batch."""
        app = self.app
        batch_id = str(options.setdefault(BATCH_ID_OPTION, str(uuid.uuid4())))
        then = self.then
        given = then.options.get("task_id") if isinstance(then, Signature) else None
        successor_id = str(options.setdefault("task_id", given or new_task_id()))
        canvas = self.clone()
        dict.__setitem__(canvas, "args", args)
        dict.__setitem__(canvas, "kwargs", kwargs)
        dict.__setitem__(canvas, "immutable", True)  # its arguments are merged already
        dict.__setitem__(
            canvas, "options", {k: v for k, v in options.items() if k not in CALL_OPTIONS or k in _KEPT_IDS}
        )
        app.send_task(
            RUN_CANVAS_TASK,
            kwargs={"canvas": dict(canvas)},
            task_id=str(uuid.uuid5(_RUN_CANVAS_IDS, batch_id)),
            parent_id=options.get("parent_id"),
            root_id=options.get("root_id"),
            priority=options.get("priority"),
            ignore_result=True,
        )
        return FanInResult(app, batch_id, successor_id)

    def _write(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], options: dict[str, Any], transaction: Any = None
    ) -> FanInResult:
        app = self.app
        fanin = FanIn.of(app)
        then, step = self._validate_head(app)
        tx = None
        if transaction is not None:
            if is_eager(app):
                raise InvalidFanIn("transaction= cannot be used with task_always_eager: the children would run first")
            tx = adopt(fanin, transaction)
        policy = self._policy(fanin)
        arguments = Arguments(app)
        arguments.successor(self.then, "then", of_chord=self.is_chord)
        for name in ("on_failure", "on_expire"):
            if getattr(policy, name) is not None:
                arguments.successor(getattr(policy, name), name)
        depth, lineage = lineage_of_current_task(fanin)
        if depth > fanin.settings.max_depth:
            raise FanInDepthExceeded(
                f"this fan-in would be at depth {depth}, past fanin_max_depth={fanin.settings.max_depth} "
                f"(created from batch {lineage}); nothing was written or published"
            )
        frozen = options.get(BATCH_ID_OPTION)
        batch_id = parse_batch_id(frozen) if frozen else uuid.uuid4()
        key = self.key
        if key is None and frozen:
            key = f"frozen:{batch_id}"  # a second call with the frozen id (a re-delivery) finds the first batch
        message = {k: v for k, v in options.items() if k not in CALL_OPTIONS and k not in SUCCESSOR_OPTIONS}
        placed = {k: v for k, v in options.items() if k in SUCCESSOR_OPTIONS}
        successor_id = options.get("task_id") or then.options.get("task_id") or new_task_id()
        if message or placed:
            then = then.clone()
            then.options.update({**message, **then.options, **placed})
        root = batches.NewBatch(
            id=batch_id,
            step=step,
            successor_task_id=str(successor_id),
            successor_name=then.task,
            successor_message=encode(app, then, "then"),
            child_timeout=policy.child_timeout,
            on_lost=policy.on_lost,
            max_redrives=policy.max_redrives,
            deadline_at=policy.deadline_at(),
            on_deadline=policy.on_deadline,
            max_failures=policy.max_failures if isinstance(policy.max_failures, int) else None,
            on_expire=encode(app, policy.on_expire, "on_expire") if policy.on_expire is not None else None,
            on_failure=encode(app, policy.on_failure, "on_failure") if policy.on_failure is not None else None,
            app_name=app.main or "",
            key=key,
            depth=depth,
            lineage=lineage,
            parent_task_id=self.parent_task_id,
            round=self.round,
            retry_of=self.retry_of,
        )

        encode_child = ChildEncoder(app, message, arguments)
        ratio = policy.max_failures if isinstance(policy.max_failures, float) else None
        width = self.max_width or fanin.settings.max_width
        children = self._partial_children(args, kwargs)
        # With the caller's transaction, published after its commit (by this process or the relay).
        written = write.write(fanin, root, children, encode_child, ratio=ratio, max_width=width, tx=tx)
        if is_eager(app):  # the children ran inline as they were published; now the successor
            return eager.run_eagerly(fanin, written.batch_id)
        if written.successor_outbox_id is not None:  # an empty group: send its successor now rather than on NOTIFY
            try:
                publish_outbox(fanin, ids=[written.successor_outbox_id])
            except Exception:
                logger.warning(
                    "could not publish successor of empty batch_id=%s; the relay will",
                    root.id,
                    exc_info=True,
                    extra={"batch_id": str(root.id), "step": step},
                )
        if not written.existing:
            logger.info(
                "created batch_id=%s step=%s children=%d depth=%d",
                written.batch_id,
                step,
                written.created,
                depth,
                extra={"batch_id": str(written.batch_id), "step": step},
            )
        successor_id = written.successor_task_id or (None if written.existing else root.successor_task_id)
        return FanInResult(app, str(written.batch_id), successor_id)


# `run_canvas` messages derive their task id from the batch id: a re-sent message is the same message.
_RUN_CANVAS_IDS = uuid.UUID("0f5b7c1e-3d2a-4e8b-9c61-7a4d2e9f1b03")
# Ids a run_canvas message keeps on the fan-in it carries (the batch's and the successor's).
_KEPT_IDS = frozenset({"task_id", BATCH_ID_OPTION})


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

    Recovery options (keyword only): `child_timeout` (timedelta or seconds; default `fanin_child_timeout`; None
    or 0: none) with `on_lost` ("fail": count the child as `lost`; "redrive": re-publish it, up to `max_redrives`
    times); `deadline` (timedelta, seconds from now, or datetime) with `on_deadline` ("proceed": run the successor
    with a partial outcome; "abandon": mark the batch expired and run `on_expire` if given); `max_failures` (a
    count, or a ratio of the children) after which the batch finishes early and `on_failure` (or the successor)
    runs.

    Scale options: `key` (an idempotency key, unique per app: a second call returns the existing batch, and
    resumes it if its producer died mid-stream); `max_width` (default `fanin_max_width`): above it, the batch
    becomes a tree of counters. `children` may be any iterable, consumed in chunks of `fanin_chunk_size`.
    """
    return FanInGroup(children, then=then, step=step, app=app, **options)
