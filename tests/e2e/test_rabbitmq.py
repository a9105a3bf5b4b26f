"""RabbitMQ end to end, where its behaviour is its own: duplicate deliveries through a real prefork worker, and a
real broker refusing messages (`basic.nack`). Real workers, the relay and PostgreSQL.

Duplicates: a child's message published twice, and an acks_late message redelivered after its pool process was
SIGKILLed. Each run of the body is counted in PostgreSQL (`e2e_attempts`), so "it ran twice" is observed, not
assumed; the copies wait on a queue the worker consumes only once both are there (tests/e2e/holds.py).

Refusals: RabbitMQ nacks a confirmed publish routed to a queue at its `x-max-length` with `x-overflow:
reject-publish`. The tests route a successor, or a child, to such a queue (length 0: it refuses everything;
through `amq.direct`, so that nobody declares it with other arguments), check that the broker really refuses, and
later "heal" it (the queue declared again without a limit) and let a worker consume it. What the library must
do: keep the refused message's row unsent and retry it, publish everything else meanwhile (a refusal is one
message's failure, not a broker outage), and once the broker accepts it, run it once.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import amqp
import psycopg
import pytest
from celery import chain

from celery_fanin import ChordHeaderFailed, chord, fan_in_group
from celery_fanin.broker import publish
from celery_fanin.codec import decode_signature
from celery_fanin.store.batches import Encoded
from tests import app as tasks
from tests.e2e import holds
from tests.e2e.brokers import on_broker
from tests.sql import attempts, batch, child, counters, rows, unpublish
from tests.workers import CeleryProcess, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(150)]

Runs = Callable[[str], list[dict[str, Any]]]


@pytest.fixture
def e2e_env(e2e_env: dict[str, str]) -> Iterator[dict[str, str]]:
    with on_broker(e2e_env, "rabbitmq") as env:
        yield env


def _worker(processes: Any, env: dict[str, str], **kwargs: Any) -> Any:
    worker = processes.worker(**kwargs)
    assert "transport:   amqp://" in worker.output()  # on RabbitMQ, not the session's Redis
    return worker


def test_a_child_message_published_twice_runs_twice_and_counts_once(
    e2e_env: dict[str, str], producer: Any, processes: Any, successor_runs: Runs
) -> None:
    hold = f"{e2e_env['FANIN_TEST_QUEUE']}-hold"
    worker = _worker(processes, e2e_env)
    processes.relay()
    key = f"twice-{uuid.uuid4().hex[:8]}"
    handle = fan_in_group([tasks.counted_run.s(key).set(queue=hold), tasks.ok.s(1)], then=tasks.record_run.s("dup"))
    handle = handle.apply_async()
    # The child's stored message published once more, as a redelivery or a republishing relay would send it.
    [stored] = rows(
        producer,
        "SELECT task_id, message, content_type, content_encoding FROM fanin_children WHERE batch_id = :b AND idx = 0",
        b=handle.batch_id,
    )
    sig = decode_signature(producer, Encoded(stored.content_type, stored.content_encoding, bytes(stored.message)))
    with publish.producer(producer) as prod:
        publish.publish_children(producer, prod, handle.batch_id, [(0, stored.task_id, sig)])  # waits for the confirm
    holds.consume(producer, worker, hold)  # both copies are on the queue now

    status = handle.wait_batch(timeout=60)
    assert (status.planned, status.succeeded, status.failed, status.remaining) == (2, 2, 0, 0)
    wait_for(lambda: attempts(producer, key) == 2, 30, message="the second copy to run")
    late = wait_for(lambda: (c := child(producer, handle.batch_id, 0)).late_reports and c, 30, message="late report")
    assert (late.state, late.late_state, late.late_reports) == ("succeeded", "succeeded", 1)
    assert counters(producer, handle.batch_id) == ("complete", 0, 2, 0)  # the second report moved nothing
    assert len(successor_runs(handle.batch_id)) == 1


def test_an_acks_late_redelivery_after_a_killed_pool_process_counts_once(
    e2e_env: dict[str, str], producer: Any, processes: Any, successor_runs: Runs
) -> None:
    _worker(processes, e2e_env, extra_env={"FANIN_TEST_ACKS_LATE": "1"})
    processes.relay()
    key = f"redelivered-{uuid.uuid4().hex[:8]}"
    handle = fan_in_group([tasks.die_once_pg.s(key), tasks.ok.s(1)], then=tasks.record_run.s("redelivered"))
    handle = handle.apply_async()
    status = handle.wait_batch(timeout=60)
    assert (status.succeeded, status.failed, status.remaining) == (2, 0, 0)
    assert attempts(producer, key) == 2  # killed in its first run, redelivered by RabbitMQ, run to the end
    row = child(producer, handle.batch_id, 0)
    assert (row.state, row.late_state, row.late_reports) == ("succeeded", None, 0)  # the lost run not counted
    [run] = successor_runs(handle.batch_id)
    assert (run["outcome"]["succeeded"], run["outcome"]["failed"]) == (2, 0)


# --- a real basic.nack ----------------------------------------------------------------------------------------------


@pytest.fixture
def refusing(e2e_env: dict[str, str]) -> Iterator[str]:
    """A queue RabbitMQ refuses every message for (bound to `amq.direct`); deleted with the test's queues."""
    name = f"{e2e_env['FANIN_TEST_QUEUE']}-refuse"
    with _channel() as channel:
        channel.queue_declare(
            name, durable=True, auto_delete=False, arguments={"x-max-length": 0, "x-overflow": "reject-publish"}
        )
        channel.queue_bind(name, "amq.direct", name)
        channel.confirm_select()  # the fault is real: a confirmed publish to it is nacked
        with pytest.raises(amqp.exceptions.MessageNacked):
            channel.basic_publish_confirm(amqp.Message(b"probe"), exchange="amq.direct", routing_key=name)
    yield name


@contextlib.contextmanager
def _channel() -> Iterator[Any]:
    """A channel on a connection of its own to the test's RabbitMQ (py-amqp: confirms and queue arguments as is)."""
    conn = amqp.Connection("127.0.0.1:5672", userid="guest", password="guest")
    conn.connect()
    try:
        yield conn.channel()
    finally:
        conn.close()


def _heal(app: Any, worker: CeleryProcess, queue: str) -> None:
    """The queue accepts messages again (declared anew without a limit), and `worker` consumes it."""
    with _channel() as channel:
        channel.queue_delete(queue)
        channel.queue_declare(queue, durable=True, auto_delete=False)  # as Celery declares it
        channel.queue_bind(queue, "amq.direct", queue)
    holds.consume(app, worker, queue)


def _outbox(app: Any, batch_id: str) -> Any:
    [row] = rows(app, "SELECT sent_at, attempts, last_error FROM fanin_outbox WHERE batch_id = :b", b=batch_id)
    return row


def test_a_refused_successor_stays_unsent_and_is_retried_while_the_others_are_published(
    producer: Any, processes: Any, successor_runs: Runs, refusing: str
) -> None:
    worker = processes.worker({"FANIN_TEST_SUCCESSOR_INLINE": "0"})  # about publishing: none run where completed
    relay = processes.relay()
    refused = fan_in_group(
        [tasks.ok.s(0)], then=tasks.record_run.s("refused").set(exchange="amq.direct", routing_key=refusing)
    ).apply_async()
    wait_for(lambda: refused.batch_status().state == "complete", 30, message="the first batch's children")
    other = fan_in_group([tasks.ok.s(1)], then=tasks.record_run.s("other")).apply_async()

    # The refused row is retried (each attempt counted, its error kept), and it holds nothing else back.
    row = wait_for(lambda: (r := _outbox(producer, refused.batch_id)).attempts >= 2 and r, 60, message="2 refusals")
    assert row.sent_at is None and "basic.nack" in row.last_error
    status = other.wait_batch(timeout=30)
    assert (status.successor_state, status.successor_runs, status.successor_duplicates) == ("succeeded", 1, 0)
    assert refused.batch_status().successor_state == "pending"
    assert "the broker refused the successor of batch_id=" + refused.batch_id in relay.output()

    _heal(producer, worker, refusing)
    rows(producer, "UPDATE fanin_outbox SET available_at = now() WHERE batch_id = :b", b=refused.batch_id)  # backoff
    status = refused.wait_batch(timeout=30)
    assert (status.successor_state, status.successor_runs, status.successor_duplicates) == ("succeeded", 1, 0)
    assert [r["label"] for r in successor_runs(refused.batch_id)] == ["refused"]
    assert _outbox(producer, refused.batch_id).sent_at is not None
    assert len(successor_runs(other.batch_id)) == 1


def test_refused_children_are_published_by_the_relay_once_accepted_and_hold_no_other_batch_back(
    e2e_env: dict[str, str], producer: Any, processes: Any, successor_runs: Runs, refusing: str
) -> None:
    worker = processes.worker()
    children = [tasks.ok.s(0).set(exchange="amq.direct", routing_key=refusing), tasks.ok.s(1)]
    refused = fan_in_group(children, then=tasks.record_run.s("refused")).apply_async()  # the warning, no exception
    mark = batch(producer, refused.batch_id, "published_upto")
    assert mark["published_upto"] == 0  # the chunk holding the refused child is not recorded as published
    # A second batch the relay must publish too, after the refused one: its producer "died" before publishing (its
    # child's message is taken off the queue nobody consumes yet, and the batch marked unpublished).
    hold = f"{e2e_env['FANIN_TEST_QUEUE']}-hold"
    orphan = fan_in_group([tasks.ok.s(2).set(queue=hold)], then=tasks.record_run.s("orphan")).apply_async()
    with _channel() as channel:
        assert channel.queue_purge(hold) == 1
    unpublish(producer, orphan.batch_id)

    relay = processes.relay()
    holds.consume(producer, worker, hold)
    status = orphan.wait_batch(timeout=30)  # published by the relay although the batch before it is refused
    assert (status.succeeded, status.successor_runs) == (1, 1)
    refusals = f"the broker refused children of batch_id={refused.batch_id}"
    wait_for(lambda: relay.output().count(refusals) >= 2, 60, message="two refused attempts")
    assert refused.batch_status().state == "running" and refused.batch_status().succeeded <= 1

    _heal(producer, worker, refusing)
    status = refused.wait_batch(timeout=60)  # the relay's next attempt (after its backoff) is accepted
    assert (status.planned, status.succeeded, status.failed, status.successor_runs) == (2, 2, 0, 1)
    assert len(successor_runs(refused.batch_id)) == 1
    mark = batch(producer, refused.batch_id, "published_upto")
    assert mark["published_upto"] == 2


def test_a_replacement_failing_before_its_carrier_ends_its_child_and_its_successor(
    e2e_env: dict[str, str], producer: Any, processes: Any
) -> None:
    """On RabbitMQ as on Redis (tests/e2e/test_canvas.py): a child replaced by a chain whose second task fails is
    counted failed, and a `then=` chain whose middle task fails ends the successor with that task's error."""
    _worker(processes, e2e_env)
    processes.relay()
    handle = fan_in_group(
        [tasks.ok.s(1), tasks.replacing_child_failing.s(2)],
        then=chain(tasks.values.s(), tasks.fail.si(7), tasks.identity.s()),
    ).apply_async()
    with pytest.raises(ValueError, match="child 7 failed on purpose"):
        handle.get(timeout=60)
    assert counters(producer, handle.batch_id) == ("complete", 0, 1, 1)
    [succ] = rows(producer, "SELECT state, exc_type FROM fanin_successors WHERE batch_id = :b", b=handle.batch_id)
    assert (succ.state, succ.exc_type) == ("failed", "ValueError")


def test_a_chord_on_rabbitmq_its_results_its_failed_header_and_a_rerun(
    e2e_env: dict[str, str], producer: Any, processes: Any
) -> None:
    """The drop-in chord (tests/e2e/test_chord.py runs it on Redis): the body gets the results in header order; a
    failed header task fails the body with ChordHeaderFailed and calls its errback once; a rerun of that body runs
    it once more, under its new task id (tests/e2e/test_rerun.py)."""
    url = e2e_env["FANIN_DATABASE_URL"]
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(tasks.NOTES_TABLE_DDL)
        conn.execute("TRUNCATE e2e_notes")
    _worker(processes, e2e_env, concurrency=2)
    processes.relay()
    assert chord([tasks.identity.s(i) for i in range(6)], tasks.identity.s()).apply_async().get(timeout=60) == list(
        range(6)
    )
    body = tasks.identity.s()
    body.link_error(tasks.note.si("body errback", "errback"))
    handle = chord([tasks.ok.s(1), tasks.fail.s(2)], body).apply_async()
    with pytest.raises(ChordHeaderFailed, match="1 of 2 header tasks succeeded"):
        handle.get(timeout=60)

    def notes() -> list[tuple[str, Any]]:
        with psycopg.connect(url, autocommit=True) as conn:
            return [(r[0], r[1]) for r in conn.execute("SELECT label, value FROM e2e_notes ORDER BY id")]

    wait_for(lambda: notes() == [("errback", "body errback")], 60, message="the body's errback")
    rerun = handle.rerun()
    assert rerun.previous_state == "failed"
    with pytest.raises(ChordHeaderFailed):  # the header still has its failure: the body fails again, once
        handle.get(timeout=60)
    [succ] = rows(producer, "SELECT runs, state FROM fanin_successors WHERE batch_id = :b", b=handle.batch_id)
    assert (succ.runs, succ.state) == (2, "failed")
