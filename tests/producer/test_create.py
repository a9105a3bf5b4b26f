"""The producer side: `fan_in_group(...).apply_async()` against the real Postgres and Redis broker.

Creation is one transaction (batch + every child, remaining == planned) before anything is published; bad input is
refused before anything is written or published; a dead database refuses, a dead broker after the commit loses
nothing (the relay publishes what the producer could not).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import pytest
import redis
from celery import Celery, chain, chord, group
from kombu.exceptions import OperationalError
from sqlalchemy import Engine, text

from celery_fanin import FanIn, FanInDatabaseError, FanInGroup, FanInResult, InvalidFanIn, codec, fan_in_group
from celery_fanin import chord as fanin_chord
from celery_fanin.broker import publish
from celery_fanin.relay import Relay
from celery_fanin.store import batches
from celery_fanin.store.statements import q
from tests.conftest import REDIS_CLAIM_KEY
from tests.sql import batch, row_count
from tests.sql import children as child_rows
from tests.store.helpers import (
    QUEUE,
    TABLES,
    Tasks,
    collecting_batch,
    create,
    define_tasks,
    fetch_all,
    queued_messages,
    row_counts,
    wait_for,
)


def _assert_nothing_written_or_published(store_engine: Engine, broker: redis.Redis) -> None:
    assert row_counts(store_engine) == dict.fromkeys(TABLES, 0)
    assert broker.llen(QUEUE) == 0
    assert _broker_keys(broker) == [], "nothing at all may reach the broker (not even a queue binding)"


def _broker_keys(broker: redis.Redis) -> list[bytes]:
    """Every key on the session's broker database except the session's own claim on it."""
    return [k for k in broker.keys("*") if k != REDIS_CLAIM_KEY.encode()]


def _publish_locks_held(store_engine: Engine) -> int:
    """Two-int advisory locks held in this database: only producers' publish locks take that form here (a failed
    creation leaves no batch row to match a lock against, so every such lock is counted)."""
    with store_engine.connect() as conn:
        return conn.execute(
            text(
                """
                SELECT count(*) FROM pg_locks
                 WHERE locktype = 'advisory' AND objsubid = 2
                   AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
                """
            )
        ).scalar_one()


def test_the_publish_lock_of_a_batch_is_found_by_its_id(store_engine: Engine) -> None:
    """The relay tells a live producer from a dead one by matching each batch to its lock in pg_locks."""
    batch, _, _ = create(store_engine, 1)
    other = uuid.UUID(int=batch.id.int ^ 1)  # shares its first 64 bits: the only way to share a lock
    held = q("held_publish_locks").text
    with store_engine.connect() as holder:
        batches.hold_publish_lock(holder, batch.id)
        holder.commit()
        with store_engine.connect() as conn:
            assert conn.execute(held).scalar_one() == 1
            assert not batches.try_publish_lock(conn, batch.id)
            assert not batches.try_publish_lock(conn, other)
            assert batches.try_publish_lock(conn, uuid.uuid4())
            conn.rollback()
        batches.release_publish_lock(holder, batch.id)
        holder.commit()


# --- creation --------------------------------------------------------------------------------------------------


def test_apply_async_writes_batch_and_every_child_then_publishes_them(
    app: Celery, tasks: Tasks, store_engine: Engine, broker: redis.Redis
) -> None:
    planned = 25
    sigs = [tasks.add.s(i, i) for i in range(planned)]
    sigs[3] = sigs[3].set(task_id="my-own-child-id")
    handle = fan_in_group(sigs, then=tasks.collect.s("tail"), step="merge").apply_async()

    assert isinstance(handle, FanInResult)
    with store_engine.connect() as conn:
        b = batch(conn, handle.batch_id)
        assert row_count(conn, "fanin_batches") == 1
        assert conn.execute(text("SELECT count(*) FROM fanin_successors")).scalar_one() == 0
        assert conn.execute(text("SELECT count(*) FROM fanin_outbox")).scalar_one() == 0
    assert (b["state"], b["planned"], b["remaining"], b["succeeded"], b["failed"]) == ("running", 25, 25, 0, 0)
    assert b["published_upto"] == planned
    assert (b["step"], b["successor_name"], b["successor_task_id"]) == (
        "merge",
        "tests.store.collect",
        handle.successor_task_id,
    )
    assert b["completed_at"] is None

    rows = child_rows(store_engine, handle.batch_id, "task_id", "idx", "task_name", "state")
    assert [r["idx"] for r in rows] == list(range(planned))
    assert {(r["task_name"], r["state"]) for r in rows} == {("tests.store.add", "pending")}
    assert rows[3]["task_id"] == "my-own-child-id"
    assert len({r["task_id"] for r in rows}) == planned

    status = handle.batch_status()
    assert (status.planned, status.remaining, status.published, status.successor_state) == (25, 25, 25, None)

    # Every child is on the broker exactly once, with its stored task id, its index and the batch id.
    messages = queued_messages(broker)
    assert len(messages) == broker.llen(QUEUE) == planned
    published = {m.headers["id"]: m for m in messages}
    assert set(published) == {r["task_id"] for r in rows}
    for r in rows:
        m = published[r["task_id"]]
        assert (m.headers["task"], m.headers["fanin_batch"], m.headers["fanin_index"]) == (
            "tests.store.add",
            handle.batch_id,
            r["idx"],
        )
        assert m.args == [r["idx"], r["idx"]]
    assert _publish_locks_held(store_engine) == 0, "the producer must release its publish lock"


def test_step_defaults_to_the_successor_task_name_and_200_chars_is_allowed(
    app: Celery, tasks: Tasks, store_engine: Engine
) -> None:
    default = fan_in_group([tasks.add.s(1, 1)], then=tasks.collect.s()).apply_async()
    longest = fan_in_group([tasks.add.s(1, 1)], then=tasks.collect.s(), step="s" * 200).apply_async()
    with store_engine.connect() as conn:
        steps = {r["id"]: r["step"] for r in fetch_all(conn, "SELECT id, step FROM fanin_batches")}
    assert steps == {uuid.UUID(default.batch_id): "tests.store.collect", uuid.UUID(longest.batch_id): "s" * 200}


def test_failed_creation_writes_no_row_at_all(
    app: Celery, tasks: Tasks, store_engine: Engine, broker: redis.Redis
) -> None:
    """The children insert fails after the batch insert: the transaction leaves neither (nothing published)."""
    fan_in_group([tasks.add.s(0, 0).set(task_id="taken")], then=tasks.collect.s()).apply_async()
    broker.flushdb()
    before = row_counts(store_engine)

    sigs = [tasks.add.s(1, 1), tasks.add.s(2, 2).set(task_id="taken")]
    with pytest.raises(FanInDatabaseError, match="nothing was published"):
        fan_in_group(sigs, then=tasks.collect.s()).apply_async()
    after = row_counts(store_engine)
    assert after == before, "the failed batch left rows behind"
    assert after == {"fanin_batches": 1, "fanin_children": 1, "fanin_successors": 0, "fanin_outbox": 0}
    assert _broker_keys(broker) == []


def test_failed_creation_leaves_no_publish_lock_behind(app: Celery, tasks: Tasks, store_engine: Engine) -> None:
    fan_in_group([tasks.add.s(0, 0).set(task_id="taken")], then=tasks.collect.s()).apply_async()
    assert _publish_locks_held(store_engine) == 0
    with pytest.raises(FanInDatabaseError):
        fan_in_group([tasks.add.s(1, 1).set(task_id="taken")], then=tasks.collect.s()).apply_async()
    assert _publish_locks_held(store_engine) == 0, "a publish lock outlived the failed apply_async in the pool"


# --- bad input ---------------------------------------------------------------------------------------------------

Build = Callable[[Tasks], FanInGroup]

INVALID: list[Any] = [
    pytest.param(
        lambda t: fan_in_group([t.add.s(1, 1), 42], then=t.collect.s()),
        r"child 1 is not a task signature \(got int\)",
        id="child-not-a-signature",
    ),
    pytest.param(
        lambda t: fan_in_group([t.add], then=t.collect.s()),
        r"child 0 is not a task signature",
        id="child-is-a-task-not-a-signature",
    ),
    pytest.param(
        lambda t: fan_in_group([t.add.s(1, 1), group(t.add.s(2, 2), t.add.s(3, 3))], then=t.collect.s()),
        r"child 1 is a group; fan_in_group takes plain task signatures",
        id="child-group",
    ),
    pytest.param(  # a chain of task signatures is a child; one holding a group has no single last task
        lambda t: fan_in_group(
            [t.add.s(1, 1), chain(t.add.s(1, 1), group(t.add.s(2), t.add.s(3)))], then=t.collect.s()
        ),
        r"child 1: task 1 of the chain is a group; a chain child may hold only task signatures",
        id="child-chain-with-a-group",
    ),
    pytest.param(  # a nested fan-in may end a chain child (it stands for the child), not sit in its middle
        lambda t: fan_in_group(
            [chain(t.add.s(1, 1), fan_in_group([t.add.s(2)], then=t.collect.s()), t.add.s(3))], then=t.collect.s()
        ),
        r"child 0: task 1 of the chain is a fan_in_group; .* and end with a nested fan-in",
        id="child-chain-with-a-fan-in-before-its-end",
    ),
    pytest.param(  # the fan-in at a chain's end is checked as a nested one, given the value before it
        lambda t: fan_in_group(
            [chain(t.add.s(1, 1), fan_in_group([t.add.s(1, 2)], then=t.collect.s()))], then=t.collect.s()
        ),
        r"child 0: the fan-in that ends the chain, child 0 \(tests\.\w+\.add\): its arguments do not fit",
        id="child-chain-ending-in-a-fan-in-whose-child-does-not-fit",
    ),
    pytest.param(  # a nested fan-in is counted when its successor ends: a chord body is only written then
        lambda t: fan_in_group(
            [t.add.s(1, 1), chain(t.add.s(1, 1), fanin_chord([t.add.s(2)], fanin_chord([t.add.s(3)], t.collect.s())))],
            then=t.collect.s(),
        ),
        r"child 1: the fan-in that ends the chain: a chord whose body is a chord cannot be a fan-in's child",
        id="child-chain-ending-in-a-chord-whose-body-is-a-chord",
    ),
    pytest.param(
        lambda t: fan_in_group(
            [fanin_chord([t.add.s(2, 2)], fanin_chord([t.add.s(3)], t.collect.s()))], then=t.collect.s()
        ),
        r"child 0: a chord whose body is a chord cannot be a fan-in's child",
        id="child-chord-whose-body-is-a-chord",
    ),
    pytest.param(
        lambda t: fan_in_group([t.add.s(1, 1), chain(t.add.s(1, object()), t.add.s(2))], then=t.collect.s()),
        r"child 1: its arguments cannot be encoded",
        id="child-chain-args-not-json",
    ),
    pytest.param(
        lambda t: fan_in_group([chord([t.add.s(1, 1)], t.collect.s())], then=t.collect.s()),
        r"child 0 is a _?chord",
        id="child-chord",
    ),
    pytest.param(
        lambda t: fan_in_group([t.add.s(1, 1), t.add.s(1, 1), t.add.s(object(), 1)], then=t.collect.s()),
        r"child 2: its arguments cannot be encoded with the app's serializer",
        id="child-args-not-json",
    ),
    pytest.param(
        lambda t: fan_in_group([t.add.s(x=1, y={1, 2})], then=t.collect.s()),
        r"child 0: its arguments cannot be encoded",
        id="child-kwargs-not-json",
    ),
    pytest.param(
        lambda t: fan_in_group([t.add.s(1, 1)], then=t.collect.s(object())),
        r"then: its arguments cannot be encoded",
        id="then-args-not-json",
    ),
    pytest.param(lambda t: fan_in_group([t.add.s(1, 1)]), r"fan_in_group needs then=", id="then-missing"),
    pytest.param(
        lambda t: fan_in_group([t.add.s(1, 1)], then=chord([t.add.s(1, 1)], t.collect.s())),
        r"then is a chord",
        id="then-chord",
    ),
    pytest.param(
        lambda t: fan_in_group([t.add.s(1, 1)], then=t.collect), r"then is not a task signature", id="then-task"
    ),
    pytest.param(
        lambda t: fan_in_group([t.add.s(1, 1)], then=t.collect.s(), step=""),
        r"step must be a non-empty string",
        id="step-empty",
    ),
    pytest.param(
        lambda t: fan_in_group([t.add.s(1, 1)], then=t.collect.s(), step="   "),
        r"step must be a non-empty string",
        id="step-blank",
    ),
    pytest.param(
        lambda t: fan_in_group([t.add.s(1, 1)], then=t.collect.s(), step=7),  # type: ignore[arg-type]
        r"step must be a non-empty string",
        id="step-not-a-string",
    ),
    pytest.param(
        lambda t: fan_in_group([t.add.s(1, 1)], then=t.collect.s(), step="x" * 201),
        r"step is 201 characters long; at most 200 are allowed",
        id="step-too-long",
    ),
    pytest.param(
        lambda t: fan_in_group(42, then=t.collect.s()),  # type: ignore[arg-type]
        r"children must be an iterable of task signatures",
        id="children-not-iterable",
    ),
    pytest.param(
        lambda t: fan_in_group(None, then=t.collect.s()),  # type: ignore[arg-type]
        r"children must be an iterable of task signatures",
        id="children-none",
    ),
    pytest.param(
        lambda t: fan_in_group(t.add.s(1, 1), then=t.collect.s()),
        r"children must be an iterable of task signatures",
        id="children-a-single-signature",
    ),
    pytest.param(
        lambda t: fan_in_group("tests.store.add", then=t.collect.s()),
        r"children must be an iterable of task signatures",
        id="children-a-string",
    ),
    pytest.param(
        lambda t: fan_in_group(
            [t.add.s(1, 1).set(task_id="same"), t.add.s(2, 2).set(task_id="same")], then=t.collect.s()
        ),
        r"two children share a task_id",
        id="duplicate-child-task-ids",
    ),
]


@pytest.mark.parametrize(("build", "message"), INVALID)
def test_invalid_input_is_refused_before_anything_is_written_or_published(
    app: Celery, tasks: Tasks, store_engine: Engine, broker: redis.Redis, build: Build, message: str
) -> None:
    with pytest.raises(InvalidFanIn, match=message) as info:
        build(tasks).apply_async()
    assert isinstance(info.value, ValueError)  # InvalidFanIn is also a ValueError
    _assert_nothing_written_or_published(store_engine, broker)


def test_a_chunks_child_is_refused_before_anything_is_written_or_published(
    app: Celery, tasks: Tasks, store_engine: Engine, broker: redis.Redis
) -> None:
    """Chunks publish task ids the batch would not record (their outcomes never counted): refused up front."""
    with pytest.raises(InvalidFanIn, match=r"child 1 is a chunks; fan_in_group takes plain task signatures"):
        fan_in_group(
            [tasks.add.s(0, 0), tasks.add.chunks([(1, 1), (2, 2), (3, 3), (4, 4)], 2)], then=tasks.collect.s()
        ).apply_async()
    _assert_nothing_written_or_published(store_engine, broker)


# --- unreachable services ------------------------------------------------------------------------------------------


def test_unreachable_database_raises_and_publishes_nothing(
    app: Celery, tasks: Tasks, store_engine: Engine, broker: redis.Redis, closed_port: int, clean_db: str
) -> None:
    fanin = FanIn.of(app)
    app.conf.fanin_database_url = f"postgresql://root@127.0.0.1:{closed_port}/nowhere"
    fanin.dispose()
    try:
        with pytest.raises(FanInDatabaseError, match="nothing was published"):
            fan_in_group([tasks.add.s(1, 1), tasks.add.s(2, 2)], then=tasks.collect.s()).apply_async()
        with pytest.raises(FanInDatabaseError):  # an empty group too: its successor needs the database first
            fan_in_group([], then=tasks.collect.s()).apply_async()
    finally:
        app.conf.fanin_database_url = clean_db
        fanin.dispose()
    _assert_nothing_written_or_published(store_engine, broker)


def test_unreachable_broker_after_commit_returns_the_handle_and_the_relay_publishes_the_children(
    app: Celery, dead_broker_app: Celery, store_engine: Engine, broker: redis.Redis
) -> None:
    planned = 20
    dead = define_tasks(dead_broker_app)
    handle = fan_in_group([dead.add.s(i, 1) for i in range(planned)], then=dead.collect.s()).apply_async()

    assert isinstance(handle, FanInResult)
    status = handle.batch_status()
    assert (status.state, status.planned, status.remaining) == ("running", planned, planned)
    assert status.published < planned
    assert len(child_rows(store_engine, handle.batch_id, "idx")) == planned
    assert broker.llen(QUEUE) == 0
    assert _publish_locks_held(store_engine) == 0, "the producer gave up, so it must have let go of its lock"

    # A relay on a healthy broker (and a smaller chunk, so it takes several round trips) publishes the rest.
    app.conf.fanin_chunk_size = 7
    relay = Relay(FanIn.of(app))
    assert relay.run_once() == planned
    assert relay.stats.children_published == planned
    assert broker.llen(QUEUE) == planned
    assert handle.batch_status().published == planned
    rows = child_rows(store_engine, handle.batch_id, "task_id", "idx", "task_name", "state")
    messages = queued_messages(broker)
    assert [m.headers["id"] for m in messages] == [r["task_id"] for r in rows]  # in index order
    assert [m.headers["fanin_index"] for m in messages] == list(range(planned))
    assert {m.headers["fanin_batch"] for m in messages} == {handle.batch_id}
    assert [m.args for m in messages] == [[i, 1] for i in range(planned)]

    assert relay.run_once() == 0  # nothing left: a second round publishes no duplicate
    assert broker.llen(QUEUE) == planned


def test_relay_leaves_a_batch_alone_while_its_producer_holds_the_publish_lock(
    app: Celery, tasks: Tasks, store_engine: Engine, broker: redis.Redis
) -> None:
    """A producer still publishing (its lock held) is not raced by the relay; once it dies, the relay takes over."""
    batch = collecting_batch(app, tasks)
    children = [
        batches.NewChild(f"{batch.id}-{i}", "tests.store.add", codec.encode_signature(app, tasks.add.s(i, i)))
        for i in range(5)
    ]
    relay = Relay(FanIn.of(app))
    with store_engine.connect() as producer:
        with producer.begin():  # what apply_async does before it publishes
            batches.hold_publish_lock(producer, batch.id)
            batches.create_batch(producer, batch, children)
        assert relay.run_once() == 0
        assert broker.llen(QUEUE) == 0
        producer.invalidate()  # the producer process dies: its connection, and with it the lock, is gone
    wait_for(lambda: _publish_locks_held(store_engine) == 0, 5, "the dead producer's lock to be released")
    assert relay.run_once() == 5
    assert [m.headers["id"] for m in queued_messages(broker)] == [c.task_id for c in children]


# --- the empty group ---------------------------------------------------------------------------------------------


def test_empty_group_is_complete_and_its_producer_publishes_the_successor(
    app: Celery, tasks: Tasks, store_engine: Engine, broker: redis.Redis
) -> None:
    handle = fan_in_group([], then=tasks.collect.s("tail", flag=True), step="empty").apply_async()

    status = handle.batch_status()
    assert (status.state, status.planned, status.remaining, status.succeeded, status.failed) == ("complete", 0, 0, 0, 0)
    assert status.completed_at is not None
    assert status.successor_state == "sent"
    with store_engine.connect() as conn:
        out = fetch_all(conn, "SELECT batch_id, step, sent_at, attempts, last_error FROM fanin_outbox")
        assert row_count(conn, "fanin_children") == 0
    assert len(out) == 1
    assert (str(out[0]["batch_id"]), out[0]["step"], out[0]["attempts"], out[0]["last_error"]) == (
        handle.batch_id,
        "empty",
        1,
        None,
    )
    assert out[0]["sent_at"] is not None

    [message] = queued_messages(broker)
    assert message.headers["task"] == "tests.store.collect"
    assert message.headers["id"] == handle.successor_task_id
    assert (message.headers["fanin_successor"], message.headers["fanin_step"]) == (handle.batch_id, "empty")
    outcome, *rest = message.args
    assert (outcome["batch_id"], outcome["planned"], outcome["succeeded"], outcome["failed"]) == (
        handle.batch_id,
        0,
        0,
        0,
    )
    assert (outcome["failures"], outcome["failures_truncated"]) == ([], False)
    assert rest == ["tail"]
    assert message.kwargs == {"flag": True}


def test_empty_group_with_dead_broker_leaves_the_successor_to_the_relay(
    app: Celery, dead_broker_app: Celery, store_engine: Engine, broker: redis.Redis
) -> None:
    dead = define_tasks(dead_broker_app)
    handle = fan_in_group([], then=dead.collect.s()).apply_async()  # does not raise: the batch is recorded

    assert handle.batch_status().state == "complete"
    assert handle.batch_status().successor_state == "pending"
    with store_engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM fanin_outbox WHERE sent_at IS NULL")).scalar_one() == 1
    assert broker.llen(QUEUE) == 0

    relay = Relay(FanIn.of(app))
    # The failed attempt may have scheduled a short backoff; the relay polls, and so does this test.
    wait_for(lambda: relay.run_once() > 0, 10, "the relay to publish the successor", interval=0.1)
    assert handle.batch_status().successor_state == "sent"
    [message] = queued_messages(broker)
    assert message.headers["id"] == handle.successor_task_id
    assert message.args[0]["planned"] == 0


def test_streamed_batch_stops_publishing_at_a_chunk_the_broker_refused_and_the_relay_publishes_from_there(
    app: Celery, tasks: Tasks, store_engine: Engine, broker: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A later chunk that does reach the broker must not mark the refused chunk before it as published."""
    app.conf.fanin_chunk_size = 3
    real = publish.publish_children
    calls: list[int] = []

    def refuse_the_second_chunk(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 2:
            raise OperationalError("broker went away for a moment")
        return real(*args, **kwargs)

    monkeypatch.setattr(publish, "publish_children", refuse_the_second_chunk)
    handle = fan_in_group((tasks.add.s(i, 1) for i in range(9)), then=tasks.collect.s()).apply_async()
    monkeypatch.setattr(publish, "publish_children", real)

    assert len(calls) == 2, "after a refused chunk the producer leaves the rest to the relay"
    assert handle.batch_status().published == 3
    assert len(child_rows(store_engine, handle.batch_id, "idx")) == 9, "every child is still recorded"
    assert [m.headers["fanin_index"] for m in queued_messages(broker)] == [0, 1, 2]

    assert Relay(FanIn.of(app)).run_once() == 6
    assert sorted(m.headers["fanin_index"] for m in queued_messages(broker)) == list(range(9))
    assert handle.batch_status().published == 9
