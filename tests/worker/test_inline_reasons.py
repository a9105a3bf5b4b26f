"""Why a completed batch's successor is published rather than run where its batch completed
(`dispatch.inline.reason_not`): each condition alone, in a pool process's task context (the child whose report
completed the batch), without a broker. The e2e tests run the main ones in real workers
(tests/e2e/test_inline_successor.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery, Task
from celery._state import _task_stack
from celery.worker.request import Request
from kombu import Queue

from celery_fanin.dispatch import inline


class _OwnRequest(Request):  # type: ignore[misc]  # Celery's Request is untyped
    pass


@pytest.fixture
def app() -> Iterator[Celery]:
    app = Celery("inline-reasons", set_as_current=False)
    app.conf.task_default_queue = "here"

    @app.task(shared=False, name="t.child")
    def child() -> None: ...

    @app.task(shared=False, name="t.successor")
    def successor(outcome: Any) -> None: ...

    @app.task(shared=False, name="t.late", acks_late=True)
    def late(outcome: Any) -> None: ...

    @app.task(shared=False, name="t.limited", time_limit=30)
    def limited(outcome: Any) -> None: ...

    @app.task(shared=False, name="t.own", Request=_OwnRequest)
    def own(outcome: Any) -> None: ...

    app.finalize()
    yield app


@pytest.fixture
def in_child(app: Celery) -> Iterator[Task]:
    """The child's task on the task stack, its request a worker's (not called directly, not eager)."""
    task = app.tasks["t.child"]
    task.push_request(called_directly=False, is_eager=False, timelimit=(None, None), hostname="w@h")
    _task_stack.push(task)
    try:
        yield task
    finally:
        _task_stack.pop()
        task.pop_request()


def _reason(app: Celery, name: str = "t.successor", queue: str = "here", **headers: Any) -> str | None:
    return inline.reason_not(app, name, (Queue(queue),), {"id": "s-1", "timelimit": [None, None], **headers})


def test_a_successor_as_a_user_writes_it_runs_here(app: Celery, in_child: Task) -> None:
    assert _reason(app) is None


def test_outside_a_worker_s_task_nothing_runs_here(app: Celery) -> None:
    assert _reason(app) == "not in a worker's task"


@pytest.mark.parametrize(
    ("name", "queue", "headers", "why"),
    [
        ("t.unknown", "here", {}, "task not registered in this worker"),
        ("t.successor", "elsewhere", {}, "routed to a queue this worker does not consume"),
        ("t.successor", "here", {"eta": "2026-12-06T00:00:00"}, "eta or countdown"),
        ("t.successor", "here", {"timelimit": [30, None]}, "the successor has a time limit"),
        ("t.limited", "here", {}, "the successor has a time limit"),
        ("t.late", "here", {}, "acks_late: a delivered successor is redelivered at once if its worker dies"),
        ("t.own", "here", {}, "a custom Request class (its hooks run in the main process, for a message)"),
    ],
)
def test_each_difference_a_successor_could_see_publishes_it(
    app: Celery, in_child: Task, name: str, queue: str, headers: dict[str, Any], why: str
) -> None:
    assert _reason(app, name, queue, **headers) == why


def test_a_child_s_job_or_worker_with_a_time_limit_publishes_it(app: Celery, in_child: Task) -> None:
    in_child.request.timelimit = (None, 10)
    assert _reason(app) == "the child's job has a time limit"
    in_child.request.timelimit = (None, None)
    app.conf.task_time_limit = 60
    assert _reason(app) == "the worker sets time limits"


def test_a_revoked_successor_is_published(app: Celery, in_child: Task, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(inline.worker_state, "revoked", {"s-1"})
    assert _reason(app) == "revoked"
