"""The relay's orphan publishing (`publish_orphaned_children`) with children that cannot be published: arguments
that do not fit their task, a stored message this relay cannot decode, a message that cannot be built. Each such
child is counted `rejected` and logged; every other orphaned child of the round is published, and the batch
finishes. The real relay code against the real PostgreSQL and Redis.
"""

from __future__ import annotations

import json
import logging
from datetime import timedelta
from typing import Any

import pytest
import redis
from celery import Celery
from sqlalchemy import Engine

from celery_fanin import FanIn, codec, protocol
from celery_fanin.dispatch import children as child_dispatch
from celery_fanin.relay import maintenance
from celery_fanin.store import batches
from tests.e2e import clock
from tests.sql import children as child_rows
from tests.store.helpers import Tasks, collecting_batch, fetch_all, queued_messages


def _batch(app: Celery, tasks: Tasks, stored: list[batches.Encoded], *, leaves: int, engine: Engine) -> list[str]:
    """A batch whose producer died before publishing any child (its published mark is 0); returns the task ids."""
    batch = collecting_batch(app, tasks)
    children = [batches.NewChild(f"{batch.id}-{i}", "tests.store.add", enc) for i, enc in enumerate(stored)]
    with engine.begin() as conn:
        batches.create_batch(conn, batch, children, leaves=leaves)
    return [c.task_id for c in children]


def _json(sig: Any) -> batches.Encoded:
    """A signature stored as JSON as it is, even with options no serializer could publish it with."""
    return batches.Encoded("application/json", "utf-8", json.dumps(dict(sig)).encode())


def _batch_of(engine: Engine, task_id: str) -> dict[str, Any]:
    with engine.connect() as conn:
        rows = fetch_all(
            conn,
            "SELECT r.id, r.state, r.planned, r.succeeded, r.failed, r.published_upto FROM fanin_children c"
            " JOIN fanin_batches b ON b.id = c.batch_id JOIN fanin_batches r ON r.id = coalesce(b.parent_id, b.id)"
            " WHERE c.task_id = :t",
            t=task_id,
        )
    return rows[0]


def _outcomes(db: Any, task_ids: list[str]) -> dict[str, tuple[str, str | None, str | None]]:
    rows = child_rows(db, None, "task_id", "state", "exc_type", "exc_message", task_ids=task_ids)
    return {r["task_id"]: (r["state"], r["exc_type"], r["exc_message"]) for r in rows}


def test_one_child_that_cannot_be_published_is_rejected_and_the_rest_of_the_round_goes_out(
    app: Celery, tasks: Tasks, store_engine: Engine, broker: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    app.conf.fanin_chunk_size = 10
    fanin = FanIn.of(app)
    # First batch: child 1 gives `add(x, y)` three arguments.
    first = _batch(
        app,
        tasks,
        [codec.encode_signature(app, tasks.add.s(0, 0)), codec.encode_signature(app, tasks.add.s(1, 2, 3))]
        + [codec.encode_signature(app, tasks.add.s(i, i)) for i in (2, 3)],
        leaves=0,
        engine=store_engine,
    )
    # Second, a tree: child 1's stored message is of a content type this relay does not accept, child 2's options
    # name a serializer that is not installed (only building its message fails).
    second = _batch(
        app,
        tasks,
        [
            codec.encode_signature(app, tasks.add.s(0, 0)),
            batches.Encoded("application/x-unknown", "binary", b"\x00\x01"),
            _json(tasks.add.s(2, 2).set(serializer="no-such-serializer")),
            codec.encode_signature(app, tasks.add.s(3, 3)),
        ],
        leaves=2,
        engine=store_engine,
    )
    third = _batch(
        app, tasks, [codec.encode_signature(app, tasks.add.s(i, i)) for i in range(2)], leaves=0, engine=store_engine
    )
    good = [first[0], first[2], first[3], second[0], second[3], *third]
    bad = {first[1]: "TypeError", second[1]: "ContentDisallowed", second[2]: "SerializerNotInstalled"}

    with caplog.at_level(logging.ERROR, logger="celery_fanin.dispatch"):
        assert child_dispatch.publish_orphaned_children(fanin) == len(good)
    messages = {m.headers["id"]: m for m in queued_messages(broker)}
    assert sorted(messages) == sorted(good + list(bad))  # every child once: itself, or a rejection in its place
    assert {t for t, m in messages.items() if m.headers["task"] == "tests.store.add"} == set(good)
    for task_id, why in bad.items():
        stand_in = messages[task_id]
        batch = _batch_of(store_engine, task_id)
        index = int(task_id.rsplit("-", 1)[1])
        assert stand_in.headers["task"] == protocol.UNPUBLISHABLE_TASK
        assert (stand_in.headers["fanin_batch"], stand_in.headers["fanin_index"]) == (str(batch["id"]), index)
        assert stand_in.headers["fanin_task"] == "tests.store.add"  # the report names the child's own task
        [reason] = stand_in.args
        assert reason.startswith(f"not published by the relay: {why}: ")
        # logged with its batch and task id, and why
        [record] = [r for r in caplog.records if task_id in r.getMessage()]
        assert str(batch["id"]) in record.getMessage() and why in record.getMessage()
    assert "positional argument" in messages[first[1]].args[0]
    assert _outcomes(store_engine, list(bad)) == {t: ("pending", None, None) for t in bad}  # a worker counts them

    # Done with: the next round finds nothing to publish, and publishes nothing twice.
    for task_id in first + second + third:
        batch = _batch_of(store_engine, task_id)
        assert batch["published_upto"] == batch["planned"]
    assert child_dispatch.publish_orphaned_children(fanin) == 0
    assert len(queued_messages(broker)) == len(good) + len(bad)


def test_a_producer_publishing_its_own_batch_still_raises(app: Celery, tasks: Tasks, store_engine: Engine) -> None:
    """Only the relay publishes a rejection in a child's place: a producer's own publishing (after the caller's
    transaction, or resuming a keyed batch) raises as `apply_async` would, and leaves the child to the relay."""
    ids = _batch(app, tasks, [codec.encode_signature(app, tasks.add.s(1, 2, 3))], leaves=0, engine=store_engine)
    batch_id = _batch_of(store_engine, ids[0])["id"]
    with FanIn.of(app).engine.connect() as conn, pytest.raises(TypeError, match="positional argument"):
        child_dispatch.publish_remaining_children(FanIn.of(app), conn, batch_id)
    assert _batch_of(store_engine, ids[0])["published_upto"] == 0


def test_a_rejection_goes_where_its_child_would_have(
    app: Celery, tasks: Tasks, store_engine: Engine, broker: redis.Redis
) -> None:
    """To the child's own queue (the workers that serve its task take it), else to its task's route."""
    app.conf.task_routes = {"tests.store.add": {"queue": "routed"}}
    ids = _batch(
        app,
        tasks,
        [
            codec.encode_signature(app, tasks.add.s(1, 2, 3).set(queue="own")),
            batches.Encoded("application/x-unknown", "binary", b"\x00"),
        ],
        leaves=0,
        engine=store_engine,
    )
    assert child_dispatch.publish_orphaned_children(FanIn.of(app)) == 0  # no child itself, two rejections
    [own] = queued_messages(broker, "own")
    [routed] = queued_messages(broker, "routed")
    assert (own.headers["id"], routed.headers["id"]) == tuple(ids)
    assert {own.headers["task"], routed.headers["task"]} == {protocol.UNPUBLISHABLE_TASK}


def test_a_lost_child_whose_message_cannot_be_built_is_redriven_as_a_rejection_and_the_round_goes_on(
    app: Celery, tasks: Tasks, store_engine: Engine, broker: redis.Redis
) -> None:
    """Redriving a lost child publishes its stored message again; one that no longer decodes goes out as a
    rejection under its task id (a worker counts it `rejected`), and the lost children after it are redriven in
    the same round."""
    batch = collecting_batch(app, tasks, child_timeout=timedelta(hours=1), on_lost="redrive", max_redrives=3)
    stored = [
        batches.Encoded("application/x-unknown", "binary", b"\x00\x01"),
        codec.encode_signature(app, tasks.add.s(1, 1)),
    ]
    children = [batches.NewChild(f"{batch.id}-{i}", "tests.store.add", enc) for i, enc in enumerate(stored)]
    with store_engine.begin() as conn:
        batches.create_batch(conn, batch, children, leaves=0)
        batches.mark_published(conn, batch.id, None)  # published by its producer, then lost
    clock.expire_child_timeout(app, str(batch.id))

    report = maintenance.handle_lost_children(FanIn.of(app))

    assert sorted(report.redriven) == sorted(c.task_id for c in children) and report.failed == []
    messages = {m.headers["id"]: m for m in queued_messages(broker)}
    assert sorted(messages) == sorted(c.task_id for c in children)
    stand_in, redriven = messages[children[0].task_id], messages[children[1].task_id]
    assert stand_in.headers["task"] == protocol.UNPUBLISHABLE_TASK
    assert stand_in.headers["fanin_task"] == "tests.store.add"
    assert (stand_in.headers["fanin_batch"], stand_in.headers["fanin_index"]) == (str(batch.id), 0)
    assert stand_in.args[0].startswith("not published by the relay: ContentDisallowed: ")
    assert (redriven.headers["task"], redriven.args) == ("tests.store.add", [1, 1])
    assert _outcomes(store_engine, [c.task_id for c in children]) == {
        c.task_id: ("pending", None, None) for c in children
    }
