"""Arguments that do not fit their task are refused by the producer, as `Task.apply_async` refuses them, before
anything is written or published: a child's, a chain child's first task's, a nested fan-in's, the successor's
(`then=`, which gets the outcome first) and `on_failure`/`on_expire`'s. A task with `typing=False` and a task the
producer does not know (a signature by name) are not checked, as Celery does not check them. A streamed batch
stops at the chunk holding the misfit, as at any bad item of a stream. The real PostgreSQL and Redis.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
import redis
from celery import Celery, Signature, Task, chain, group
from sqlalchemy import Engine

from celery_fanin import FanInGroup, InvalidArguments, InvalidFanIn, fan_in_group
from celery_fanin.producer import group as group_module
from tests.conftest import REDIS_CLAIM_KEY
from tests.sql import child_ids
from tests.store.helpers import TABLES, Tasks, fetch_all, fetch_one, queued_messages, row_counts


def _assert_nothing_written_or_published(store_engine: Engine, broker: redis.Redis) -> None:
    assert row_counts(store_engine) == dict.fromkeys(TABLES, 0)
    assert [k for k in broker.keys("*") if k != REDIS_CLAIM_KEY.encode()] == [], "nothing may reach the broker"


@pytest.fixture
def strict(app: Celery) -> dict[str, Task]:
    """Tasks with exact signatures: `one(x)`, `then_only(outcome)`; `loose(x)` has `typing=False`."""

    @app.task(name="tests.args.one", shared=False)
    def one(x: int) -> int:
        return x

    @app.task(name="tests.args.then_only", shared=False)
    def then_only(outcome: dict[str, Any]) -> None:
        return None

    @app.task(name="tests.args.loose", shared=False, typing=False)
    def loose(x: int) -> int:
        return x

    return {"one": one, "then_only": then_only, "loose": loose}


Build = Callable[[Tasks, dict[str, Task]], FanInGroup]

MISFITS: list[Any] = [
    pytest.param(
        lambda t, s: fan_in_group([t.add.s(0, 0), t.add.s(1, 1), t.add.s(1, 2, 3), t.add.s(3, 3)], then=t.collect.s()),
        r"^child 2 \(tests\.store\.add\): its arguments do not fit the task: add\(\) takes 2 positional arguments "
        r"but 3 were given$",
        id="child-in-the-middle-too-many",
    ),
    pytest.param(
        lambda t, s: fan_in_group([t.add.s(0, 0), t.add.s(x=1)], then=t.collect.s()),
        r"^child 1 \(tests\.store\.add\): .*missing 1 required positional argument: 'y'",
        id="child-missing-an-argument",
    ),
    pytest.param(
        lambda t, s: fan_in_group([t.add.s(0, 0), s["one"].s(1, z=2)], then=t.collect.s()),
        r"^child 1 \(tests\.args\.one\): .*unexpected keyword argument 'z'",
        id="child-unknown-keyword",
    ),
    pytest.param(
        lambda t, s: fan_in_group([t.add.s(0, 0), chain(s["one"].s(1, 2), t.add.s(1))], then=t.collect.s()),
        r"^child 1 \(task 0 of the chain, tests\.args\.one\): .*takes 1 positional argument but 2 were given",
        id="chain-child-first-task",
    ),
    pytest.param(
        lambda t, s: fan_in_group([t.add.s(1)], then=t.collect.s()).s(1, 2),
        r"^child 0 \(tests\.store\.add\): .*takes 2 positional arguments but 3 were given",
        id="partial-arguments-of-the-fan-in-prepended",
    ),
    pytest.param(
        lambda t, s: fan_in_group(
            [t.add.s(0, 0), fan_in_group([s["one"].s(1), s["one"].s()], then=t.collect.s())], then=t.collect.s()
        ),
        r"^child 1, child 1 \(tests\.args\.one\): .*missing 1 required positional argument: 'x'",
        id="nested-fan-in-child",
    ),
    pytest.param(
        lambda t, s: fan_in_group([t.add.s(0, 0)], then=s["then_only"].s(1)),
        r"^then \(tests\.args\.then_only\): .*takes 1 positional argument but 2 were given",
        id="then-the-outcome-comes-first",
    ),
    pytest.param(
        lambda t, s: fan_in_group([t.add.s(0, 0)], then=s["one"].si()),
        r"^then \(tests\.args\.one\): .*missing 1 required positional argument: 'x'",
        id="then-immutable-gets-no-outcome",
    ),
    pytest.param(
        lambda t, s: fan_in_group([t.add.s(0, 0)], then=chain(s["one"].s(1), t.add.s(1))),
        r"^then \(task 0 of the chain, tests\.args\.one\): .*takes 1 positional argument but 2 were given",
        id="then-a-chain",
    ),
    pytest.param(
        lambda t, s: fan_in_group([t.add.s(0, 0)], then=group(t.collect.s(), s["one"].s(1))),
        r"^then, member 1 of the group \(tests\.args\.one\): .*takes 1 positional argument but 2 were given",
        id="then-a-group",
    ),
    pytest.param(
        lambda t, s: fan_in_group(
            [t.add.s(0, 0)], then=t.collect.s(), max_failures=1, on_failure=s["then_only"].s(1, 2)
        ),
        r"^on_failure \(tests\.args\.then_only\): .*takes 1 positional argument but 3 were given",
        id="on-failure",
    ),
    pytest.param(
        lambda t, s: fan_in_group(
            [t.add.s(0, 0)],
            then=t.collect.s(),
            deadline=timedelta(hours=1),
            on_deadline="abandon",
            on_expire=s["one"].s(1),
        ),
        r"^on_expire \(tests\.args\.one\): .*takes 1 positional argument but 2 were given",
        id="on-expire",
    ),
]


@pytest.mark.parametrize(("build", "message"), MISFITS)
def test_arguments_that_do_not_fit_are_refused_before_anything_is_written_or_published(
    app: Celery,
    tasks: Tasks,
    strict: dict[str, Task],
    store_engine: Engine,
    broker: redis.Redis,
    build: Build,
    message: str,
) -> None:
    with pytest.raises(InvalidArguments, match=message) as info:
        build(tasks, strict).apply_async()
    # The library's bad-input error, and the TypeError that Celery's own check raises.
    assert isinstance(info.value, InvalidFanIn) and isinstance(info.value, TypeError)
    _assert_nothing_written_or_published(store_engine, broker)


def test_apply_refuses_a_misfit_before_running_anything(
    app: Celery, tasks: Tasks, store_engine: Engine, broker: redis.Redis
) -> None:
    with pytest.raises(InvalidArguments, match=r"^child 1 \(tests\.store\.add\)"):
        fan_in_group([tasks.add.s(0, 0), tasks.add.s(1)], then=tasks.collect.s()).apply()
    _assert_nothing_written_or_published(store_engine, broker)


def _published(store_engine: Engine, broker: redis.Redis, batch_id: str) -> tuple[list[str], list[str]]:
    """The batch's child task ids as written, in order, and the task ids of the messages on the broker."""
    return child_ids(store_engine, batch_id), [m.headers["id"] for m in queued_messages(broker)]


def test_a_task_with_typing_off_is_not_checked(
    app: Celery, tasks: Tasks, strict: dict[str, Task], store_engine: Engine, broker: redis.Redis
) -> None:
    """As `Task.apply_async` with `typing=False`: the misfit is written and published (the worker's call fails)."""
    handle = fan_in_group([tasks.add.s(0, 0), strict["loose"].s(1, 2, 3)], then=tasks.collect.s()).apply_async()
    written, sent = _published(store_engine, broker, handle.batch_id)
    assert len(written) == 2 and sent == written


def test_a_task_the_producer_does_not_know_is_published_by_name_unchecked(
    app: Celery, tasks: Tasks, store_engine: Engine, broker: redis.Redis
) -> None:
    """Producers often do not import the workers' tasks: as `send_task`, a name it does not know is not checked."""
    unknown = app.signature("tests.args.not_registered_here", args=(1, 2, 3), kwargs={"z": 4})
    then = app.signature("tests.args.unknown_successor", args=(1, 2))
    handle = fan_in_group([tasks.add.s(0, 0), unknown], then=then).apply_async()
    written, sent = _published(store_engine, broker, handle.batch_id)
    assert len(written) == 2 and sent == written
    assert [m.headers["task"] for m in queued_messages(broker)] == ["tests.store.add", "tests.args.not_registered_here"]


def _stream(tasks: Tasks, n: int, bad: int) -> Iterator[Signature]:
    for i in range(n):
        yield tasks.add.s(i, 1, 2) if i == bad else tasks.add.s(i, i)


def test_a_streamed_batch_stops_at_the_chunk_holding_a_misfit_and_without_a_key_is_cancelled(
    app: Celery, tasks: Tasks, store_engine: Engine, broker: redis.Redis
) -> None:
    """As any bad item of a stream (docs/how-to/streaming.md): the chunks before it were written and published,
    the chunk holding it is not written, and without a key the batch is cancelled (its sent children revoked)."""
    app.conf.fanin_chunk_size = 3
    with pytest.raises(InvalidArguments, match=r"^child 7 \(tests\.store\.add\): .*but 3 were given"):
        fan_in_group(_stream(tasks, 9, bad=7), then=tasks.collect.s()).apply_async()
    with store_engine.connect() as conn:
        batch = fetch_one(conn, "SELECT id, state, planned FROM fanin_batches")
        indexes = [r["idx"] for r in fetch_all(conn, "SELECT idx FROM fanin_children ORDER BY idx")]
    assert (batch["state"], batch["planned"]) == ("cancelled", 6)
    assert indexes == [0, 1, 2, 3, 4, 5], "the chunk holding child 7 (children 6..8) must not be written"
    written, sent = _published(store_engine, broker, batch["id"])
    assert sent == written, "only the chunks written before the misfit's were published"


def test_a_streamed_batch_with_a_key_stays_open_at_a_misfit(
    app: Celery, tasks: Tasks, store_engine: Engine, broker: redis.Redis
) -> None:
    app.conf.fanin_chunk_size = 3
    with pytest.raises(InvalidArguments, match=r"^child 4 "):
        fan_in_group(_stream(tasks, 9, bad=4), then=tasks.collect.s(), key="misfit-stream").apply_async()
    with store_engine.connect() as conn:
        batch = fetch_one(conn, "SELECT id, state, planned FROM fanin_batches")
    assert (batch["state"], batch["planned"]) == ("open", 3)
    written, sent = _published(store_engine, broker, batch["id"])
    assert len(written) == 3 and sent == written


def test_a_streamed_batch_with_a_misfit_successor_writes_nothing(
    app: Celery, tasks: Tasks, strict: dict[str, Task], store_engine: Engine, broker: redis.Redis
) -> None:
    """The successors are checked before the stream is read: no batch row, no child, nothing published."""
    consumed: list[int] = []

    def children() -> Iterator[Signature]:
        for i in range(5):
            consumed.append(i)
            yield tasks.add.s(i, i)

    with pytest.raises(InvalidArguments, match=r"^then \(tests\.args\.then_only\)"):
        fan_in_group(children(), then=strict["then_only"].s(1)).apply_async()
    assert consumed == []
    _assert_nothing_written_or_published(store_engine, broker)


def test_the_check_of_each_task_is_looked_up_once_per_batch(
    app: Celery, tasks: Tasks, monkeypatch: pytest.MonkeyPatch
) -> None:
    """2,000 children of one task: the task registry is read once for them, not once per child."""
    lookups: list[str] = []
    real = group_module.publish.ArgumentCheck.header

    def counting(self: Any, name: str) -> Any:
        if name not in self._headers:
            lookups.append(name)
        return real(self, name)

    monkeypatch.setattr(group_module.publish.ArgumentCheck, "header", counting)
    fan_in_group([tasks.add.s(i, i) for i in range(2000)], then=tasks.collect.s()).apply_async()
    assert sorted(lookups) == ["tests.store.add", "tests.store.collect"]


@pytest.mark.parametrize("bulk", [True, False], ids=["built-message", "celery-apply-async"])
def test_an_immutable_successor_gets_no_outcome_on_either_publishing_path(
    app: Celery, strict: dict[str, Task], store_engine: Engine, broker: redis.Redis, bulk: bool
) -> None:
    """`then=one.si(5)` passes the check (the outcome is not its argument), and is published as `one(5)` both by
    the producer's own message builder and by Celery's `apply_async` (fanin_bulk_publish off), as a chord's `.si()`
    body gets no header results."""
    app.conf.fanin_bulk_publish = bulk
    handle = fan_in_group([], then=strict["one"].si(5)).apply_async()  # empty: its successor is published now
    assert handle.batch_status().successor_state == "sent"
    [message] = queued_messages(broker)
    assert (message.headers["task"], message.args, message.kwargs) == ("tests.args.one", [5], {})
