"""The task guards: `before_start`, `retry` and `on_replace` wrapped on every task of a fan-in app (`guard_tasks`).

They run in the pool process, inside Celery's trace: a message whose headers differ from its body's claim never
runs; a successor's body runs in one admitted run at a time (`store.successors`); a successor's retry or
replacement hands its run over before Celery publishes the next delivery, and carries the fan-in headers on.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any

from celery import Celery, Signature, chord, group
from celery.canvas import _chain
from celery.exceptions import Ignore, Retry

from ..context import FanIn
from ..dispatch import inline, successors
from ..protocol import (
    BODY_CLAIM,
    HEADER_CARRIER,
    HEADER_CHORD,
    HEADER_PART_OF,
    THEN_CANVAS_TASK,
    Marker,
    SuccessorState,
    request_header,
)
from . import report, runtime, successor_runs
from .reporter import claim_refusal, fanin_for
from .successor_runs import due_at

logger = logging.getLogger("celery_fanin.hooks")


def _guard(before_start: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a task's `before_start` so that a fan-in message whose headers differ from its body's claim never
    runs (see `claim_refusal`), and a successor's body runs in one execution at a time, never after it ended for
    good (see `store.successors`).

    `before_start` runs inside the trace's exception handling, so the `Ignore` raised for a refused message or a
    duplicate delivery ends that execution as IGNORED without running its body (and without touching the live
    run's state).
    """

    def before_start_guarded(self: Any, task_id: str, args: Any, kwargs: Any) -> Any:
        request = self.request
        marker = Marker.from_mapping(request)
        if marker is None and request.is_eager:  # eager: the headers stay in `request.headers`
            marker = Marker.from_mapping(request.headers)
        fanin = fanin_for(self.app) if marker is not None else None
        if fanin is not None and marker is not None and not request.is_eager:
            why = claim_refusal(fanin, request, getattr(request, BODY_CLAIM, None))
            if why is not None:
                runtime.current.reporter.refuse(fanin, task_id, marker, why)
                raise Ignore()
        if marker is not None and marker.is_part:
            return before_start(self, task_id, args, kwargs)  # not the successor: runs freely (`Marker.is_part`)
        if (
            fanin is not None
            and marker is not None
            and marker.is_successor
            and successor_runs.request_run(self.request) is None
            and runtime.current.reporter.admit_successor(fanin, self.request, marker.successor_id(task_id), marker)
            is None
        ):
            logger.warning(
                "duplicate delivery of successor batch_id=%s step=%s task_id=%s: body not run",
                marker.batch_id,
                marker.step,
                task_id,
                extra={"batch_id": marker.batch_id, "step": marker.step, "task_id": task_id},
            )
            raise Ignore()
        if fanin is not None and marker is not None and marker.is_successor:
            _mark_inline_sent(fanin, marker, task_id)
            why = request_header(request, HEADER_CHORD)
            if why:
                # A chord's body whose header did not all succeed: admitted (so this is its one run), failed here
                # instead of run, so Celery records the failure and calls the body's errbacks once, as it does
                # for a chord's body (`chord_error_from_stack`): a chain's or a group's, which `then_canvas`
                # carries inside its canvas, too.
                if self.name == THEN_CANVAS_TASK and isinstance(kwargs, dict):
                    request.errbacks = [*(request.errbacks or []), *_canvas_errbacks(kwargs.get("canvas"))]
                raise successor_runs.chord_failure(fanin, marker.batch_id, str(why))
        return before_start(self, task_id, args, kwargs)

    before_start_guarded._fanin_guard = True  # type: ignore[attr-defined]
    return before_start_guarded


def _mark_inline_sent(fanin: FanIn, marker: Marker, task_id: str) -> None:
    """A successor run where its batch completed (`dispatch.inline`), now admitted: its outbox row is marked sent
    by this process's background thread, beside its body rather than before it."""
    ids = inline.take_unsent(task_id)
    if ids:
        report.background().submit(lambda: successors.mark_sent(fanin, marker.batch_id, ids))


def _canvas_errbacks(canvas: Any) -> list[Any]:
    """The errbacks Celery calls when a chord's body that is this canvas fails unrun: a chain's own, or each
    member's of a group (`Backend.chord_error_from_stack`, `_handle_group_chord_error`)."""
    if not isinstance(canvas, dict):
        return []
    if canvas.get("subtask_type") == "group":
        members = (canvas.get("kwargs") or {}).get("tasks") or []
        return [eb for m in members if isinstance(m, dict) for eb in (m.get("options") or {}).get("link_error") or []]
    return list((canvas.get("options") or {}).get("link_error") or [])


@contextmanager
def _handed_over(
    live: successor_runs.LiveRun,
    state: str,
    ends: type[BaseException],
    due_at: datetime | None = None,
    carrier: str | None = None,
) -> Iterator[None]:
    """Hand the run over for the call inside, which publishes the next delivery and ends with `ends`; if it
    raises anything else, nothing was handed on and the run is taken back."""
    successor_runs.hand_over(live, state, due_at, carrier)
    try:
        yield
    except ends:
        raise
    except BaseException:
        successor_runs.take_back(live)
        raise


def _retry_guard(retry: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap `Task.retry` so that a successor's run is handed over before Celery publishes the retry.

    Celery publishes the retry message inside `retry()`, before the attempt's `task_postrun`: without this the
    retry could be delivered while the attempt still holds the run, and be refused as a duplicate. If no retry is
    published (max_retries exceeded, or publishing failed), the run is taken back and the attempt goes on.
    """

    def retry_guarded(
        self: Any,
        args: Any = None,
        kwargs: Any = None,
        exc: BaseException | None = None,
        throw: bool = True,
        eta: datetime | None = None,
        countdown: float | None = None,
        max_retries: int | None = None,
        **options: Any,
    ) -> Any:
        live = successor_runs.request_run(self.request)
        if live is None or live.ended or self.request.is_eager:
            return retry(self, args, kwargs, exc, throw, eta, countdown, max_retries, **options)
        delay = countdown if countdown is not None or eta is not None else self.default_retry_delay
        with _handed_over(live, SuccessorState.RETRYING, Retry, due_at(eta, delay)):
            return retry(self, args, kwargs, exc, throw, eta, countdown, max_retries, **options)

    retry_guarded._fanin_guard = True  # type: ignore[attr-defined]
    return retry_guarded


def _replace_guard(on_replace: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap `Task.on_replace` (called by `Task.replace`) so that the replacement carries the fan-in on.

    The replacement has the replaced task's id but none of its custom headers: its carrier (the task that takes
    that id) gets the fan-in headers, so a child is counted when its replacement ends, and a successor ends when its
    replacement does. Its other tasks (a chain's earlier tasks, a chord's header) get headers too, so that one that
    fails ends what the carrier would have (the carrier then never comes): for a child, each reports for it as a
    chain child's earlier task does; for a successor, each is a *part* (`Marker.is_part`), never admitted as a run.
    A successor's run is handed over (`replaced`) before the replacement is published, so the replacement's
    delivery is admitted. A child's replacement also keeps the ``ignore_result=True`` the library gave the child
    (Celery's `replace` does not carry it), so that its results stay out of the result backend too.
    """

    def on_replace_guarded(self: Any, sig: Any) -> Any:
        marker = Marker.from_mapping(self.request)
        if marker is None or self.request.is_eager:
            return on_replace(self, sig)
        carrier = _carrier(sig)
        tasks = [carrier, *_parts(sig, carrier)]
        rid = self.request.id
        replaced_id = marker.successor_id(rid) if marker.is_successor else marker.child_id(rid)
        if not marker.is_successor and getattr(self.request, "ignore_result", None) is True:
            fanin = fanin_for(self.app)
            if fanin is not None and not fanin.settings.store_child_results_in_backend:
                # The carrier only: a part's result is stored under its own id, and a chord (a group replacement,
                # which Celery upgrades) reads its header's results from the result backend.
                carrier.options.setdefault("ignore_result", True)
        _add_headers(carrier, marker.headers())
        if not marker.is_part and (marker.is_successor or marker.chain is None):
            # A carrier frozen with a task id of its own (Celery keeps it) stands for the successor's or the
            # child's (`Marker.stands_for`); in a chain child, the chain's id names the child already.
            if carrier.options.get("task_id", replaced_id) != replaced_id:
                carrier.options["headers"][HEADER_PART_OF] = replaced_id
            else:
                carrier.options["headers"].pop(HEADER_PART_OF, None)
        live = successor_runs.request_run(self.request) if marker.is_successor and not marker.is_part else None
        if live is None or live.ended:
            if not marker.is_successor or marker.is_part:
                for part in tasks[1:]:
                    _add_headers(part, marker.part_headers(replaced_id, marker.carrier))
            return on_replace(self, sig)
        # From here on only the carrier is admitted: a copy of this message (a redelivery, the relay's, a stall
        # republish) has the same task id but not this token.
        token = uuid.uuid4().hex
        carrier.options["headers"][HEADER_CARRIER] = token
        for part in tasks[1:]:
            _add_headers(part, marker.part_headers(replaced_id, token))
        with _handed_over(live, SuccessorState.REPLACED, Ignore, carrier=token):
            return on_replace(self, sig)

    on_replace_guarded._fanin_guard = True  # type: ignore[attr-defined]
    return on_replace_guarded


def _add_headers(sig: Any, headers: dict[str, Any]) -> None:
    sig.options["headers"] = {**(sig.options.get("headers") or {}), **headers}


def _carrier(sig: Any) -> Any:
    """The task of a replacement that takes the replaced task's id, and so its place (`Task.replace` freezes the
    replacement with that id: a chain's last task, a chord's body)."""
    if isinstance(sig, _chain) and sig.tasks:
        return _carrier(sig.tasks[-1])
    if isinstance(sig, chord):
        return _carrier(sig.body)
    return sig


def _parts(sig: Any, carrier: Any) -> list[Any]:
    """The task signatures of a replacement other than its carrier: a chain's, a chord's header's and body's, a
    group's members, at any depth."""
    if sig is carrier:
        return []
    if isinstance(sig, chord):
        return [*_parts(sig.tasks, carrier), *_parts(sig.body, carrier)]
    if isinstance(sig, (_chain, group)):
        return [part for task in sig.tasks if isinstance(task, Signature) for part in _parts(task, carrier)]
    return [sig] if isinstance(sig, Signature) else []


def guard_tasks(app: Celery) -> bool:
    """Give every task of `app` the successor run guard and the retry and replace hand-overs; True if any task
    was changed."""
    changed = False
    for task in app.tasks.values():
        cls = type(task)
        for method, around in (("before_start", _guard), ("retry", _retry_guard), ("on_replace", _replace_guard)):
            if not getattr(getattr(cls, method), "_fanin_guard", False):
                cls.add_around(method, around)  # Celery's own mechanism for wrapping task methods
                changed = True
    return changed
