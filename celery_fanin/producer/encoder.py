"""A fan-in's children as the rows and messages written for them: each child checked, its arguments fitted to its
task (`Arguments`), and encoded once with the app's serializer (`ChildEncoder`), before anything is written.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from celery import Celery
from celery.canvas import Signature, _chain, maybe_signature
from celery.canvas import group as _group
from kombu.exceptions import EncodeError

from ..broker import publish
from ..codec import encode_signature
from ..exceptions import InvalidArguments, InvalidFanIn
from ..store import batches
from .plan import MessageTimes, check_chain, check_plain_signature, is_fan_in
from .task_ids import random_ids


def encode(app: Celery, sig: Signature, what: str, serializer: str | None = None) -> batches.Encoded:
    try:
        return encode_signature(app, sig, serializer)
    except EncodeError as exc:
        raise InvalidFanIn(f"{what}: its arguments cannot be encoded with the app's serializer: {exc}") from exc


def check_nested(nested: Signature, what: str) -> None:
    """A nested fan-in stands for a child, counted when its successor ends, with its value: a chord whose body is
    a chord would be counted when the inner chord was written, with its id for a value, so it is refused."""
    if nested.is_chord and is_fan_in(nested.then):
        raise InvalidFanIn(
            f"{what}: a chord whose body is a chord cannot be a fan-in's child: it would be counted when its inner "
            "chord is written (with that chord's id for its value), not when the inner chord's body ends"
        )


def nested_tail(app: Celery, chained: Signature, what: str, arguments: Arguments) -> Signature:
    """A chain child whose last task is a nested fan-in (`a | chord(...)`), with that fan-in as its message,
    `celery_fanin.run_group(spec)`: as a chain's last task it takes the child's task id, and its batch, written
    when it runs, stands for the child (counted when its successor ends), as a nested fan-in child's does. The
    task before it passes its value on, to each of the fan-in's children first, as a chord in a chain gets it.
    Any other chain is returned as it is."""
    tasks = publish.chain_tasks(chained)
    last = maybe_signature(tasks[-1], app=app) if tasks else None
    if not is_fan_in(last):
        return chained
    check_nested(last, f"{what}: the fan-in that ends the chain")
    before = (arguments.OUTCOME,) if len(tasks) > 1 and not last.immutable else ()
    arguments.group(last, f"{what}: the fan-in that ends the chain", *before)
    nested = last.as_signature(app, f"{what}: the fan-in that ends the chain")
    rebuilt = _chain(*tasks[:-1], nested, app=app)
    rebuilt.options.update(chained.options)
    return rebuilt


class Arguments:
    """Checks that each child's and successor's arguments fit its task, as `Task.apply_async` would at publish
    time, so that a misfit is refused (`InvalidArguments`) before anything is written or published.

    As Celery: only tasks registered in the producer's app are checked (a signature by name of a task the producer
    does not import is published by name, as `send_task` does), a task with `typing=False` is not, and a chain is
    checked by its first task (the message published now). A successor gets the outcome as its first argument
    (unless immutable), as when it is published; a chain or group `then=` passes it to its first tasks. Each task's
    check is looked up once per call (`publish.ArgumentCheck`): cheap for 10,000 children of one task.
    """

    OUTCOME = object()  # stands for the outcome a successor receives first

    def __init__(self, app: Celery) -> None:
        self.check = publish.ArgumentCheck(app)
        self.app = app

    def signature(self, sig: Signature, what: str, *before: Any) -> None:
        try:
            self.check(sig, *before)
        except TypeError as exc:
            if publish.is_chain(sig):
                what = f"{what} (task 0 of the chain, {self._first(sig).task})"
            else:
                what = f"{what} ({sig.task})"
            raise InvalidArguments(f"{what}: its arguments do not fit the task: {exc}") from None

    def _first(self, chained: Signature) -> Any:
        tasks = publish.chain_tasks(chained)
        return maybe_signature(tasks[0], app=self.app) if tasks else None

    def child(self, child: Any, what: str, *before: Any) -> None:
        """A child as given (after the partial arguments `before` it will be given): a plain signature, a chain, or
        a nested fan-in (its children and successors)."""
        if is_fan_in(child):
            check_nested(child, what)
            self.group(child, what)
        elif isinstance(child, Signature):
            self.signature(child, what, *before)

    def group(self, group: Signature, what: str, *before: Any) -> None:
        """A nested fan-in or a pipeline's next stage, whose batch a worker writes later: checked now, as its own
        `apply_async` would check it there (its children must be a list to travel in a message), its children
        given `before` first (a chord's body that is a chord: the header's results)."""
        children = group._partial_children(tuple(group.args), group.kwargs)
        if isinstance(children, (list, tuple)):
            for i, child in enumerate(children):
                self.child(child, f"{what}, child {i}", *before)
        self.successor(group.then, f"{what}, then")
        policy = group.policy_options
        for name in ("on_failure", "on_expire"):
            if isinstance(policy.get(name), Signature):
                self.successor(policy[name], f"{what}, {name}")

    def successor(self, then: Any, what: str, of_chord: bool = False) -> None:
        """`then=` (or on_failure, on_expire) as given, with the outcome first (a chord's: its results)."""
        if is_fan_in(then):
            # A pipeline's next stage: run by run_group, the outcome not its children's; a chord's body that is a
            # chord: the results are each of its header tasks' first argument.
            self.group(then, what, *((self.OUTCOME,) if of_chord else ()))
        elif isinstance(then, _group):  # then_canvas passes the outcome to every member
            for i, member in enumerate(then.tasks):
                self.successor(maybe_signature(member, app=self.app), f"{what}, member {i} of the group")
        elif isinstance(then, Signature):
            self.signature(then, what, self.OUTCOME)


class ChildEncoder:
    """Each child of a batch as its row and the signature published for it, in the order given: a plain signature,
    a chain (counted when its last task ends; a nested fan-in may end it), or a nested fan-in (counted when its
    own successor ends). `message` holds the execution options given to `apply_async`, which every child takes
    unless it sets its own."""

    def __init__(self, app: Celery, message: dict[str, Any], arguments: Arguments) -> None:
        self.app = app
        self.message = message
        self.arguments = arguments
        self.serializer = app.conf.task_serializer  # read once: the configuration's lookup costs a child's JSON
        self.ids: Iterator[str] = random_ids()
        self.times = MessageTimes(app)

    def _with_message_options(self, sig: Signature) -> Signature:
        if not self.message:
            return sig
        sig = sig.clone()
        sig.options.update({**self.message, **sig.options})
        return sig

    def __call__(self, index: int, item: Any) -> tuple[batches.NewChild, Signature]:
        app, what = self.app, f"child {index}"
        if is_fan_in(item):  # a nested fan-in: counted when its own successor finishes
            check_nested(item, what)
            sig = self._with_message_options(item.as_signature(app, what))
            self.arguments.group(item, what)
        elif publish.is_chain(item):  # counted when its last task ends (or any task fails)
            item = nested_tail(app, item, what, self.arguments)
            tail = check_chain(item, what)
            self.arguments.signature(item, what)
            item = self._with_message_options(item)
            task_id = item.options.get("task_id") or tail.options.get("task_id") or next(self.ids)
            first = publish.chain_tasks(item)[0]  # its message is the one published now, with the chain's options
            expires_at, eta_at = self.times(first.task, {**first.options, **item.options}, what)
            encoded = encode(app, item, what, self.serializer)
            return batches.NewChild(task_id, tail.task, encoded, expires_at, eta_at), item
        else:
            sig = self._with_message_options(check_plain_signature(item, what))
            self.arguments.signature(sig, what)
        expires_at, eta_at = self.times(sig.task, sig.options, what)
        child = batches.NewChild(
            sig.options.get("task_id") or next(self.ids),
            sig.task,
            encode(app, sig, what, self.serializer),
            expires_at,
            eta_at,
        )
        return child, sig
