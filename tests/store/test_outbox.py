"""The outbox: claims never overlap (SKIP LOCKED), mark_sent / mark_failed bookkeeping, and what publish_outbox sends.

Outbox rows are made the way production makes them: an empty batch writes its successor and outbox row at creation,
and the last terminal report of a batch writes them when it completes.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import redis
from celery import Celery
from sqlalchemy import Connection, Engine, text

from celery_fanin import FanIn, codec
from celery_fanin.dispatch import successors as successor_dispatch
from celery_fanin.store import batches, outbox, queries
from celery_fanin.store.reports import record_terminal
from tests.sql import Held, successor

from .helpers import QUEUE, Tasks, create, fetch_all, fetch_one, queued_messages

MakeRows = Callable[[int], list[int]]


@pytest.fixture
def make_outbox_rows(store_engine: Engine) -> MakeRows:
    """Create `n` completed (empty) batches and return their outbox row ids, oldest first."""

    def make(n: int) -> list[int]:
        ids = []
        for _ in range(n):
            _, _, outbox_id = create(store_engine, 0)
            assert outbox_id is not None
            ids.append(outbox_id)
        return ids

    return make


def _outbox(conn: Connection, outbox_id: int) -> dict[str, Any]:
    return fetch_one(
        conn,
        """
        SELECT o.id, o.sent_at, o.attempts, o.last_error, o.available_at, o.available_at - now() AS due_in,
               s.state AS successor_state
          FROM fanin_outbox o JOIN fanin_successors s ON s.batch_id = o.batch_id AND s.step = o.step
         WHERE o.id = :id
        """,
        id=outbox_id,
    )


# --- claim ---------------------------------------------------------------------------------------------------------


def test_claim_returns_due_rows_in_order_within_the_limit(store_engine: Engine, make_outbox_rows: MakeRows) -> None:
    ids = make_outbox_rows(5)
    with store_engine.begin() as conn:
        rows = outbox.claim(conn, 3)
        assert [r.id for r in rows] == ids[:3]
        assert all(r.attempts == 0 and r.step == "merge" for r in rows)
    with store_engine.begin() as conn:
        assert [r.id for r in outbox.claim(conn, 10, ids=[ids[4], ids[1]])] == [ids[1], ids[4]]
        assert outbox.claim(conn, 10, ids=[]) == []


def test_a_claimed_row_is_skipped_by_a_second_claimer_until_released(
    store_engine: Engine, make_outbox_rows: MakeRows
) -> None:
    ids = make_outbox_rows(20)
    with store_engine.connect() as a, store_engine.connect() as b:
        with a.begin() as tx_a:
            held = [r.id for r in outbox.claim(a, 8)]
            assert held == ids[:8]
            with b.begin():
                b.execute(text("SET LOCAL lock_timeout = '2s'"))  # a claim that waited would fail, not hang
                others = [r.id for r in outbox.claim(b, 100)]
                assert others == ids[8:]  # it did not wait for `a`: SKIP LOCKED
                assert outbox.claim(b, 100, ids=held) == []
            tx_a.rollback()  # the relay holding them died before marking them sent
        with b.begin():
            assert [r.id for r in outbox.claim(b, 100, ids=held)] == held


@pytest.mark.parametrize("round_", range(5))
def test_concurrent_claimers_never_get_the_same_row(
    store_engine: Engine, make_outbox_rows: MakeRows, round_: int
) -> None:
    ids = make_outbox_rows(20)
    claimers = 2
    barrier = threading.Barrier(claimers, timeout=10)
    claimed: list[list[int]] = [[] for _ in range(claimers)]
    errors: list[BaseException] = []

    def claim(i: int) -> None:
        try:
            with store_engine.connect() as conn, conn.begin():
                conn.execute(text("SET LOCAL lock_timeout = '2s'"))  # a claim that waited would fail, not hang
                barrier.wait()  # both start claiming together
                claimed[i] = [r.id for r in outbox.claim(conn, 15)]
                barrier.wait()  # and both still hold their locks while the other claims
        except BaseException as exc:
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=claim, args=(i,)) for i in range(claimers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    first, second = claimed
    assert set(first).isdisjoint(second), f"both claimed {sorted(set(first) & set(second))}"
    assert sorted(first + second) == ids  # and between them they took every due row


def test_claim_reads_each_rows_batch_and_successor_as_the_separate_reads_do(
    store_engine: Engine, make_outbox_rows: MakeRows
) -> None:
    ids = make_outbox_rows(3)
    with store_engine.begin() as conn:
        rows = outbox.claim(conn, 10)
        assert [r.id for r in rows] == ids
        for row in rows:
            assert row.batch is not None and row.batch.id == row.batch_id and row.batch.state == "complete"
            assert row.batch == queries.batch(conn, row.batch_id)
            assert row.successor is not None and row.successor.state == "pending"
            assert row.successor == queries.successor(conn, row.batch_id, row.step)


def test_claim_locks_the_outbox_rows_and_not_their_batches_or_successors(
    store_engine: Engine, make_outbox_rows: MakeRows
) -> None:
    """A worker may hold the successor's row (its start guard) or a batch's row while the relay claims."""
    [outbox_id] = make_outbox_rows(1)
    with store_engine.connect() as other, other.begin():
        other.execute(text("SELECT 1 FROM fanin_batches b JOIN fanin_successors s ON s.batch_id = b.id FOR UPDATE"))
        with store_engine.begin() as conn:
            conn.execute(text("SET LOCAL lock_timeout = '2s'"))
            assert [r.id for r in outbox.claim(conn, 10)] == [outbox_id]


# --- mark_sent / mark_failed -----------------------------------------------------------------------------------------


def test_mark_sent_sets_sent_at_and_moves_a_pending_successor_to_sent(
    store_engine: Engine, make_outbox_rows: MakeRows
) -> None:
    ids = make_outbox_rows(3)
    with store_engine.begin() as conn:
        rows = outbox.claim(conn, 2)
        outbox.mark_sent(conn, rows)
        outbox.mark_sent(conn, [])  # nothing to do, and no error
    with store_engine.connect() as conn:
        sent = [_outbox(conn, i) for i in ids[:2]]
        untouched = _outbox(conn, ids[2])
    assert all(r["sent_at"] is not None and r["attempts"] == 1 and r["successor_state"] == "sent" for r in sent)
    assert (untouched["sent_at"], untouched["attempts"], untouched["successor_state"]) == (None, 0, "pending")
    with store_engine.begin() as conn:
        assert [r.id for r in outbox.claim(conn, 10)] == [ids[2]]  # sent rows are never claimed again


@pytest.mark.parametrize(("durable", "commit_mode"), [(True, "on"), (False, "off")])
def test_mark_sent_not_durable_commits_without_waiting_for_the_wal_flush(
    store_engine: Engine, make_outbox_rows: MakeRows, durable: bool, commit_mode: str
) -> None:
    """Not durable, the mark's transaction (only) commits asynchronously: the lock on the successor's row, which a
    start guard may be waiting on, goes at once; the rows are marked all the same (docs/concepts/outbox.md)."""
    [outbox_id] = make_outbox_rows(1)
    with store_engine.connect() as conn:
        # On for the session whatever the server's default (the embedded test server's is off), so that both
        # the transaction's setting and its end are seen.
        conn.execute(text("SET synchronous_commit = on"))
        conn.commit()
        with conn.begin():
            outbox.mark_sent(conn, outbox.claim(conn, 1), durable=durable)
            assert conn.execute(text("SHOW synchronous_commit")).scalar_one() == commit_mode
        assert conn.execute(text("SHOW synchronous_commit")).scalar_one() == "on"  # that transaction's alone
        conn.rollback()
        conn.execute(text("RESET synchronous_commit"))
        conn.commit()
        row = _outbox(conn, outbox_id)
    assert row["sent_at"] is not None and row["successor_state"] == "sent"


@pytest.mark.parametrize("later", ["running", "retrying", "succeeded", "failed", "revoked"])
def test_mark_sent_never_overrides_a_later_successor_state(
    store_engine: Engine, make_outbox_rows: MakeRows, later: str
) -> None:
    [outbox_id] = make_outbox_rows(1)
    with store_engine.connect() as relay, relay.begin():
        rows = outbox.claim(relay, 1)
        # The worker was faster than the relay's commit: the successor started (and maybe finished) already.
        with store_engine.begin() as worker:
            worker.execute(
                text(
                    "UPDATE fanin_successors s SET state = :state FROM fanin_outbox o"
                    " WHERE o.id = :id AND s.batch_id = o.batch_id AND s.step = o.step"
                ),
                {"state": later, "id": outbox_id},
            )
        outbox.mark_sent(relay, rows)
    with store_engine.connect() as conn:
        row = _outbox(conn, outbox_id)
    assert row["sent_at"] is not None
    assert row["successor_state"] == later


def test_mark_failed_keeps_the_row_pending_and_not_claimable_until_its_backoff(
    store_engine: Engine, make_outbox_rows: MakeRows
) -> None:
    [outbox_id] = make_outbox_rows(1)
    with store_engine.begin() as conn:
        [row] = outbox.claim(conn, 10)
        outbox.mark_failed(conn, row, "ConnectionError: " + "x" * 5000, 30.0)
        marked_at = conn.execute(text("SELECT now()")).scalar_one()  # the clock mark_failed's statement read
    with store_engine.connect() as conn:
        after = _outbox(conn, outbox_id)
        assert outbox.backlog(conn)[0] == 1
    assert (after["sent_at"], after["attempts"], after["successor_state"]) == (None, 1, "pending")
    assert after["last_error"].startswith("ConnectionError: xxx")
    assert len(after["last_error"]) == 2000
    assert after["available_at"] - marked_at == timedelta(seconds=30)  # exactly the backoff, not a window
    with store_engine.begin() as conn:
        assert outbox.claim(conn, 10) == []
        assert outbox.claim(conn, 10, ids=[outbox_id]) == []

    # Only the backoff holds it back: once due, it is claimed again with its attempt counted.
    with store_engine.begin() as conn:
        conn.execute(
            text("UPDATE fanin_outbox SET available_at = now() - interval '1 second' WHERE id = :id"), {"id": outbox_id}
        )
    with store_engine.begin() as conn:
        again = outbox.claim(conn, 10)
    assert [(r.id, r.attempts) for r in again] == [(outbox_id, 1)]


# --- publish_outbox ---------------------------------------------------------------------------------------------------

# (state, exc_type, exc_message) per child index; five of the eight fail.
CHILD_OUTCOMES: list[tuple[str, str | None, str | None]] = [
    ("succeeded", None, None),
    ("failed", "ValueError", "bad row 1"),
    ("succeeded", None, None),
    ("time_limit", "TimeLimitExceeded", "TimeLimitExceeded(30)"),
    ("revoked", None, None),
    ("succeeded", None, None),
    ("worker_lost", "WorkerLostError", "Worker exited prematurely: signal 9 (SIGKILL)."),
    ("failed", "KeyError", "'partner'"),
]


def _completed_batch(
    app: Celery, tasks: Tasks, store_engine: Engine
) -> tuple[batches.NewBatch, list[batches.NewChild]]:
    """A batch created and completed through the store, its successor waiting in the outbox."""
    batch = batches.NewBatch(
        id=uuid.uuid4(),
        step="report",
        successor_task_id=f"succ-{uuid.uuid4()}",
        successor_name="tests.store.collect",
        successor_message=codec.encode_signature(app, tasks.collect.s("extra", flag=True)),
    )
    children = [
        batches.NewChild(f"{batch.id}-{i}", "tests.store.add", codec.encode_signature(app, tasks.add.s(i, i)))
        for i in range(len(CHILD_OUTCOMES))
    ]
    with store_engine.begin() as conn:
        batches.create_batch(conn, batch, children)
    for child, (state, exc_type, exc_message) in zip(children, CHILD_OUTCOMES, strict=True):
        with store_engine.begin() as conn:
            result = codec.encode_result(app, 42) if state == "succeeded" else None
            record_terminal(Held(conn), child.task_id, state, result=result, exc_type=exc_type, exc_message=exc_message)
    return batch, children


@pytest.mark.parametrize(("limit", "listed"), [(3, 3), (5, 5), (100, 5)])
def test_publish_outbox_sends_the_successor_with_the_outcome_first(
    app: Celery, tasks: Tasks, store_engine: Engine, broker: redis.Redis, limit: int, listed: int
) -> None:
    app.conf.fanin_outcome_failures_limit = limit
    batch, children = _completed_batch(app, tasks, store_engine)

    assert successor_dispatch.publish_outbox(FanIn.of(app)) == 1

    [message] = queued_messages(broker)
    assert broker.llen(QUEUE) == 1
    assert message.headers["task"] == "tests.store.collect"
    assert message.headers["id"] == batch.successor_task_id
    assert message.headers["fanin_successor"] == str(batch.id)
    assert message.headers["fanin_step"] == "report"
    outcome, *own_args = message.args
    assert own_args == ["extra"]  # the successor's own arguments follow the outcome
    assert message.kwargs == {"flag": True}

    expected_failures = [
        {
            "index": i,
            "task_id": children[i].task_id,
            "task_name": "tests.store.add",
            "state": state,
            "exc_type": exc_type,
            "exc_message": exc_message,
        }
        for i, (state, exc_type, exc_message) in enumerate(CHILD_OUTCOMES)
        if state != "succeeded"
    ]
    assert len(expected_failures) == 5
    assert {k: outcome[k] for k in ("batch_id", "step", "state", "planned", "succeeded", "failed")} == {
        "batch_id": str(batch.id),
        "step": "report",
        "state": "complete",
        "planned": 8,
        "succeeded": 3,
        "failed": 5,
    }
    fields = ("index", "task_id", "task_name", "state", "exc_type", "exc_message")
    assert [{k: f[k] for k in fields} for f in outcome["failures"]] == expected_failures[:listed]
    assert outcome["failures_truncated"] is (listed < len(expected_failures))

    with store_engine.connect() as conn:
        out = fetch_one(conn, "SELECT sent_at, attempts FROM fanin_outbox WHERE batch_id = :id", id=batch.id)
        succ = successor(conn, batch.id, "state")
    assert out["sent_at"] is not None and out["attempts"] == 1
    assert succ["state"] == "sent"

    assert successor_dispatch.publish_outbox(FanIn.of(app)) == 0  # sent rows are not published again
    assert broker.llen(QUEUE) == 1


def test_publish_outbox_only_publishes_the_ids_asked_for(
    app: Celery, tasks: Tasks, store_engine: Engine, broker: redis.Redis, make_outbox_rows: MakeRows
) -> None:
    ids = make_outbox_rows(3)
    assert successor_dispatch.publish_outbox(FanIn.of(app), ids=[ids[1]]) == 1
    with store_engine.connect() as conn:
        rows = fetch_all(conn, "SELECT id, sent_at IS NOT NULL AS sent FROM fanin_outbox ORDER BY id")
    assert rows == [{"id": ids[0], "sent": False}, {"id": ids[1], "sent": True}, {"id": ids[2], "sent": False}]
    assert broker.llen(QUEUE) == 1


def test_publish_outbox_with_the_broker_down_raises_and_rolls_the_claim_back(
    dead_broker_app: Celery,
    app: Celery,
    tasks: Tasks,
    store_engine: Engine,
    broker: redis.Redis,
    make_outbox_rows: MakeRows,
) -> None:
    """The relay's caller sees the broker error (it backs off); the row is left exactly as it was, so the next
    pass with a broker publishes it at once, without a backoff or an attempt counted against it."""
    [outbox_id] = make_outbox_rows(1)
    kept = ("sent_at", "successor_state", "attempts", "last_error", "available_at")
    with store_engine.connect() as conn:
        before = _outbox(conn, outbox_id)
    with pytest.raises(successor_dispatch.BROKER_ERRORS):
        successor_dispatch.publish_outbox(FanIn.of(dead_broker_app))
    with store_engine.connect() as conn:
        after = _outbox(conn, outbox_id)
    assert {k: after[k] for k in kept} == {k: before[k] for k in kept}
    assert before["sent_at"] is None and before["successor_state"] == "pending"
    assert broker.llen(QUEUE) == 0
    assert successor_dispatch.publish_outbox(FanIn.of(app)) == 1  # the same row, on the broker that is up
    assert broker.llen(QUEUE) == 1
