"""Fan-ins inside fan-ins: a child that is itself a `fan_in_group`, and `then=` a `fan_in_group` (a pipeline).

Both travel as an ordinary task message for `celery_fanin.run_group`, whose argument is the inner group's spec
(plain JSON-able data), so they are published, redriven and republished like any other child or successor:

- As a **child**, `run_group` creates the inner batch (keyed by its own task id, so a redelivery finds the batch
  it already created) and then ends as IGNORED, which is not terminal: the child is counted when the inner
  batch's successor finishes, with that successor's return value as its result, or its failure as the child's
  failure (see `store.batches.finish_successor`).
- As a **successor** (`then=fan_in_group(...)`), `run_group` receives the outcome first, like any successor, and
  starts the next stage, keyed by the finished batch, returning the new batch's id. `FanInResult.final()`
  follows those links to the last stage's result.

Depth and lineage come for free: `run_group` runs inside a fan-in child or successor, so the batch it creates is
one level deeper than the one that ran it, and `fanin_max_depth` bounds the nesting.
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any

from celery import Celery
from celery.canvas import Signature
from celery.exceptions import Ignore

from .exceptions import InvalidFanIn

if TYPE_CHECKING:
    from .canvas import FanInGroup

TASK_NAME = "celery_fanin.run_group"
# The options a nested group may carry, all JSON-able once durations are in seconds.
_OPTIONS = ("child_timeout", "on_lost", "max_redrives", "deadline", "on_deadline", "on_expire", "max_failures",
            "on_failure", "max_width")  # fmt: skip


def to_spec(group: FanInGroup, what: str) -> dict[str, Any]:
    """The inner group as plain data: its children must be a list (they travel inside one message)."""
    from .canvas import FanInGroup

    children = group.children
    if not isinstance(children, (list, tuple)):
        raise InvalidFanIn(f"{what}: a nested fan_in_group needs a list of children, not a generator")
    if group.then is None:
        raise InvalidFanIn(f"{what}: a nested fan_in_group needs then=")
    items: list[Any] = []
    for i, child in enumerate(children):
        if isinstance(child, FanInGroup):
            items.append({"group": to_spec(child, f"{what}, child {i}")})
        elif isinstance(child, Signature):
            items.append({"sig": dict(child)})
        else:
            raise InvalidFanIn(f"{what}, child {i} is not a task signature (got {type(child).__name__})")
    then = group.then
    options: dict[str, Any] = {}
    for name in _OPTIONS:
        value = group.options.get(name) if name != "max_width" else group.max_width
        if value is None or (name == "child_timeout" and value is _default()):
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
        "then": {"group": to_spec(then, f"{what}, then")} if isinstance(then, FanInGroup) else {"sig": dict(then)},
        "step": group.step,
    }
    if options:
        spec["options"] = options
    return spec


def _default() -> object:
    from .canvas import _DEFAULT

    return _DEFAULT


def from_spec(app: Celery, spec: dict[str, Any]) -> FanInGroup:
    from .canvas import FanInGroup

    def item(data: dict[str, Any]) -> Any:
        if "group" in data:
            return from_spec(app, data["group"])
        return app.signature(data["sig"])

    options = dict(spec.get("options") or {})
    for name in ("on_expire", "on_failure"):
        if isinstance(options.get(name), dict):
            options[name] = app.signature(options[name]["sig"])
    if "deadline" in options:
        options["deadline"] = timedelta(seconds=options["deadline"])
    max_width = options.pop("max_width", None)
    return FanInGroup(
        [item(c) for c in spec["children"]], then=item(spec["then"]), step=spec.get("step"), app=app,
        max_width=max_width, **options,
    )  # fmt: skip


def as_signature(app: Celery, group: FanInGroup, what: str) -> Signature:
    """The message that stands for a nested group: `celery_fanin.run_group(spec)`."""
    return app.signature(TASK_NAME, args=(to_spec(group, what),))


def register(app: Celery) -> None:
    """Define `celery_fanin.run_group` on the app; `FanIn(app)` calls this once. Lazy, like any `@app.task`:
    it does not finalize the app."""

    @app.task(name=TASK_NAME, bind=True, shared=False)
    def run_group(self: Any, *args: Any) -> dict[str, Any]:
        from .publish import HEADER_BATCH, HEADER_SUCCESSOR, request_header

        spec = args[-1]
        group = from_spec(self.app, spec)
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
