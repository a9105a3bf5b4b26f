"""Building a saga: its steps, each optionally `compensated(...)` or `manual(...)`; `apply_async` records it."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from celery import Celery, current_app
from celery.canvas import Signature
from kombu.exceptions import EncodeError
from sqlalchemy.exc import SQLAlchemyError

from ..codec import encode_signature
from ..context import FanIn
from ..exceptions import FanInDatabaseError, InvalidFanIn, InvalidSaga, summarise
from ..producer.group import FanInGroup
from ..protocol import HEADER_UNDO
from ..store import sagas as store
from .driver import kick, undo_of_signature
from .status import SagaResult

logger = logging.getLogger("celery_fanin.sagas")


@dataclass(frozen=True)
class Compensated:
    """A `fan_in_group` step with an undo for the whole group (run before its children's own undos)."""

    action: FanInGroup
    undo: Signature


@dataclass(frozen=True)
class Manual:
    """A step nothing can undo mechanically: on rollback, an operator is asked to do `text`."""

    action: Signature | FanInGroup
    text: str


def _plain(value: object, what: str) -> Signature:
    if not isinstance(value, Signature) or type(value) is not Signature:
        kind = type(value).__name__
        raise InvalidSaga(f"{what} must be a plain task signature (task.s(...)), not {kind}")
    return value


def compensated(action: Signature | FanInGroup, undo: Signature) -> Any:
    """Pair work with the task that undoes it.

    ``compensated(task.s(...), undo.s(...))`` returns a copy of the task signature carrying its undo (in a
    message header), so it can be a saga step or a child of any `fan_in_group`: the undo runs for it only if it
    succeeded, when a saga rolls back or its batch's successor calls `outcome.compensate()`.
    ``compensated(fan_in_group(...), undo.s(...))`` is a saga step whose undo reverses the group as a whole (its
    children may carry their own).
    """
    undo_sig = _plain(undo, "the undo")
    if undo_of_signature(undo_sig) is not None:
        raise InvalidSaga("the undo itself carries an undo; compensations are not compensated")
    if isinstance(action, FanInGroup):
        return Compensated(action, undo_sig)
    sig = _plain(action, "the compensated work")
    clone = sig.clone()
    clone.options["headers"] = {**(sig.options.get("headers") or {}), HEADER_UNDO: dict(undo_sig)}
    return clone


def manual(action: Signature | FanInGroup, text: str) -> Manual:
    """A saga step that nothing can undo mechanically (an email sent, a transfer to a partner with no reversal):
    if a later step fails, the saga asks an operator to do `text` and records their `saga ack`."""
    if not isinstance(text, str) or not text.strip():
        raise InvalidSaga("manual() needs the text an operator reads to undo the step")
    if isinstance(action, Compensated) or (isinstance(action, Signature) and undo_of_signature(action) is not None):
        raise InvalidSaga("a manual step has no mechanical undo: give it compensated() or manual(), not both")
    if not isinstance(action, FanInGroup):
        _plain(action, "the manual step")
    return Manual(action, text.strip())


class Saga:
    """An ordered list of steps; `apply_async` records it and starts the first."""

    def __init__(
        self,
        steps: Sequence[Any],
        *,
        key: str | None = None,
        app: Celery | None = None,
        compensation_timeout: timedelta | float | None = None,
        compensation_redrives: int = 3,
    ) -> None:
        self.steps = list(steps)
        self.key = key
        self._app = app
        self.compensation_timeout = compensation_timeout
        self.compensation_redrives = compensation_redrives

    @property
    def app(self) -> Celery:
        if self._app is not None:
            return self._app
        for step in self.steps:
            action = step.action if isinstance(step, (Manual, Compensated)) else step
            if isinstance(action, FanInGroup):
                return action.app
            if isinstance(action, Signature) and action._app is not None:
                return action._app
        return current_app

    def _validate(self, app: Celery) -> tuple[list[store.NewStep], timedelta | None]:
        if not self.steps:
            raise InvalidSaga("a saga needs at least one step")
        if self.key is not None and (not isinstance(self.key, str) or not self.key or len(self.key) > 400):
            raise InvalidSaga("key must be a non-empty string of at most 400 characters")
        redrives = self.compensation_redrives
        if not isinstance(redrives, int) or isinstance(redrives, bool) or redrives < 0:
            raise InvalidSaga(f"compensation_redrives must be a whole number >= 0, not {redrives!r}")
        timeout = self.compensation_timeout
        if timeout is not None and not isinstance(timeout, timedelta):
            if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
                raise InvalidSaga(f"compensation_timeout must be a timedelta or seconds > 0, not {timeout!r}")
            timeout = timedelta(seconds=timeout)
        return [self._step(app, position, item) for position, item in enumerate(self.steps, 1)], timeout

    @staticmethod
    def _step(app: Celery, position: int, item: Any) -> store.NewStep:
        what = f"step {position}"
        manual_text = None
        if isinstance(item, Manual):
            manual_text, item = item.text, item.action
        undo = None
        if isinstance(item, Compensated):
            undo, item = item.undo, item.action
        if isinstance(item, FanInGroup):
            try:
                sig = item.as_signature(app, what)
            except InvalidFanIn as exc:
                raise InvalidSaga(str(exc)) from exc
            then = item.then
            then_name = then.task if isinstance(then, Signature) else "fan_in_group"
            name = f"fan_in_group({len(list(item.children))} children, then={then_name})"
            kind = "group"
        elif isinstance(item, Signature):
            sig = _plain(item, what)
            name, kind = sig.task, "task"
        else:
            raise InvalidSaga(f"{what} must be a task signature, a fan_in_group, compensated(...) or manual(...), "
                              f"not {type(item).__name__}")  # fmt: skip
        try:
            definition = encode_signature(app, sig)
            encoded_undo = encode_signature(app, undo) if undo is not None else None
        except EncodeError as exc:
            raise InvalidSaga(f"{what}: its arguments cannot be encoded with the app's serializer: {exc}") from exc
        return store.NewStep(position, kind, name, definition, manual_text, encoded_undo)

    def apply_async(self) -> SagaResult:
        """Record the saga and its steps in one transaction, then start step 1; returns at once with the handle.

        With `key`, a second call returns the existing saga (and starts whatever it was waiting to start).
        """
        app = self.app
        fanin = FanIn.of(app)
        steps, timeout = self._validate(app)
        new = store.NewSaga(uuid.uuid4(), app.main or "", self.key, len(steps), timeout, self.compensation_redrives)
        try:
            with fanin.engine.begin() as conn:
                saga_id = new.id if store.create_saga(conn, new, steps) else None
                if saga_id is None:
                    found = store.find_saga(conn, new.app_name, self.key or "")
                    row = store.get_saga(conn, found) if found else None
                    if row is None:
                        raise FanInDatabaseError(f"the saga holding key {self.key!r} disappeared; try again")
                    if row.steps != len(steps):
                        raise InvalidSaga(f"key {self.key!r} is taken by saga {row.id} with {row.steps} steps, "
                                          f"not {len(steps)}; use another key")  # fmt: skip
                    saga_id = row.id
        except SQLAlchemyError as exc:
            raise FanInDatabaseError(f"could not record the saga; nothing was started: {summarise(exc)}") from exc
        if saga_id == new.id:
            logger.info("created saga_id=%s steps=%d", saga_id, len(steps), extra={"saga_id": str(saga_id)})
        try:
            kick(fanin, saga_id)
        except Exception:
            logger.warning("saga_id=%s is recorded but could not be started; `celery -A %s fanin saga resume %s` "
                           "starts it", saga_id, app.main, saga_id, exc_info=True)  # fmt: skip
        return SagaResult(app, str(saga_id))

    __call__ = apply_async


def saga(
    *steps: Any,
    key: str | None = None,
    app: Celery | None = None,
    compensation_timeout: timedelta | float | None = None,
    compensation_redrives: int = 3,
) -> Saga:
    """Run `steps` one after another; if one fails for good, undo the completed ones in reverse order.

    Each step is a task signature or a `fan_in_group`, optionally wrapped in `compensated(step, undo)` or
    `manual(step, "text")`; children of a group step may be `compensated(...)` too. `key` makes creation
    idempotent (per app). A compensation whose task has not finished `compensation_timeout` after it started
    (default: `fanin_child_timeout`) is published again, up to `compensation_redrives` times, then counts as
    failed: compensations must be idempotent (key their effect on `task.request.fanin_undo_of`).
    """
    return Saga(steps, key=key, app=app, compensation_timeout=compensation_timeout,
                compensation_redrives=compensation_redrives)  # fmt: skip
