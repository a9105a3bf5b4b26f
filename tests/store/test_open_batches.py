"""Open (streaming) batches end however their producer does: the relay's lease duty, seal, cancel, deadlines and
reconciliation, each against Postgres only."""

from __future__ import annotations

import uuid
from dataclasses import replace
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from celery import Celery
from sqlalchemy import Engine, text

from celery_fanin import BatchNotFound, BatchNotOpen, FanIn
from celery_fanin.producer import actions
from celery_fanin.store import batches, recovery
from celery_fanin.store.reports import record_terminal
from tests.sql import Held, batch
from tests.sql import successor as successor_row

from .helpers import fetch_all, json_encoded, new_batch


def _open(
    engine: Engine, n: int, *, leaves: int = 0, **options: Any
) -> tuple[batches.NewBatch, list[batches.NewChild], list[uuid.UUID]]:
    """An open batch as a streaming producer leaves it: `n` children written (spread over `leaves` leaves, if any),
    its token still held."""
    batch, children = new_batch(n)
    batch = replace(batch, **options)
    leaf_ids = [uuid.uuid4() for _ in range(leaves)]
    with engine.begin() as conn:
        batches.insert_batch(conn, batch, state="open", planned=0)
        for leaf_id in leaf_ids:
            batches.add_leaf(conn, batch, leaf_id)
        targets = [leaf_ids[i % leaves] if leaves else batch.id for i in range(n)]
        placed = [(target, child, i) for i, (target, child) in enumerate(zip(targets, children, strict=True))]
        if placed:
            assert batches.add_children(conn, batch.id, placed, b"digest", opened=len(leaf_ids))
    return batch, children, leaf_ids


def _row(engine: Engine, batch_id: uuid.UUID) -> dict[str, Any]:
    return batch(engine, batch_id)


def _age(engine: Engine, batch_id: uuid.UUID, seconds: float) -> None:
    """Make the producer's last sign of life `seconds` old (instead of waiting that long)."""
    with engine.begin() as conn:
        conn.execute(
            text("UPDATE fanin_batches SET producer_seen_at = now() - make_interval(secs => :s) WHERE id = :id"),
            {"id": batch_id, "s": seconds},
        )


def _finish(engine: Engine, children: list[batches.NewChild], state: str = "succeeded") -> None:
    with engine.begin() as conn:
        for child in children:
            assert record_terminal(Held(conn), child.task_id, state).counted


# --- the lease and the relay's grace ---------------------------------------------------------------------------


def test_a_chunk_renews_the_lease_and_a_closed_batch_takes_no_chunk(store_engine: Engine) -> None:
    batch, children, _ = _open(store_engine, 2)
    _age(store_engine, batch.id, 3600)
    more = [batches.NewChild(f"more-{batch.id.hex}", "t.child", json_encoded({"task": "t.child"}))]
    with store_engine.begin() as conn:
        assert batches.add_children(conn, batch.id, [(batch.id, more[0], 2)], b"d2")
    row = _row(store_engine, batch.id)
    assert (row["planned"], row["remaining"]) == (3, 4)  # three children and the token
    assert row["producer_seen_at"] > datetime.now(timezone.utc) - timedelta(seconds=60)
    with store_engine.begin() as conn:
        assert recovery.seal_open_batch(conn, batch.id) is not None
    late = batches.NewChild(f"late-{batch.id.hex}", "t.child", json_encoded({"task": "t.child"}))
    with store_engine.connect() as conn:
        trans = conn.begin()
        assert not batches.add_children(conn, batch.id, [(batch.id, late, 3)], b"d3")
        trans.rollback()  # the producer raises BatchClosed inside its transaction, which rolls the chunk back
    assert _row(store_engine, batch.id)["planned"] == 3
    with store_engine.connect() as conn:
        assert fetch_all(conn, "SELECT 1 FROM fanin_children WHERE task_id = :t", t=late.task_id) == []


def test_lapsed_means_no_lock_held_and_last_seen_longer_than_the_grace_ago(store_engine: Engine) -> None:
    held, _, _ = _open(store_engine, 1)
    lapsed, _, _ = _open(store_engine, 1)
    recent, _, _ = _open(store_engine, 1)
    for batch_id in (held.id, lapsed.id):
        _age(store_engine, batch_id, 3600)
    _age(store_engine, recent.id, 5)
    producer = store_engine.connect()  # a live producer: its session holds the publish lock
    try:
        batches.hold_publish_lock(producer, held.id)
        producer.commit()
        with store_engine.begin() as conn:
            assert recovery.lapsed_open_batches(conn, 60) == [lapsed.id]
            # Whatever the lease says (here: a grace already over), a batch whose lock is held is never lapsed.
            assert held.id not in recovery.lapsed_open_batches(conn, -3600)
        # The relay saw the live producer's lock: its grace now runs from this moment, not from its last chunk.
        assert _row(store_engine, held.id)["producer_seen_at"] > datetime.now(timezone.utc) - timedelta(seconds=60)
    finally:
        producer.close()  # the producer dies: its lock goes with its session
    with store_engine.begin() as conn:
        assert recovery.lapsed_open_batches(conn, 60) == [lapsed.id]  # held is within its grace again
        assert sorted(recovery.lapsed_open_batches(conn, 1)) == sorted([lapsed.id, recent.id])


def test_seal_of_a_lapsed_batch_rechecks_the_lease_under_the_row_lock(store_engine: Engine) -> None:
    batch, _, _ = _open(store_engine, 1)
    with store_engine.begin() as conn:
        assert recovery.seal_open_batch(conn, batch.id, lapsed_grace=60) is None  # a resumer just wrote a chunk
    assert _row(store_engine, batch.id)["state"] == "open"
    _age(store_engine, batch.id, 3600)
    with store_engine.begin() as conn:
        sealed = recovery.seal_open_batch(conn, batch.id, lapsed_grace=60)
    assert sealed == recovery.Sealed(batch.id, 1, False)
    assert _row(store_engine, batch.id)["state"] == "running"


def test_seal_finishes_a_tree_with_the_children_it_has(store_engine: Engine) -> None:
    batch, children, leaf_ids = _open(store_engine, 6, leaves=2)
    _finish(store_engine, children[:5])
    with store_engine.begin() as conn:
        sealed = recovery.seal_open_batch(conn, batch.id)
    assert sealed == recovery.Sealed(batch.id, 6, False)
    assert {_row(store_engine, leaf)["state"] for leaf in leaf_ids} == {"running", "complete"}
    _finish(store_engine, children[5:], "failed")
    row = _row(store_engine, batch.id)
    assert (row["state"], row["remaining"]) == ("complete", 0)
    successor = successor_row(store_engine, batch.id, "kind", "state")
    assert successor is not None and successor["kind"] == "then"


def test_seal_after_every_child_finished_creates_the_successor_once(store_engine: Engine) -> None:
    batch, children, _ = _open(store_engine, 3)
    _finish(store_engine, children)
    assert _row(store_engine, batch.id)["state"] == "open"  # the token held it open
    with store_engine.begin() as conn:
        assert recovery.seal_open_batch(conn, batch.id) == recovery.Sealed(batch.id, 3, True)
    with store_engine.begin() as conn:
        assert recovery.seal_open_batch(conn, batch.id) is None  # only an open batch is sealed
    row = _row(store_engine, batch.id)
    assert (row["state"], row["succeeded"], row["remaining"]) == ("complete", 3, 0)
    with store_engine.connect() as conn:
        assert len(fetch_all(conn, "SELECT 1 FROM fanin_outbox WHERE batch_id = :id", id=batch.id)) == 1


def test_an_empty_open_batch_sealed_runs_its_successor(store_engine: Engine) -> None:
    batch, _, _ = _open(store_engine, 0)
    with store_engine.begin() as conn:
        assert recovery.seal_open_batch(conn, batch.id) == recovery.Sealed(batch.id, 0, True)
    assert _row(store_engine, batch.id)["state"] == "complete"


# --- cancel and deadlines ----------------------------------------------------------------------------------------


def test_cancel_abandons_unfinished_children_and_runs_nothing(store_engine: Engine) -> None:
    batch, children, leaf_ids = _open(store_engine, 4, leaves=2)
    _finish(store_engine, children[:1])
    with store_engine.begin() as conn:
        expiry = recovery.expire_batch(conn, batch.id, reason="cancel")
    assert expiry is not None
    assert (expiry.state, expiry.on_deadline, expiry.successor_created) == ("cancelled", "abandon", False)
    assert sorted(expiry.abandoned) == sorted(c.task_id for c in children[1:])
    row = _row(store_engine, batch.id)
    assert (row["state"], row["remaining"], row["succeeded"], row["failed"]) == ("cancelled", 0, 1, 3)
    assert {_row(store_engine, leaf)["state"] for leaf in leaf_ids} == {"cancelled"}
    with store_engine.connect() as conn:
        excs = fetch_all(conn, "SELECT DISTINCT exc_type FROM fanin_children WHERE state = 'abandoned'")
    assert excs == [{"exc_type": "Cancelled"}]
    assert successor_row(store_engine, batch.id, "kind", "state") is None
    with store_engine.begin() as conn:
        assert recovery.expire_batch(conn, batch.id, reason="cancel") is None  # once


def test_cancel_runs_on_expire_or_with_proceed_the_successor(store_engine: Engine) -> None:
    with_hook, _, _ = _open(store_engine, 2, on_expire=json_encoded({"task": "t.cleanup"}))
    running, _, _ = _open(store_engine, 2)
    with store_engine.begin() as conn:
        assert batches.seal(conn, running.id) is False
    with store_engine.begin() as conn:
        hooked = recovery.expire_batch(conn, with_hook.id, reason="cancel")
        proceeded = recovery.expire_batch(conn, running.id, reason="cancel", proceed=True)
    assert hooked is not None and hooked.successor_created
    assert successor_row(store_engine, with_hook.id, "kind", "state")["kind"] == "on_expire"
    assert proceeded is not None and (proceeded.state, proceeded.successor_created) == ("partial", True)
    assert successor_row(store_engine, running.id, "kind", "state")["kind"] == "then"


def test_a_passed_deadline_ends_an_open_batch(store_engine: Engine) -> None:
    past = datetime.now(timezone.utc) - timedelta(seconds=1)
    proceed, _, _ = _open(store_engine, 2, deadline_at=past, on_deadline="proceed")
    abandon, _, _ = _open(store_engine, 2, deadline_at=past, on_deadline="abandon")
    future, _, _ = _open(store_engine, 2, deadline_at=past + timedelta(hours=1))
    with store_engine.begin() as conn:
        due = recovery.due_deadlines(conn)
    assert sorted(due) == sorted([proceed.id, abandon.id])
    with store_engine.begin() as conn:
        expiries = [recovery.expire_batch(conn, batch_id) for batch_id in due]
        assert recovery.expire_batch(conn, future.id) is None
    assert {(e.batch_id, e.state) for e in expiries if e} == {(proceed.id, "partial"), (abandon.id, "expired")}
    assert _row(store_engine, proceed.id)["remaining"] == 0
    assert successor_row(store_engine, proceed.id, "kind", "state") is not None
    assert successor_row(store_engine, abandon.id, "kind", "state") is None
    assert _row(store_engine, future.id)["state"] == "open"


# --- reconciliation ----------------------------------------------------------------------------------------------


def test_reconcile_repairs_an_open_batch_keeping_its_token(store_engine: Engine) -> None:
    batch, children, leaf_ids = _open(store_engine, 6, leaves=2)
    _finish(store_engine, children[:6:2])  # the three children of the first leaf
    _finish(store_engine, children[1:2], "failed")
    with store_engine.begin() as conn:
        conn.execute(
            text("UPDATE fanin_batches SET remaining = 9, succeeded = 7 WHERE id = ANY(:ids)"),
            {"ids": [batch.id, *leaf_ids]},
        )
        candidates = recovery.batches_to_reconcile(conn)
    assert set(candidates) == {batch.id, *leaf_ids}
    assert candidates[-1] == batch.id  # leaves first
    with store_engine.begin() as conn:
        repairs = [recovery.reconcile_batch(conn, batch_id) for batch_id in candidates]
    assert all(r is not None and r.actions == ["counters recomputed from child rows"] for r in repairs)
    first, second = (_row(store_engine, leaf) for leaf in leaf_ids)
    # Leaf one: its three children succeeded, its token holds it open. Leaf two: one failed, two unfinished.
    assert (first["state"], first["remaining"], first["succeeded"], first["failed"]) == ("open", 1, 3, 0)
    assert (second["state"], second["remaining"], second["succeeded"], second["failed"]) == ("open", 3, 0, 1)
    root = _row(store_engine, batch.id)
    assert (root["state"], root["remaining"]) == ("open", 3)  # two open leaves and the token
    with store_engine.begin() as conn:
        assert [recovery.reconcile_batch(conn, batch_id) for batch_id in candidates] == [None, None, None]
        recovery.seal_open_batch(conn, batch.id)
    _finish(store_engine, children[3:6:2])
    assert (_row(store_engine, batch.id)["state"], _row(store_engine, batch.id)["succeeded"]) == ("complete", 5)


# --- the operator's commands, refused clearly ---------------------------------------------------------------------


def test_seal_and_cancel_explain_why_they_did_nothing(app: Celery, store_engine: Engine) -> None:
    fanin = FanIn.of(app)
    batch, _, leaf_ids = _open(store_engine, 2, leaves=1)
    with pytest.raises(BatchNotOpen, match=f"is a leaf counter of batch {batch.id}: seal {batch.id} instead$"):
        actions.seal_batch(fanin, leaf_ids[0])
    assert actions.seal_batch(fanin, batch.id).planned == 2
    with pytest.raises(BatchNotOpen, match="is running: nothing to seal"):
        actions.seal_batch(fanin, batch.id)
    assert actions.cancel_batch(fanin, batch.id).state == "cancelled"
    with pytest.raises(BatchNotOpen, match="is cancelled: nothing to cancel"):
        actions.cancel_batch(fanin, batch.id)
    with pytest.raises(BatchNotFound):
        actions.cancel_batch(fanin, uuid.uuid4())
