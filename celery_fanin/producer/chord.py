"""`chord`: a drop-in for `celery.chord`, with every fan-in guarantee.

``from celery_fanin import chord`` and nothing else changes: the body gets the header's results as a list, in
header order, and runs only if every header task succeeded. Underneath it is a `fan_in_group` whose successor is
the body: the batch and its count are in PostgreSQL, each header task is counted once whatever it ends in, and the
body is published by the outbox and run once by its run guard. What a chord adds to the fan-in:

- the relay sends the body the list of results read from PostgreSQL (no result backend), instead of the outcome
  (`dispatch.successors`, `CHORD_OPTION`), bounded by `fanin_chord_max_header` tasks and `fanin_chord_max_bytes`;
- if a header task did not succeed, the body's message carries `HEADER_CHORD` and its run guard fails it with
  `ChordHeaderFailed` (a `celery.exceptions.ChordError`) instead of running it, so Celery calls the body's
  `link_error` callbacks once and the handle's `get()` raises it, as a Celery chord fails its body.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from celery import Celery
from celery.canvas import Signature, _chain, maybe_signature
from celery.canvas import group as _group

from ..exceptions import InvalidFanIn
from ..protocol import FAN_IN_CHORD_TYPE
from .group import FanInGroup
from .plan import PLAN_KEY
from .result import FanInResult


def _header(header: Any) -> list[Any]:
    """The header as a list of children: a `celery.group`'s tasks, or the signatures given."""
    if isinstance(header, _group):
        return list(header.tasks)
    if isinstance(header, Signature):
        kind = header.get("subtask_type") or type(header).__name__.lstrip("_")
        raise InvalidFanIn(f"a chord's header is a list or a group of signatures, not one {kind}")
    if isinstance(header, (str, bytes, Mapping)) or not isinstance(header, Iterable):
        raise InvalidFanIn(f"a chord's header is a list or a group of signatures, not {type(header).__name__}")
    return list(header)


@Signature.register_type(name=FAN_IN_CHORD_TYPE)
class FanInChord(FanInGroup):
    """``chord(header, body)``: the body runs once, with the header's results, after every header task succeeded.

    The same call forms as Celery's: ``chord(header, body).apply_async()`` (or ``.delay()``, or called),
    ``chord(header)(body)``, ``chord(header, body) | next``, inside ``chain(...)`` and ``group(...)``. Header tasks
    are task signatures, chains of them, or nested fan-ins (a `chord` or `fan_in_group`, whose result is its body's
    or successor's); a Celery group or chord inside the header is refused (`InvalidFanIn`), before anything is
    written. Returns a `FanInResult`: an `AsyncResult` of the body, answered from PostgreSQL.
    """

    def __init__(
        self,
        header: Any = (),
        body: Signature | None = None,
        task: str | None = None,  # Celery's chord takes its task name here; a fan-in has none of its own
        args: Iterable[Any] | None = None,
        kwargs: Mapping[str, Any] | None = None,
        app: Celery | None = None,
        **options: Any,
    ) -> None:
        super().__init__(_header(header), then=body, app=app, args=args, kwargs=kwargs, options=options)
        dict.__setitem__(self, "subtask_type", FAN_IN_CHORD_TYPE)
        self[PLAN_KEY]["chord"] = True

    @property
    def header(self) -> list[Any]:
        """The header's signatures (Celery's chord keeps them as a group)."""
        return list(self.children)

    @property
    def tasks(self) -> list[Any]:
        return self.header

    @property
    def body(self) -> Signature | None:
        return self.then

    def __call__(self, body: Signature | None = None, **options: Any) -> FanInResult:  # type: ignore[override]
        """``chord(header)(body)``: apply with this body, as Celery's chord does."""
        return self.apply_async((), {"body": body} if body is not None else {}, **options)

    def apply_async(self, args: Any = None, kwargs: Any = None, **options: Any) -> FanInResult:
        """As `FanInGroup.apply_async`; a ``body`` in `kwargs` is the body (Celery's chord takes it there)."""
        kwargs = dict(kwargs or {})
        body = kwargs.pop("body", None)
        sig = self.evolve(then=body) if body is not None else self
        return FanInGroup.apply_async(sig, args, kwargs, **options)

    def link_error(self, errback: Any) -> Any:
        """As Celery's chord: the body's errback, and with ``task_allow_error_cb_on_chord_header`` each header
        task's too (a nested chord in the header links its own, by the same rule)."""
        errback = maybe_signature(errback, app=self._app)
        for task in self.header:
            if isinstance(task, FanInChord):
                task.link_error(errback)
            elif isinstance(task, Signature) and self.app.conf.task_allow_error_cb_on_chord_header:
                task.link_error(errback.clone(immutable=True))
        return super().link_error(errback)

    def __or__(self, other: Any) -> Any:
        """``chord | task`` appends the task to the body, as Celery's chord does, so the handle is still the
        chord's (its answer the task's result, read from PostgreSQL); a group or chain after it makes a chain."""
        if isinstance(other, Signature) and not isinstance(other, (_group, _chain, FanInGroup)):
            body = self.then
            if body is not None:
                return self.evolve(then=body | other)
        return super().__or__(other)

    def __repr__(self) -> str:
        then = self.then
        name = then.get("task") if isinstance(then, Signature) else None
        return f"chord({len(self.header)} tasks, body={name})"


# As Celery spells it: a class, so `isinstance(sig, chord)` works as it does for `celery.chord`.
chord = FanInChord
