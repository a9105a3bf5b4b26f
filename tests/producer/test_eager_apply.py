"""`FanInGroup.apply()` runs a fan-in inline without touching `app.conf`: `task_always_eager` is what it was after
the call returns or raises, and other threads of the same app keep publishing to the broker while it runs.

Against the real PostgreSQL and Redis (the `app` fixture's).
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import redis
from celery import Celery, chain, group

from celery_fanin import ChordHeaderFailed, FanIn, chord, fan_in_group
from tests.store.helpers import QUEUE, wait_for

TIMEOUT = 10.0


def _tasks(app: Celery) -> dict[str, Any]:
    # Wired as a user's app is (the package's FanIn): the worker hooks' successor publishing included, which
    # must stay off under apply() (the successor runs inline, its exception raised from apply).
    FanIn(app)
    gate = threading.Event()
    entered = threading.Event()

    @app.task(name="tests.eager.double", shared=False)
    def double(x: int) -> int:
        return x * 2

    @app.task(name="tests.eager.boom", shared=False)
    def boom(x: int) -> int:
        raise ValueError(f"boom {x}")

    @app.task(name="tests.eager.held", shared=False)
    def held(x: int) -> int:
        entered.set()
        if not gate.wait(TIMEOUT):
            raise TimeoutError("the test never opened the gate")
        return x

    @app.task(name="tests.eager.total", shared=False)
    def total(outcome: dict[str, Any]) -> list[int]:
        return [outcome["succeeded"], outcome["failed"]]

    @app.task(name="tests.eager.explode", shared=False)
    def explode(outcome: dict[str, Any]) -> None:
        raise RuntimeError("the successor raised")

    return {
        "double": double,
        "boom": boom,
        "held": held,
        "total": total,
        "explode": explode,
        "gate": gate,
        "entered": entered,
    }


def _unchanged(app: Celery) -> None:
    assert app.conf.task_always_eager is False
    assert "task_always_eager" not in app.conf.changes  # not even set back to False: never written at all


def test_apply_runs_inline_and_leaves_task_always_eager_alone(app: Celery, broker: redis.Redis) -> None:
    t = _tasks(app)
    result = fan_in_group([t["double"].s(1), t["double"].s(2), t["boom"].s(3)], then=t["total"].s()).apply()
    assert result.get(timeout=TIMEOUT) == [2, 1]
    assert broker.llen(QUEUE) == 0  # nothing went to the broker
    _unchanged(app)


def test_task_always_eager_is_restored_when_a_child_or_the_successor_raises(app: Celery) -> None:
    t = _tasks(app)
    app.conf.task_eager_propagates = True  # the exceptions leave `apply`
    with pytest.raises(RuntimeError, match="the successor raised"):
        fan_in_group([t["double"].s(1)], then=t["explode"].s()).apply()
    _unchanged(app)
    # A child's exception is recorded as its failure (the producer logs it) and does not leave `apply`.
    assert fan_in_group([t["boom"].s(2)], then=t["total"].s()).apply().get(timeout=TIMEOUT) == [0, 1]
    _unchanged(app)


def test_apply_does_not_switch_eager_mode_on_for_other_threads(app: Celery, broker: redis.Redis) -> None:
    """While one thread's `apply` runs a child, another thread's `apply_async` still goes to the broker, and two
    overlapping `apply` calls leave nothing switched on."""
    t = _tasks(app)
    outcome: list[Any] = []

    def run() -> None:
        outcome.append(fan_in_group([t["held"].s(5)], then=t["total"].s()).apply().get(timeout=TIMEOUT))

    first = threading.Thread(target=run)
    first.start()
    try:
        assert t["entered"].wait(TIMEOUT), "the held child never started"
        # The first thread is inside `apply`, in its child's body.
        assert app.conf.task_always_eager is False
        t["double"].apply_async((7,))
        sent = fan_in_group([t["double"].s(8)], then=t["total"].s()).apply_async()
        wait_for(lambda: broker.llen(QUEUE) == 2, TIMEOUT, "both messages on the broker")
        assert sent.batch_status().state == "running"  # published, not run inline
        # A second `apply` that starts and ends while the first is still running.
        assert fan_in_group([t["double"].s(9)], then=t["total"].s()).apply().get(timeout=TIMEOUT) == [1, 0]
    finally:
        t["gate"].set()
        first.join(TIMEOUT)
    assert not first.is_alive() and outcome == [[1, 0]]
    _unchanged(app)


def test_a_nested_fan_in_and_a_chain_child_run_inline_under_apply(app: Celery, broker: redis.Redis) -> None:
    """The eager flag reaches what the call runs: a nested fan-in child writes and runs its own batch inline, and a
    chain child runs task by task, with nothing sent to the broker."""
    t = _tasks(app)
    inner = fan_in_group([t["double"].s(1), t["boom"].s(2)], then=t["total"].s())
    chained = t["double"].s(3) | t["double"].s()
    result = fan_in_group([inner, chained, t["double"].s(5)], then=t["total"].s()).apply()
    assert result.get(timeout=TIMEOUT) == [3, 0]
    assert broker.llen(QUEUE) == 0
    _unchanged(app)


def test_a_chord_runs_inline_under_apply(app: Celery, broker: redis.Redis) -> None:
    """`celery_fanin.chord(...).apply()`: the body gets the list, in header order; a failed header task fails the
    body with `ChordHeaderFailed` (its code not run), as it does on a worker."""
    t = _tasks(app)
    ran: list[Any] = []

    @app.task(name="tests.eager.listed", shared=False)
    def listed(results: list[int]) -> list[int]:
        ran.append(results)
        return results

    assert chord([t["double"].s(i) for i in range(4)], listed.s()).apply().get(timeout=TIMEOUT) == [0, 2, 4, 6]
    failed = chord([t["double"].s(1), t["boom"].s(2)], listed.s()).apply()
    with pytest.raises(ChordHeaderFailed, match=r"1 of 2 header tasks succeeded.*#1 tests\.eager\.boom"):
        failed.get(timeout=TIMEOUT)
    assert ran == [[0, 2, 4, 6]] and broker.llen(QUEUE) == 0
    _unchanged(app)


def test_a_then_chain_failing_in_the_middle_and_a_chord_as_a_chords_body_under_apply(
    app: Celery, broker: redis.Redis
) -> None:
    """Inline as on a worker: a `then=` chain whose middle task fails fails the successor with that task's error;
    a chord whose body is a chord gives each inner header task the outer results and answers with the inner body."""
    t = _tasks(app)

    @app.task(name="tests.eager.first", shared=False)
    def first(outcome: dict[str, Any]) -> int:
        return int(outcome["succeeded"])

    @app.task(name="tests.eager.summed", shared=False)
    def summed(values: list[int]) -> int:
        return sum(values)

    failing = fan_in_group([t["double"].s(1)], then=first.s() | t["boom"].s() | t["double"].s()).apply()
    with pytest.raises(ValueError, match="boom 1"):
        failing.get(timeout=TIMEOUT)
    assert failing.batch_status().successor_state == "failed"
    nested = chord([t["double"].s(1), t["double"].s(2)], chord([summed.s(), summed.s()], summed.s())).apply()
    assert nested.get(timeout=TIMEOUT) == 12  # each inner header task sums [2, 4]; the body sums [6, 6]
    assert broker.llen(QUEUE) == 0
    _unchanged(app)


def test_a_group_as_a_chords_body_under_apply(app: Celery, broker: redis.Redis) -> None:
    """Inline as on a worker, with no result backend: a group as the body is written as a fan-in of its own, each
    member given the header's results; `get()` answers with the members' values, or raises the first failing
    member's error."""
    t = _tasks(app)

    @app.task(name="tests.eager.summed", shared=False)
    def summed(values: list[int], extra: int = 0) -> int:
        return sum(values) + extra

    @app.task(name="tests.eager.refuse", shared=False)
    def refuse(values: list[int]) -> None:
        raise KeyError(f"refused {values}")

    grouped = chord([t["double"].s(1), t["double"].s(2)], group(summed.s(), summed.s(extra=1))).apply()
    assert grouped.get(timeout=TIMEOUT) == [6, 7]
    failing = chord([t["double"].s(1)], group(summed.s(), refuse.s(), t["boom"].si(3))).apply()
    with pytest.raises(KeyError, match=r"refused \[2\]"):
        failing.get(timeout=TIMEOUT)
    assert broker.llen(QUEUE) == 0
    _unchanged(app)


def test_a_chain_child_ending_in_a_chord_under_apply(app: Celery, broker: redis.Redis) -> None:
    """Inline as on a worker: a chain child may end with a nested chord, which stands for the child; the value of
    the task before it reaches each of its header tasks first, and its body's value is the child's."""
    t = _tasks(app)

    @app.task(name="tests.eager.listed", shared=False)
    def listed(results: list[int]) -> list[int]:
        return results

    nested = chain(t["double"].s(1), chord([t["double"].s(), t["double"].s()], listed.s()))
    assert chord([nested, t["double"].s(5)], listed.s()).apply().get(timeout=TIMEOUT) == [[4, 4], 10]
    failing = chain(t["boom"].s(1), chord([t["double"].s()], listed.s()))
    with pytest.raises(ChordHeaderFailed, match="boom 1"):
        chord([failing], listed.s()).apply().get(timeout=TIMEOUT)
    assert broker.llen(QUEUE) == 0
    _unchanged(app)
