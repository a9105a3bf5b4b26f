"""RabbitMQ: every message recorded as published was confirmed by the broker, whichever path published it.

Children the fast path does not model (a `link`, `fanin_bulk_publish = False`...) go through Celery's own
`apply_async`, and successors are published by the relay: both on the confirm channel, and recorded (the batch's
`published_upto`, the outbox row's `sent_at`) only once the broker confirmed them. Here the broker's confirms are
turned into refusals (basic.nack) in front of the producer, as tests/broker/test_confirms.py scripts them: nothing may
be recorded, and the relay publishes it all once the broker confirms again (a refused successor after its
outbox row's backoff).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery, chain
from kombu import Connection
from sqlalchemy import text

from celery_fanin import FanIn, fan_in_group
from celery_fanin.broker.confirms import BrokerRefused, ConfirmChannel
from celery_fanin.dispatch import children as child_dispatch
from celery_fanin.relay import Relay
from celery_fanin.store import outbox
from tests import publish_tasks
from tests.sql import child_ids

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]

RABBITMQ_URL = "amqp://guest:guest@127.0.0.1:5672//"


@pytest.fixture
def app(e2e_env: dict[str, str]) -> Iterator[Celery]:
    queue = f"fanin-confirm-{uuid.uuid4().hex[:10]}"
    application = Celery("tests.app", broker=RABBITMQ_URL, set_as_current=False)
    application.conf.update(
        fanin_database_url=e2e_env["FANIN_DATABASE_URL"],
        task_default_queue=queue,
        broker_connection_retry_on_startup=False,
    )
    publish_tasks.register(application)
    FanIn(application)
    yield application
    FanIn.of(application).dispose()
    with Connection(RABBITMQ_URL) as conn:
        conn.default_channel.queue_delete(queue)


def _refuse_confirms(monkeypatch: pytest.MonkeyPatch) -> None:
    """The broker refuses every message from now on (each ack becomes a nack), on confirm channels opened later
    (a channel that saw a refusal is closed, so the next one after `undo` is acked again)."""
    real = ConfirmChannel._on_ack

    def on_ack(self: ConfirmChannel, tag: int, multiple: bool) -> None:
        first = self.floor + 1 if multiple else tag
        self._nacked.update(t for t in range(first, tag + 1) if t not in self._acked)
        real(self, tag, multiple)

    monkeypatch.setattr(ConfirmChannel, "_on_ack", on_ack)
    # kombu's connection pools are shared by apps with the same broker URL: a confirm channel an earlier test left
    # on a pooled connection was opened with the real handler, so none is reused while the broker refuses.
    monkeypatch.setattr(ConfirmChannel, "usable", property(lambda self: False))


def _queued(app: Celery) -> list[dict[str, Any]]:
    """Drain the app's queue, returning each message's headers."""
    found = []
    with Connection(RABBITMQ_URL) as conn:
        channel = conn.default_channel
        while (message := channel.basic_get(app.conf.task_default_queue, no_ack=True)) is not None:
            found.append(dict(message.headers))
    return found


@pytest.mark.parametrize("path", ["link", "bulk_off"])
def test_children_published_by_celery_are_recorded_only_once_confirmed(
    app: Celery, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    echo = app.tasks[publish_tasks.ECHO]
    if path == "bulk_off":
        app.conf.fanin_bulk_publish = False
        children = [echo.s(i) for i in range(3)]
    else:  # a link is an option the fast path leaves to Celery, and a chain is Celery's own
        children = [echo.s(0).set(link=echo.s()), chain(echo.s(1), echo.s()), echo.s(2).set(link=echo.s())]
    _refuse_confirms(monkeypatch)
    handle = fan_in_group(children, then=echo.s(), app=app).apply_async()
    assert handle.batch_status().published == 0, "refused by the broker, yet recorded as published"
    monkeypatch.undo()  # the refused confirm channel was closed: the next publish opens one the broker acks
    assert Relay(FanIn.of(app)).run_once() >= 3
    assert handle.batch_status().published == 3
    assert sorted({h["fanin_index"] for h in _queued(app)}) == [0, 1, 2]


@pytest.mark.parametrize("path", ["fast", "celery"])
def test_a_successor_is_recorded_sent_only_once_confirmed(
    app: Celery, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    echo = app.tasks[publish_tasks.ECHO]
    then = echo.s("x") if path == "fast" else echo.s("x").set(link=echo.s())
    _refuse_confirms(monkeypatch)
    handle = fan_in_group([], then=then, app=app).apply_async()  # an empty group: its successor is due at once
    fanin = FanIn.of(app)
    with fanin.engine.begin() as conn:
        assert len(outbox.pending_ids(conn, uuid.UUID(handle.batch_id))) == 1, "refused, yet recorded as sent"
        # A refusal is the row's own failure: counted, its error kept, retried after its backoff (moved to now).
        row = conn.execute(
            text("UPDATE fanin_outbox SET available_at = now() WHERE batch_id = :b RETURNING attempts, last_error"),
            {"b": handle.batch_id},
        ).one()
    assert row.attempts == 1 and "basic.nack" in row.last_error
    monkeypatch.undo()
    assert Relay(fanin).run_once() == 1
    with fanin.engine.connect() as conn:
        assert outbox.pending_ids(conn, uuid.UUID(handle.batch_id)) == []
    assert [h.get("fanin_successor") for h in _queued(app)][-1] == handle.batch_id


def _queued_messages(app: Celery) -> list[tuple[dict[str, Any], Any]]:
    """Drain the app's queue, returning each message's headers and decoded body."""
    found = []
    with Connection(RABBITMQ_URL) as conn:
        channel = conn.default_channel
        while (message := channel.basic_get(app.conf.task_default_queue, no_ack=True)) is not None:
            found.append((dict(message.headers), json.loads(message.body)))
    return found


def test_a_chain_childs_first_message_is_recorded_only_once_confirmed(
    app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Celery's `chain.run` drops the `producer` it is given (it publishes the first task with a producer of its
    own, from the pool): a chain child must still go out on the confirm channel, by the producer and by the relay
    republishing it, and be recorded only once the broker confirmed it."""
    echo = app.tasks[publish_tasks.ECHO]
    children = [chain(echo.s(1), echo.s()), chain(echo.s(2), chain(echo.s(), echo.s()))]  # the second nested
    _refuse_confirms(monkeypatch)
    handle = fan_in_group(children, then=echo.s(), app=app).apply_async()
    assert handle.batch_status().published == 0, "a chain child refused by the broker, yet recorded as published"
    fanin = FanIn.of(app)
    with pytest.raises(BrokerRefused):  # the relay republishes an orphaned chain child the same way
        child_dispatch.publish_orphaned_children(fanin)
    assert handle.batch_status().published == 0, "republished by the relay, refused, yet recorded as published"
    monkeypatch.undo()
    assert Relay(fanin).run_once() == 2
    assert handle.batch_status().published == 2
    ids = child_ids(fanin.app, handle.batch_id)
    # Each chain's first task (its message only: the worker publishes the next), with the rest of the chain in the
    # body, the last task carrying the child's own task id; every publish (three here) carried the same ids.
    messages = _queued_messages(app)
    assert len(messages) == 6
    for headers, body in messages:
        idx = headers["fanin_index"]
        assert headers["fanin_chain"] == ids[idx]
        rest = body[2]["chain"]  # Celery's `chain` option: the remaining tasks, last first
        assert len(rest) == [1, 2][idx]
        assert rest[0]["options"]["task_id"] == ids[idx]
        assert headers["id"] != ids[idx]
    assert len({h["id"] for h, _ in messages}) == 2, "a republished chain child reuses its tasks' ids"
