"""A failure threshold holds for a whole tree of counters, and for a batch still being streamed (migration 0012).

A leaf of a root with a threshold hands each failure up to the root in the report that counts it, so the report
that takes the root past `max_failures` creates its one successor, whatever leaf it is on. The relay then
abandons every leaf's unfinished children, and their later reports are recorded as late, never counted. The relay
also skips children that no longer need publishing. Every test runs against the real PostgreSQL.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
import redis
from celery import Celery
from sqlalchemy import Engine, text

from celery_fanin import BatchOutcome, FanIn, FanInNotConfigured, InvalidFanIn, codec, fan_in_group
from celery_fanin.dispatch import children as child_dispatch
from celery_fanin.dispatch import successors as successor_dispatch
from celery_fanin.store import batches, queries, recovery
from celery_fanin.store.outcomes import build_outcome
from tests.sql import outbox, row_count

from .helpers import (
    QUEUE,
    Tasks,
    collecting_batch,
    deal,
    fetch_all,
    fetch_one,
    json_encoded,
    new_batch,
    notifications_until_sentinel,
    queued_messages,
    race_threads,
    report,
)


@pytest.fixture
def listener(clean_db: str) -> Iterator[psycopg.Connection]:
    with psycopg.connect(clean_db, autocommit=True) as conn:
        conn.execute("LISTEN fanin_outbox")
        yield conn


def _tree(
    engine: Engine, n: int, leaves: int, **options: Any
) -> tuple[batches.NewBatch, list[batches.NewChild], list[uuid.UUID]]:
    """A tree of `n` children over `leaves` leaves (child i on leaf i % leaves); returns the leaf ids in that order."""
    batch, children = new_batch(n)
    batch = dataclasses.replace(batch, **options)
    with engine.begin() as conn:
        batches.create_batch(conn, batch, children, leaves=leaves)
        leaf_of_child = dict(
            conn.execute(
                text("SELECT idx, batch_id FROM fanin_children WHERE batch_id <> :id AND idx < :k"),
                {"id": batch.id, "k": leaves},
            ).all()
        )
    return batch, children, [leaf_of_child[i] for i in range(leaves)]


def _row(engine: Engine, batch_id: uuid.UUID) -> dict[str, Any]:
    with engine.connect() as conn:
        return fetch_one(
            conn,
            "SELECT b.state, b.remaining, b.succeeded, b.failed, b.planned,"
            " (SELECT array_agg(kind) FROM fanin_successors s WHERE s.batch_id = b.id) AS successors,"
            " (SELECT count(*) FROM fanin_outbox o WHERE o.batch_id = b.id) AS outbox"
            " FROM fanin_batches b WHERE b.id = :id",
            id=batch_id,
        )


def _reported(engine: Engine, task_id: str, state: str) -> batches.TerminalRecord:
    """A child's report, with an error when it did not succeed."""
    return report(engine, task_id, state, exc_type=None if state == "succeeded" else "E")


@pytest.mark.parametrize("on_failure", [False, True])
def test_a_failure_on_any_leaf_counts_at_the_root_and_the_one_that_passes_the_threshold_finishes_the_tree(
    store_engine: Engine, on_failure: bool
) -> None:
    batch, children, leaf_ids = _tree(
        store_engine, 12, 4, max_failures=1, on_failure=json_encoded("undo") if on_failure else None
    )
    assert _reported(store_engine, children[4].task_id, "succeeded").counted  # leaf 0: not finished, not handed up
    first = _reported(store_engine, children[0].task_id, "failed")  # leaf 0
    assert (first.counted, first.successor_created) == (True, False)
    root = _row(store_engine, batch.id)
    # The failure is at the root at once; the success waits for its leaf to finish.
    assert (root["state"], root["remaining"], root["succeeded"], root["failed"]) == ("running", 4, 0, 1)

    second = _reported(store_engine, children[1].task_id, "failed")  # leaf 1: no leaf has finished
    assert (second.counted, second.successor_created) == (True, True)
    root = _row(store_engine, batch.id)
    kind = "on_failure" if on_failure else "then"
    assert (root["state"], root["remaining"], root["failed"]) == ("failed_threshold", 4, 2)
    assert (root["successors"], root["outbox"]) == ([kind], 1)
    with store_engine.connect() as conn:
        leaves = fetch_all(conn, "SELECT state FROM fanin_batches WHERE parent_id = :id", id=batch.id)
    assert {leaf["state"] for leaf in leaves} == {"running"}

    # Reports after the threshold (before the relay stopped the batch) count once and create nothing.
    for i in (2, 5, 6, 10):
        rec = _reported(store_engine, children[i].task_id, "failed" if i == 2 else "succeeded")
        assert rec.counted and not rec.successor_created
    root = _row(store_engine, batch.id)
    assert (root["state"], root["failed"], root["successors"], root["outbox"]) == ("failed_threshold", 3, [kind], 1)


def test_a_tree_without_a_threshold_leaves_its_root_alone_until_a_leaf_finishes(store_engine: Engine) -> None:
    """The hot path: without a threshold a leaf's failures reach the root with the leaf's totals, as before."""
    batch, children, _ = _tree(store_engine, 6, 3)
    for i in (0, 1, 2):
        _reported(store_engine, children[i].task_id, "failed")
    root = _row(store_engine, batch.id)
    assert (root["state"], root["remaining"], root["failed"]) == ("running", 3, 0)
    for i in (3, 4, 5):
        _reported(store_engine, children[i].task_id, "succeeded")
    root = _row(store_engine, batch.id)
    assert (root["state"], root["remaining"], root["succeeded"], root["failed"]) == ("complete", 0, 3, 3)


def test_a_tree_under_its_threshold_completes_with_every_failure_counted_once(store_engine: Engine) -> None:
    batch, children, _ = _tree(store_engine, 9, 3, max_failures=5)
    states = ["failed", "succeeded", "failed", "succeeded", "failed", "failed", "succeeded", "failed", "succeeded"]
    for child, state in zip(children, states, strict=True):
        _reported(store_engine, child.task_id, state)
    root = _row(store_engine, batch.id)
    assert (root["state"], root["remaining"], root["succeeded"], root["failed"]) == ("complete", 0, 4, 5)
    assert root["successors"] == ["then"]


@pytest.mark.parametrize("seed", range(3))
def test_concurrent_failures_on_different_leaves_create_exactly_one_successor(
    store_engine: Engine, listener: psycopg.Connection, clean_db: str, seed: int
) -> None:
    """16 reporters, each on its own leaf, fail their children at once: many pass the threshold together, and no
    leaf can finish (each keeps one child back), so only failures handed up can stop the tree."""
    leaves, per_leaf = 16, 12
    batch, children, _ = _tree(store_engine, leaves * per_leaf, leaves, max_failures=20)
    held_back = children[-leaves:]  # the last child of every leaf
    states = {c.task_id: ("succeeded" if (i // leaves + seed) % 4 == 0 else "failed") for i, c in enumerate(children)}
    hands = [[(c.task_id, states[c.task_id]) for c in children[k:-leaves:leaves]] for k in range(leaves)]
    outcomes = race_threads(store_engine, hands)

    assert all(counted for _, _, counted, _, _ in outcomes)
    assert sum(1 for *_, created in outcomes if created) == 1
    failures = sum(1 for task_id, state, *_ in outcomes if state == "failed")
    root = _row(store_engine, batch.id)
    assert (root["state"], root["remaining"], root["succeeded"], root["failed"]) == (
        "failed_threshold",
        leaves,
        0,
        failures,
    )
    assert (root["successors"], root["outbox"]) == (["then"], 1)
    with store_engine.connect() as conn:
        [(out_id,)] = [tuple(r.values()) for r in outbox(conn, batch.id, "id")]
    assert notifications_until_sentinel(listener, clean_db) == [str(out_id)]

    # The held-back children finish their leaves: successes reach the root once per leaf, failures once each.
    outcomes = race_threads(store_engine, deal([(c.task_id, states[c.task_id]) for c in held_back], hands=8))
    assert not any(created for *_, created in outcomes)
    root = _row(store_engine, batch.id)
    all_failures = sum(1 for s in states.values() if s == "failed")
    assert (root["remaining"], root["failed"], root["succeeded"]) == (0, all_failures, len(children) - all_failures)
    assert (root["successors"], root["outbox"]) == (["then"], 1)


def test_the_relay_abandons_the_unfinished_children_of_every_leaf_and_their_reports_are_late(
    store_engine: Engine,
) -> None:
    batch, children, leaf_ids = _tree(store_engine, 12, 3, max_failures=1)
    _reported(store_engine, children[0].task_id, "failed")
    _reported(store_engine, children[3].task_id, "succeeded")
    assert _reported(store_engine, children[1].task_id, "failed").successor_created

    with store_engine.begin() as conn:
        abandoned = recovery.abandon_after_threshold(conn, batch.id)
    assert sorted(abandoned) == sorted(c.task_id for i, c in enumerate(children) if i not in (0, 1, 3))
    root = _row(store_engine, batch.id)
    assert (root["state"], root["remaining"], root["succeeded"], root["failed"]) == ("failed_threshold", 0, 1, 11)
    with store_engine.connect() as conn:
        leaves = fetch_all(
            conn, "SELECT state, remaining, succeeded, failed FROM fanin_batches WHERE parent_id = :id", id=batch.id
        )
    assert (
        sorted((r["state"], r["remaining"], r["succeeded"] + r["failed"]) for r in leaves)
        == [("failed_threshold", 0, 4)] * 3
    )
    assert sum(r["failed"] for r in leaves) == 11

    # The revoked copies (and a running one that still succeeded) report late: recorded, not counted.
    for i, state in ((2, "revoked"), (4, "succeeded"), (11, "revoked")):
        rec = _reported(store_engine, children[i].task_id, state)
        assert (rec.counted, rec.late, rec.successor_created) == (False, True, False)
    assert _row(store_engine, batch.id) == root
    with store_engine.connect() as conn:
        late = fetch_one(conn, "SELECT state, late_state FROM fanin_children WHERE task_id = :t", t=children[4].task_id)
    assert late == {"state": "abandoned", "late_state": "succeeded"}

    with store_engine.begin() as conn:  # a second call (a republished successor) finds nothing to do
        assert recovery.abandon_after_threshold(conn, batch.id) == []
    assert _row(store_engine, batch.id) == root


def test_abandoning_beside_racing_reporters_counts_each_child_once(store_engine: Engine) -> None:
    """Reports still arriving while the relay abandons: no deadlock, every child counted once, counters exact."""
    leaves, per_leaf = 8, 40
    batch, children, _ = _tree(store_engine, leaves * per_leaf, leaves, max_failures=0)
    assert _reported(store_engine, children[0].task_id, "failed").successor_created
    reports = [(c.task_id, "succeeded" if i % 3 else "failed") for i, c in enumerate(children[1:])]
    abandoned: list[str] = []

    def abandon() -> None:
        with store_engine.begin() as conn:
            abandoned.extend(recovery.abandon_after_threshold(conn, batch.id))

    stopper = threading.Timer(0.05, abandon)
    stopper.start()
    outcomes = race_threads(store_engine, deal(reports, hands=8))
    stopper.join(30)
    with store_engine.begin() as conn:  # whatever was still unfinished when the reporters stopped
        abandoned.extend(recovery.abandon_after_threshold(conn, batch.id))

    counted = {task_id for task_id, _, ok, _, _ in outcomes if ok}
    assert counted.isdisjoint(abandoned)
    assert len(counted) + len(abandoned) == len(children) - 1
    root = _row(store_engine, batch.id)
    with store_engine.connect() as conn:
        rows = fetch_all(
            conn,
            "SELECT state, count(*) AS n FROM fanin_children WHERE batch_id IN"
            " (SELECT id FROM fanin_batches WHERE id = :id OR parent_id = :id) GROUP BY state",
            id=batch.id,
        )
    by_state = {r["state"]: r["n"] for r in rows}
    assert "pending" not in by_state and "started" not in by_state
    assert (root["remaining"], root["succeeded"]) == (0, by_state.get("succeeded", 0))
    assert root["succeeded"] + root["failed"] == root["planned"] == len(children)
    assert (root["successors"], root["outbox"]) == (["then"], 1)


def test_reconcile_and_status_agree_with_failures_handed_up(app: Celery, tasks: Tasks, store_engine: Engine) -> None:
    """Reconciliation and `status()` know a `fail_up` leaf's failures are at the root already."""
    children = [tasks.add.s(i, i) for i in range(8)]
    handle = fan_in_group(children, then=tasks.collect.s(), max_width=2, max_failures=0.5).apply_async()
    batch_id = uuid.UUID(handle.batch_id)
    with store_engine.connect() as conn:
        ids = [r[0] for r in conn.execute(text("SELECT task_id FROM fanin_children ORDER BY idx")).all()]
        assert conn.execute(
            text("SELECT bool_and(fail_up) FROM fanin_batches WHERE parent_id = :id"), {"id": batch_id}
        ).scalar_one()
    for i in (0, 1, 2):
        _reported(store_engine, ids[i], "failed" if i < 2 else "succeeded")
    with store_engine.begin() as conn:
        assert recovery.reconcile_batch(conn, batch_id) is None  # nothing to repair
    status = handle.batch_status()
    assert (status.state, status.failed, status.succeeded, status.remaining) == ("running", 2, 1, 5)
    for i in (3, 4):  # the fifth failure of eight passes 0.5 * 8 = 4 on another leaf
        _reported(store_engine, ids[i], "failed")
    assert handle.batch_status().state == "running"
    assert _reported(store_engine, ids[5], "failed").successor_created
    status = handle.batch_status()
    assert (status.state, status.failed) == ("failed_threshold", 5)


def _stream_until(app: Celery, tasks: Tasks, engine: Engine, fail_after: int, total: int, **options: Any) -> Any:
    """Stream `total` children; once `fail_after` are written (and before the rest), fail every one written."""
    consumed: list[int] = []

    def children() -> Iterator[Any]:
        for i in range(total):
            if i == fail_after:
                with engine.connect() as conn:
                    written = [r[0] for r in conn.execute(text("SELECT task_id FROM fanin_children")).all()]
                for task_id in written:
                    _reported(engine, task_id, "failed")
            consumed.append(i)
            yield tasks.add.s(i, i)

    handle = fan_in_group(children(), then=tasks.collect.s(), **options).apply_async()
    return handle, consumed


def test_a_streamed_tree_with_a_count_threshold_finishes_before_it_is_sealed_and_stops_reading(
    app: Celery, tasks: Tasks, store_engine: Engine
) -> None:
    app.conf.fanin_chunk_size = 4
    handle, consumed = _stream_until(app, tasks, store_engine, 8, 40, max_width=2, max_failures=3)
    batch_id = uuid.UUID(handle.batch_id)
    root = _row(store_engine, batch_id)
    # The chunk after the threshold was rolled back and nothing more was read past it.
    assert (root["state"], root["planned"], root["successors"]) == ("failed_threshold", 8, ["then"])
    assert len(consumed) <= 12
    with store_engine.connect() as conn:
        assert row_count(conn, "fanin_children") == 8
    with store_engine.begin() as conn:
        abandoned = recovery.abandon_after_threshold(conn, batch_id)
    assert abandoned == []  # every written child had failed
    root = _row(store_engine, batch_id)
    assert (root["remaining"], root["succeeded"], root["failed"]) == (0, 0, 8)


def test_a_keyed_stream_that_stopped_early_is_returned_again_for_the_same_input(
    app: Celery, tasks: Tasks, store_engine: Engine
) -> None:
    app.conf.fanin_chunk_size = 4
    first, _ = _stream_until(app, tasks, store_engine, 8, 40, max_width=2, max_failures=3, key="nightly")
    assert _row(store_engine, uuid.UUID(first.batch_id))["state"] == "failed_threshold"
    again, consumed = _stream_until(app, tasks, store_engine, 10_000, 40, max_width=2, max_failures=3, key="nightly")
    assert again.batch_id == first.batch_id
    assert len(consumed) == 8  # only the part the batch holds was compared
    with store_engine.connect() as conn:
        assert row_count(conn, "fanin_children") == 8
    with pytest.raises(InvalidFanIn, match="different child list"):
        fan_in_group(
            (tasks.add.s(i, 0) for i in range(40)), then=tasks.collect.s(), max_width=2, max_failures=3, key="nightly"
        ).apply_async()


def test_a_streamed_tree_with_a_ratio_counts_every_leafs_failures_when_it_is_sealed(
    app: Celery, tasks: Tasks, store_engine: Engine, broker: redis.Redis
) -> None:
    app.conf.fanin_chunk_size = 4
    handle, consumed = _stream_until(app, tasks, store_engine, 8, 12, max_width=2, max_failures=0.5)
    assert len(consumed) == 12  # a ratio is known only at the seal: the whole input was written
    root = _row(store_engine, uuid.UUID(handle.batch_id))
    # 8 failures of 12 children pass 0.5 * 12 = 6 (the leaves still counting had handed theirs up); the producer
    # sent the successor at once, with the outcome as it stood, and abandoned the 4 children still unfinished.
    assert (root["state"], root["planned"], root["successors"]) == ("failed_threshold", 12, ["then"])
    with store_engine.connect() as conn:
        states = dict(conn.execute(text("SELECT state, count(*) FROM fanin_children GROUP BY state")).all())
        outbox_sent = conn.execute(text("SELECT sent_at IS NOT NULL FROM fanin_outbox")).scalar_one()
    assert (states, outbox_sent) == ({"failed": 8, "abandoned": 4}, True)
    assert (root["remaining"], root["failed"]) == (0, 12)
    [message] = [m for m in queued_messages(broker) if m.headers.get("fanin_successor")]
    assert [message.args[0][k] for k in ("failed", "unfinished", "planned")] == [8, 4, 12]


# --- the relay: orphaned children, abandoned children -------------------------------------------------------------


def _encoded_batch(app: Celery, tasks: Tasks, n: int, **options: Any) -> tuple[batches.NewBatch, list[Any]]:
    batch = collecting_batch(app, tasks, **options)
    children = [
        batches.NewChild(f"{batch.id}-{i}", "tests.store.add", codec.encode_signature(app, tasks.add.s(i, i)))
        for i in range(n)
    ]
    return batch, children


def test_the_relay_publishes_only_orphaned_children_still_pending_and_marks_the_batch_published(
    app: Celery, tasks: Tasks, store_engine: Engine, broker: redis.Redis
) -> None:
    app.conf.fanin_chunk_size = 3
    batch, children = _encoded_batch(app, tasks, 10)
    with store_engine.begin() as conn:  # written by a producer that died before publishing anything
        batches.create_batch(conn, batch, children, leaves=2)
    for i, state in ((0, "succeeded"), (3, "failed"), (4, "succeeded"), (5, "failed"), (9, "revoked")):
        _reported(store_engine, children[i].task_id, state)
    with store_engine.begin() as conn:
        conn.execute(text("UPDATE fanin_children SET state = 'started' WHERE task_id = :t"), {"t": children[7].task_id})
        conn.execute(
            text("UPDATE fanin_children SET state = 'abandoned' WHERE task_id = :t"), {"t": children[8].task_id}
        )

    assert child_dispatch.publish_orphaned_children(FanIn.of(app)) == 3
    assert [m.headers["id"] for m in queued_messages(broker)] == [children[i].task_id for i in (1, 2, 6)]
    assert _published_upto(store_engine, batch.id) == 10
    assert child_dispatch.publish_orphaned_children(FanIn.of(app)) == 0  # done with it: not scanned again
    assert broker.llen(QUEUE) == 3


def test_the_relay_moves_the_mark_past_a_batch_with_nothing_left_to_publish(
    app: Celery, tasks: Tasks, store_engine: Engine, broker: redis.Redis
) -> None:
    app.conf.fanin_chunk_size = 2
    batch, children = _encoded_batch(app, tasks, 5)
    with store_engine.begin() as conn:
        batches.create_batch(conn, batch, children)
        batches.mark_published(conn, batch.id, 1)
    for child in children[1:]:
        _reported(store_engine, child.task_id, "failed")
    assert child_dispatch.publish_orphaned_children(FanIn.of(app)) == 0
    assert broker.llen(QUEUE) == 0
    assert _published_upto(store_engine, batch.id) == 5


def _published_upto(engine: Engine, batch_id: uuid.UUID) -> int:
    with engine.connect() as conn:
        return int(
            conn.execute(text("SELECT published_upto FROM fanin_batches WHERE id = :id"), {"id": batch_id}).scalar_one()
        )


def test_publishing_a_tree_s_threshold_successor_abandons_and_revokes_every_leaf_s_unfinished_children(
    app: Celery, tasks: Tasks, store_engine: Engine, broker: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    revoked: list[str] = []
    monkeypatch.setattr(app.control, "revoke", lambda ids, **kw: revoked.extend(ids))
    batch, children = _encoded_batch(app, tasks, 9, max_failures=1)
    with store_engine.begin() as conn:
        batches.create_batch(conn, batch, children, leaves=3)
    _reported(store_engine, children[0].task_id, "failed")
    _reported(store_engine, children[4].task_id, "succeeded")
    assert _reported(store_engine, children[2].task_id, "failed").successor_created

    assert successor_dispatch.publish_outbox(FanIn.of(app)) == 1
    [message] = queued_messages(broker)
    outcome = message.args[0]
    # The outcome says what had happened when the threshold passed: the tree's successes as well.
    fields = ("state", "partial", "succeeded", "failed", "unfinished", "abandoned")
    assert [outcome[k] for k in fields] == ["failed_threshold", True, 1, 2, 6, 0]
    expected = sorted(c.task_id for i, c in enumerate(children) if i not in (0, 2, 4))
    assert sorted(revoked) == expected
    root = _row(store_engine, batch.id)
    assert (root["remaining"], root["succeeded"], root["failed"]) == (0, 1, 8)


# --- the outcome's byte budget --------------------------------------------------------------------------------------


def test_the_outcome_lists_failures_up_to_a_byte_budget_and_the_rest_stream_from_postgres(
    app: Celery, tasks: Tasks, store_engine: Engine
) -> None:
    big = "x" * 1000
    batch, _ = _encoded_batch(app, tasks, 0)
    children = [
        batches.NewChild(f"{batch.id}-{i}", "tests.store.add", codec.encode_signature(app, tasks.add.s(i, big)))
        for i in range(30)
    ]
    with store_engine.begin() as conn:
        batches.create_batch(conn, batch, children)
    for i, child in enumerate(children):
        _reported(store_engine, child.task_id, "succeeded" if i % 3 == 0 else "failed")
    with store_engine.connect() as conn:
        row = queries.batch(conn, batch.id)
        assert row is not None
        by_bytes = build_outcome(conn, row, 100, max_bytes=5000)
        by_count = build_outcome(conn, row, 3, max_bytes=5000)
        whole = build_outcome(conn, row, 100, max_bytes=1_000_000)

    assert (by_bytes["failures_truncated"], by_bytes["failures_truncated_by"]) == (True, "bytes")
    assert 0 < len(by_bytes["failures"]) < 20 and by_bytes["failed"] == 20
    assert len(json.dumps(by_bytes["failures"]).encode()) <= 5000
    assert all(f["args"] == [f["index"], big] for f in by_bytes["failures"])  # entries are whole, or left out
    assert (by_count["failures_truncated_by"], len(by_count["failures"])) == ("count", 3)
    assert (whole["failures_truncated"], whole["failures_truncated_by"], len(whole["failures"])) == (False, None, 20)

    result = BatchOutcome.from_message(by_bytes, app=app)
    assert result.failures_truncated_by == "bytes"
    rest = list(result.iter_failures(after=result.failures[-1]["index"], fetch_size=4))
    assert [f["index"] for f in itertools.chain(result.failures, rest)] == [f["index"] for f in whole["failures"]]
    assert [f["index"] for f in result.iter_failures()] == [f["index"] for f in whole["failures"]]


@pytest.mark.parametrize("budget", ["256k", -1, True])
def test_a_bad_byte_budget_is_refused_before_anything_is_written(
    app: Celery, tasks: Tasks, store_engine: Engine, broker: redis.Redis, budget: Any
) -> None:
    app.conf.fanin_outcome_max_bytes = budget
    with pytest.raises(FanInNotConfigured, match="fanin_outcome_max_bytes must be a whole number of bytes"):
        fan_in_group([tasks.add.s(1, 1)], then=tasks.collect.s()).apply_async()
    with store_engine.connect() as conn:
        assert row_count(conn, "fanin_batches") == 0
    assert broker.llen(QUEUE) == 0
