"""Defects the protocol model (tests/model, issue 26) found, each pinned by the smallest case that shows it.

Every test runs against the real PostgreSQL and names the interleaving the model's shrunk counterexample had.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any

import psycopg
from sqlalchemy import Connection, Engine, text

from celery_fanin.producer.write import EMPTY_DIGEST, Layout, digest_step
from celery_fanin.store import admin, batches, recovery
from celery_fanin.store.reports import record_terminal
from tests.model.sessions import Op, Session, Shared, settle
from tests.sql import Held

from .helpers import new_batch, report


def _tree(engine: Engine, n: int, leaves: int, **options: Any) -> tuple[batches.NewBatch, list[batches.NewChild]]:
    batch, children = new_batch(n)
    batch = dataclasses.replace(batch, **options)
    with engine.begin() as conn:
        batches.create_batch(conn, batch, children, leaves=leaves)
    return batch, children


def _counters(engine: Engine, batch_id: uuid.UUID) -> list[tuple[int, int, int, int]]:
    """(planned, succeeded, failed, remaining) of a root and then its leaves."""
    with engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT planned, succeeded, failed, remaining FROM fanin_batches WHERE id = :id OR parent_id = :id "
                "ORDER BY parent_id NULLS FIRST, id"
            ),
            {"id": batch_id},
        ).all()
    return [tuple(r) for r in rows]  # type: ignore[misc]


def _claim(batch: batches.NewBatch, child: batches.NewChild, idx: int) -> batches.Claim:
    return batches.Claim(str(batch.id), idx, child.task_name)


def test_cancelling_a_tree_counts_its_abandoned_children_on_every_leaf(store_engine: Engine) -> None:
    """Model counterexample: create(1 child, 1 leaf); expire(cancel). The leaf ended with succeeded 0 + failed 0
    + remaining 0 for its 1 child: expire_batch set its leaves' state and remaining but not their counts."""
    batch, children = _tree(store_engine, 4, 2)
    assert report(
        store_engine, children[0].task_id, "succeeded", claim=batches.Claim(str(batch.id), 0, children[0].task_name)
    ).counted
    with store_engine.begin() as conn:
        expiry = recovery.expire_batch(conn, batch.id, reason="cancel")
    assert expiry is not None and len(expiry.abandoned) == 3
    root, *leaves = _counters(store_engine, batch.id)
    assert root == (4, 1, 3, 0)
    for planned, succeeded, failed, remaining in leaves:
        assert succeeded + failed == planned and remaining == 0
    assert sum(leaf[1] for leaf in leaves) == 1 and sum(leaf[2] for leaf in leaves) == 3
    with store_engine.connect() as conn:
        assert recovery.reconcile_batch(conn, batch.id) is None


def test_status_counts_a_threshold_trees_failures_once(store_engine: Engine) -> None:
    """Model counterexample: create(2 children, 1 leaf, max_failures=1); report(failed). `status` showed 2
    failures: a `fail_up` leaf's failures are in its root's `failed` already, and the node query added the
    unfinished leaf's again (the dashboard's query did not)."""
    batch, children = _tree(store_engine, 4, 2, max_failures=2)
    assert report(
        store_engine, children[0].task_id, "failed", claim=batches.Claim(str(batch.id), 0, children[0].task_name)
    ).counted
    assert report(
        store_engine, children[1].task_id, "succeeded", claim=batches.Claim(str(batch.id), 1, children[1].task_name)
    ).counted
    with store_engine.connect() as conn:
        node = admin.node(conn, batch.id)
        listed = [x.node for x in admin.list_batches(conn) if x.node.id == batch.id]
    assert node is not None
    assert (node.succeeded, node.failed, node.remaining) == (1, 1, 2)
    assert [(n.succeeded, n.failed) for n in listed] == [(1, 1)]


def test_the_reaper_skips_a_lost_child_whose_batch_was_pruned_since_it_looked(store_engine: Engine) -> None:
    """Model counterexample: relay_scan (a child past its child_timeout); the batch ended and prune deleted it;
    relay_act(lost). fail_lost read the batch's child_timeout with scalar_one() and raised NoResultFound, so the
    relay's whole reaper round failed on a batch that no longer existed."""
    batch, children = new_batch(1)
    batch = dataclasses.replace(batch, child_timeout=timedelta(0))
    with store_engine.begin() as conn:
        batches.create_batch(conn, batch, children)
    with store_engine.begin() as conn:
        (overdue,) = recovery.overdue_children(conn)
    with store_engine.begin() as conn:
        assert recovery.expire_batch(conn, batch.id, reason="cancel") is not None
    with store_engine.begin() as conn:
        assert [p.id for p in admin.lock_prunable(conn, 0.0, 10)] == [batch.id]
        admin.delete_batches(conn, [batch.id])
    with store_engine.begin() as conn:
        assert recovery.fail_lost(conn, overdue) is False
        assert recovery.claim_redrive(conn, overdue) is False


def _race(engine: Engine, url: str, held: Callable[[Connection], Any], other: Callable[[Connection], Any]) -> Any:
    """`held` runs in one session and keeps its transaction open; `other` runs in a second one and waits on its
    locks (checked in pg_stat_activity); then `held` commits and `other` goes on. Returns what `other` returned."""
    shared = Shared()
    first, second = Session(engine, "held", shared), Session(engine, "other", shared)
    try:
        with psycopg.connect(url, autocommit=True) as monitor:
            first.submit(Op("held", held), hold=True)
            settle([first, second], monitor)
            second.submit(Op("other", other), hold=False)
            settle([first, second], monitor)
            assert second.busy, "the second transaction did not wait for the first"
            first.release(commit=True)
            settle([first, second], monitor)
    finally:
        first.close()
        second.close()
    failed = [c.error for c in shared.completions if not c.committed]
    assert not failed, failed
    return {c.op.label: c.result for c in shared.completions}["other"]


def _stream(engine: Engine, direct: int) -> tuple[batches.NewBatch, Layout, list[Callable[[Connection], bool]]]:
    """An open batch and a producer for it (the producer's own Layout, 2 children a leaf, 2 leaves a window):
    returns the chunk writers, each one `write_chunk` transaction body of n children."""
    batch, _ = new_batch(0)
    with engine.begin() as conn:
        batches.insert_batch(conn, batch, state="open", planned=0)
    layout = Layout(max_width=2, fanout=2, direct_left=direct)
    state = {"index": 0, "digest": EMPTY_DIGEST}

    def chunk(n: int) -> Callable[[Connection], bool]:
        start = state["index"]
        part = [
            batches.NewChild(f"c-{batch.id.hex[:8]}-{start + i}", "t.child", batch.successor_message) for i in range(n)
        ]
        digest = state["digest"]
        for child in part:
            digest = digest_step(digest, child)  # type: ignore[arg-type]
        targets, opened, full = layout.place(n)
        placed = [(t or batch.id, c, start + i) for i, (c, t) in enumerate(zip(part, targets, strict=True))]
        state["index"], state["digest"] = start + n, digest
        return lambda conn: batches.write_chunk(conn, batch, placed, digest, opened=opened, full=full)

    return batch, layout, [chunk(1), chunk(2)]


def _consistent(engine: Engine, batch_id: uuid.UUID) -> None:
    """Every batch of the tree agrees with its child rows; nothing is left open under a root that is not."""
    with engine.connect() as conn:
        rows = conn.execute(
            text(
                """
                SELECT b.id, b.parent_id, b.state, b.planned, b.remaining, b.succeeded, b.failed,
                       count(c.*) FILTER (WHERE c.state IN ('pending', 'started')) AS open
                  FROM fanin_batches b LEFT JOIN fanin_children c ON c.batch_id = b.id
                 WHERE b.id = :id OR b.parent_id = :id
                 GROUP BY b.id
                """
            ),
            {"id": batch_id},
        ).all()
    root = next(r for r in rows if r.parent_id is None)
    for r in rows:
        if r.parent_id is not None:
            assert r.succeeded + r.failed + r.remaining == r.planned + (r.state == "open"), r
            assert r.remaining == r.open + (r.state == "open"), r
            assert root.state == "open" or r.state != "open", f"leaf {r.id} left open under a {root.state} root"


def test_a_cancel_waits_for_the_producers_chunk_in_flight(store_engine: Engine, clean_db: str) -> None:
    """Model counterexample: create_stream; stream_chunk (held open); expire(cancel); release. The cancel had
    abandoned the children it saw, then locked the root after the chunk committed: the chunk's children stayed
    pending in a cancelled batch whose counters were zero, counted by nobody."""
    batch, _, (first, second) = _stream(store_engine, direct=1)
    with store_engine.begin() as conn:
        assert first(conn)
    expiry = _race(store_engine, clean_db, second, lambda c: recovery.expire_batch(c, batch.id, reason="cancel"))
    assert expiry is not None and len(expiry.abandoned) == 3  # the chunk's two children too
    with store_engine.connect() as conn:
        states = (
            conn.execute(
                text(
                    "SELECT c.state FROM fanin_children c JOIN fanin_batches b ON b.id = c.batch_id"
                    " WHERE b.id = :id OR b.parent_id = :id"
                ),
                {"id": batch.id},
            )
            .scalars()
            .all()
        )
    assert sorted(states) == ["abandoned"] * 3
    _consistent(store_engine, batch.id)


def test_a_seal_waits_for_the_chunk_that_opens_leaves(store_engine: Engine, clean_db: str) -> None:
    """The same race with `fanin seal` (or the relay sealing a lapsed batch): the seal read the open leaves before
    the chunk committed and left the chunk's new leaves open under a running root, which then never finished."""
    batch, _, (first, second) = _stream(store_engine, direct=1)
    with store_engine.begin() as conn:
        assert first(conn)
    sealed = _race(store_engine, clean_db, second, lambda c: recovery.seal_open_batch(c, batch.id))
    assert sealed is not None and sealed.planned == 3
    _consistent(store_engine, batch.id)


def test_a_deadline_that_waited_for_a_threshold_report_abandons_nothing(store_engine: Engine, clean_db: str) -> None:
    """Model counterexample: create(2 children, max_failures=0, deadline passed); report(failed) held open;
    relay_act(deadline); release. The report passed the threshold while the deadline waited on its child row;
    the deadline then found the batch no longer running and returned None, but had abandoned the other child
    and committed that, so the batch's remaining counted a child that would never report."""
    batch, children = new_batch(2)
    past = datetime.now(timezone.utc) - timedelta(hours=1)
    batch = dataclasses.replace(batch, max_failures=0, deadline_at=past, on_deadline="abandon")
    with store_engine.begin() as conn:
        batches.create_batch(conn, batch, children)
    claim = batches.Claim(str(batch.id), 0, "t.child")

    def report(conn: Connection) -> batches.TerminalRecord:
        return record_terminal(Held(conn), children[0].task_id, "failed", claim=claim)

    assert _race(store_engine, clean_db, report, lambda c: recovery.expire_batch(c, batch.id)) is None
    with store_engine.connect() as conn:
        row = conn.execute(
            text("SELECT state, remaining, failed FROM fanin_batches WHERE id = :id"), {"id": batch.id}
        ).one()
        other = conn.execute(
            text("SELECT state FROM fanin_children WHERE task_id = :t"), {"t": children[1].task_id}
        ).scalar_one()
    assert tuple(row) == ("failed_threshold", 1, 1)
    assert other == "pending"  # the relay abandons it, with the threshold's reason, when it publishes
