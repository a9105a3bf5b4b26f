"""Why a completed batch's successor is published rather than run where its batch completed
(`dispatch.inline.reason_not`): each condition alone, in a pool process's task context (the child whose report
completed the batch), without a broker. The e2e tests run the main ones in real workers
(tests/e2e/test_inline_successor.py)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from celery import Celery, Task
from celery._state import _task_stack
from celery.worker.request import Request
from kombu import Queue

from celery_fanin.broker import publish
from celery_fanin.dispatch import inline
from celery_fanin.protocol import HEADER_SUCCESSOR


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

    @app.task(shared=False, name="t.rated", rate_limit="10/m")
    def rated(outcome: Any) -> None: ...

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
        ("t.rated", "here", {}, "a rate limit (the worker's main process throttles its messages)"),
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


def _built(app: Celery, **options: Any) -> Any:
    sig = app.tasks["t.successor"].s().set(**options)
    built = publish.successor_message(app, uuid.uuid4(), "then", "s-1", sig, {"succeeded": 1})
    assert built is not None, "the fast builder builds a plain successor"
    return built


def test_the_message_run_here_is_the_one_a_worker_would_have_received(app: Celery, in_child: Task) -> None:
    built = _built(app, priority=3)
    msg = inline.message(app, "s-1", built)
    assert msg is not None
    assert (msg.name, msg.task_id, msg.args, msg.kwargs) == ("t.successor", "s-1", [{"succeeded": 1}], {})
    request = msg.request
    assert request["id"] == "s-1" and request["task"] == "t.successor" and request["hostname"] == "w@h"
    assert request["is_eager"] is False and request["args"] == [{"succeeded": 1}]
    assert request["delivery_info"]["routing_key"] == built.route.routing_key
    assert request["delivery_info"]["priority"] == 3 == request["properties"]["priority"]
    assert "callbacks" in request and "chord" in request, "the body's embedded fields, as a pool process adds them"
    assert request[HEADER_SUCCESSOR] == built.headers[HEADER_SUCCESSOR], "the fan-in's headers ride along"


def test_a_successor_whose_expires_passed_is_published(app: Celery, in_child: Task) -> None:
    assert inline.message(app, "s-1", _built(app, expires=datetime.now(timezone.utc) - timedelta(seconds=1))) is None
    assert inline.message(app, "s-1", _built(app, expires=60)) is not None


def test_a_worker_with_time_limits_on_its_command_line_publishes_it(
    app: Celery, in_child: Task, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`celery worker --soft-time-limit N` (or `--time-limit`): Celery keeps it on the WorkController and gives it
    to the pool with each job, never in `app.conf`; the child's job has it all the same, and a successor run in it
    would get what is left of the child's budget (a real worker: SoftTimeLimitExceeded in the successor's body)."""
    monkeypatch.setattr(inline, "_worker_limits", (None, None))
    inline.note_worker(type("Worker", (), {"time_limit": None, "soft_time_limit": 4.0})())
    assert _reason(app) == "the worker sets time limits"
    inline.note_worker(type("Worker", (), {"time_limit": 30, "soft_time_limit": None})())
    assert _reason(app) == "the worker sets time limits"
    inline.note_worker(type("Worker", (), {"time_limit": None, "soft_time_limit": None})())
    assert _reason(app) is None


def test_a_pool_process_whose_worker_changed_its_queues_since_the_fork_publishes_it(
    app: Celery, in_child: Task, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`cancel_consumer` / `add_consumer` change the main process's queues only: a prefork pool process keeps the set
    it was forked with, so it cannot tell whether its worker still consumes the successor's queue."""
    monkeypatch.setattr(inline, "_queues_shared", None)
    monkeypatch.setattr(inline, "_queues_generation", 0)
    pool_process = type("Process", (), {"name": "ForkPoolWorker-1"})()
    monkeypatch.setattr(inline, "current_process", lambda: pool_process)
    monkeypatch.setattr(inline, "_shared", inline.SharedRevoked())  # what a forked pool process inherits
    inline.share_queue_changes(app)
    assert _reason(app) is None
    forked = inline._queues_generation
    app.amqp.queues.deselect("here")  # the main process: cancel_consumer("here")
    monkeypatch.setattr(inline, "_queues_generation", forked)  # the pool process's copy, from its fork
    assert _reason(app, queue="celery") is not None
    app.amqp.queues.select_add("here")
    monkeypatch.setattr(inline, "_queues_generation", forked)
    assert _reason(app) == "the worker's queues or task limits changed since this process started"


def test_a_rate_limited_successor_runs_here_where_the_worker_disables_rate_limits(app: Celery, in_child: Task) -> None:
    assert _reason(app, "t.rated") is not None
    app.conf.worker_disable_rate_limits = True  # no token bucket in the main process either
    assert _reason(app, "t.rated") is None


def test_a_stamped_successor_or_one_with_its_own_links_is_published(app: Celery) -> None:
    """A stamped successor signature (Celery's stamping API) or one with its own `link`/`link_error` is built by
    Celery's `apply_async`, not the fast builder, so it is never run where its batch completed: it is published,
    and the worker's main process applies `revoke_by_stamped_headers` (which a pool process does not see) and runs
    its links as for any message."""
    stamped = app.tasks["t.successor"].s()
    stamped.stamp(tenant="a")
    assert stamped.options["stamped_headers"] == ["tenant"]
    linked = app.tasks["t.successor"].s().set(link=app.tasks["t.child"].si())
    for sig in (stamped, linked):
        assert publish.successor_message(app, uuid.uuid4(), "then", "s-1", sig, {"succeeded": 1}) is None


@pytest.mark.parametrize("command", ["rate_limit", "time_limit"])
def test_a_pool_process_whose_worker_changed_a_task_s_limits_by_control_command_publishes_it(
    app: Celery, in_child: Task, monkeypatch: pytest.MonkeyPatch, command: str
) -> None:
    """`celery control rate_limit` / `time_limit` change the task in the worker's main process only (its token bucket
    at once, its jobs' time limits once the consumer restarts): a prefork pool process keeps the task it was forked
    with, so it cannot tell that the successor, or the child's job it would run in, is now limited."""
    from celery.worker.control import Panel

    monkeypatch.setattr(inline, "_queues_shared", None)
    monkeypatch.setattr(inline, "_queues_generation", 0)
    monkeypatch.setitem(Panel.data, command, Panel.data[command])  # put back after the test
    pool_process = type("Process", (), {"name": "ForkPoolWorker-1"})()
    monkeypatch.setattr(inline, "current_process", lambda: pool_process)
    monkeypatch.setattr(inline, "_shared", inline.SharedRevoked())
    inline.share_queue_changes(app)
    inline._count_control_commands()  # twice (a second worker in this process): counted once
    forked = inline._queues_generation
    state = type("State", (), {"app": app, "consumer": type("Consumer", (), {"reset_rate_limits": lambda: None})})()
    arguments = {"rate_limit": {"rate_limit": "1/m"}, "time_limit": {"soft": 1.0, "hard": 2.0}}[command]
    reply = Panel.data[command](state, task_name="t.successor", **arguments)
    assert "ok" in reply, reply  # Celery's own command ran
    assert inline._queues_generation == forked + 1, "counted once"
    # The pool process's copies, from its fork: the count, and the task as it was (here the command changed it).
    monkeypatch.setattr(inline, "_queues_generation", forked)
    task = app.tasks["t.successor"]
    task.rate_limit = task.time_limit = task.soft_time_limit = None
    assert _reason(app) == "the worker's queues or task limits changed since this process started"
