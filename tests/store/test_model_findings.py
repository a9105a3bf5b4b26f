"""Defects the protocol model (tests/model, issue 26) found, each pinned by the smallest case that shows it.

Every test runs against the real PostgreSQL and names the interleaving the model's shrunk counterexample had.
"""

from __future__ import annotations

import dataclasses
import uuid
from datetime import timedelta

from sqlalchemy import Engine, text

from celery_fanin.store import admin, batches, recovery

from .helpers import new_batch


def _tree(engine: Engine, n: int, leaves: int, **options: object) -> tuple[batches.NewBatch, list[batches.NewChild]]:
    batch, children = new_batch(n)
    batch = dataclasses.replace(batch, **options)
    with engine.begin() as conn:
        batches.create_batch(conn, batch, children, leaves=leaves)
    return batch, children


def _report(engine: Engine, batch: batches.NewBatch, child: batches.NewChild, idx: int, state: str) -> None:
    with engine.begin() as conn:
        rec = batches.record_terminal(
            conn, child.task_id, state, claim=batches.Claim(str(batch.id), idx, child.task_name)
        )
    assert rec.counted


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


def test_cancelling_a_tree_counts_its_abandoned_children_on_every_leaf(store_engine: Engine) -> None:
    """Model counterexample: create(1 child, 1 leaf); expire(cancel). The leaf ended with succeeded 0 + failed 0
    + remaining 0 for its 1 child: expire_batch set its leaves' state and remaining but not their counts."""
    batch, children = _tree(store_engine, 4, 2)
    _report(store_engine, batch, children[0], 0, "succeeded")
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
    _report(store_engine, batch, children[0], 0, "failed")
    _report(store_engine, batch, children[1], 1, "succeeded")
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
