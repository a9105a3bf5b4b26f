"""`celery_fanin.ops.rounds.retry_failed` against Postgres and the Redis broker, with outcomes reported by hand: what a
round is made of, and when it is refused. (tests/e2e/test_cli_ops.py runs rounds on real workers.)"""

from __future__ import annotations

import json
import uuid
from datetime import timedelta

import pytest
import redis
from celery import Celery
from sqlalchemy import Engine, text

from celery_fanin import BatchOutcome, FanIn, FanInResult, InvalidFanIn, fan_in_group
from celery_fanin.codec import encode_result
from celery_fanin.exceptions import BatchNotFinished, BatchNotFound
from celery_fanin.ops.rounds import retry_failed
from celery_fanin.store import queries
from celery_fanin.store.outcomes import build_outcome
from celery_fanin.store.reports import record_terminal
from tests.sql import Held, child_ids
from tests.store.helpers import QUEUE, Tasks, fetch_all, fetch_one, queued_messages


def _finish(engine: Engine, batch_id: str, states: dict[int, str], successor: str = "succeeded") -> None:
    """Report every child of the batch (by index: its state, default succeeded) and its successor's final state."""
    with engine.begin() as conn:
        rows = fetch_all(
            conn,
            "SELECT task_id, idx FROM fanin_children WHERE batch_id IN (SELECT id FROM "
            "fanin_batches WHERE id = :b OR parent_id = :b)",
            b=batch_id,
        )
        for row in rows:
            record_terminal(Held(conn), row["task_id"], states.get(row["idx"], "succeeded"), exc_type="E")
        conn.execute(
            text("UPDATE fanin_successors SET state = :s WHERE batch_id = :b"), {"s": successor, "b": batch_id}
        )


def test_a_round_holds_the_failed_children_under_new_ids_and_the_same_successor(
    app: Celery, tasks: Tasks, store_engine: Engine, broker: redis.Redis
) -> None:
    children = [tasks.add.s(i, i) for i in range(5)]
    first = fan_in_group(
        children,
        then=tasks.collect.s("label"),
        step="merge",
        child_timeout=timedelta(minutes=7),
        on_lost="redrive",
        max_redrives=2,
    ).apply_async()
    _finish(store_engine, first.batch_id, {1: "failed", 3: "lost"})
    broker.delete(QUEUE)

    done = retry_failed(FanIn.of(app), first.batch_id)
    assert (done.original, done.retried, done.retried_round, done.round, done.children) == (
        first.batch_id,
        first.batch_id,
        1,
        2,
        2,
    )
    assert done.batch_id is not None and not done.existing
    with store_engine.connect() as conn:
        row = fetch_one(
            conn,
            "SELECT step, state, planned, round, retry_of, key, successor_name, successor_task_id, "
            "extract(epoch FROM child_timeout) AS timeout, on_lost, max_redrives, lineage, depth "
            "FROM fanin_batches WHERE id = :b",
            b=done.batch_id,
        )
        old = fetch_all(
            conn,
            "SELECT task_id, message FROM fanin_children WHERE batch_id = :b AND idx IN (1, 3) ORDER BY idx",
            b=first.batch_id,
        )
        new = fetch_all(
            conn, "SELECT task_id, idx, message FROM fanin_children WHERE batch_id = :b ORDER BY idx", b=done.batch_id
        )
    assert (row["step"], row["state"], row["planned"], row["round"], str(row["retry_of"])) == (
        "merge",
        "running",
        2,
        2,
        first.batch_id,
    )
    assert row["key"] == f"retry:{first.batch_id}:2" and row["successor_name"] == "tests.store.collect"
    assert row["successor_task_id"] != first.successor_task_id
    assert (float(row["timeout"]), row["on_lost"], row["max_redrives"]) == (420.0, "redrive", 2)
    assert (row["lineage"], row["depth"]) == (None, 0)
    assert [c["idx"] for c in new] == [0, 1]
    assert [json.loads(c["message"])["args"] for c in new] == [[1, 1], [3, 3]]
    assert not {c["task_id"] for c in old} & {c["task_id"] for c in new}
    assert sorted(m.headers["id"] for m in queued_messages(broker)) == sorted(c["task_id"] for c in new)

    with store_engine.connect() as conn:  # the outcome its successor will receive says which round it is
        outcome = build_outcome(conn, queries.batch(conn, uuid.UUID(done.batch_id)), 100)  # type: ignore[arg-type]
    assert (outcome["round"], outcome["retry_of"]) == (2, first.batch_id)

    # Round 2 runs: a third round is refused until it (and its successor) has finished.
    with pytest.raises(BatchNotFinished, match=r"\(round 2\) is still running \(2 of 2 children unfinished\)"):
        retry_failed(FanIn.of(app), first.batch_id)
    _finish(store_engine, done.batch_id, {1: "failed"}, successor="running")
    with pytest.raises(BatchNotFinished, match="its successor is still running"):
        retry_failed(FanIn.of(app), done.batch_id)
    _finish(store_engine, done.batch_id, {})
    third = retry_failed(FanIn.of(app), done.batch_id)  # any round's id: the latest round is retried
    assert (third.original, third.retried, third.retried_round, third.round, third.children) == (
        first.batch_id,
        done.batch_id,
        2,
        3,
        1,
    )
    assert third.batch_id is not None
    _finish(store_engine, third.batch_id, {})
    nothing = retry_failed(FanIn.of(app), first.batch_id)
    assert (nothing.batch_id, nothing.children, nothing.retried_round) == (None, 0, 3)


def test_retry_refused_for_an_open_batch_a_leaf_and_an_unknown_id(
    app: Celery, tasks: Tasks, store_engine: Engine
) -> None:
    fanin = FanIn.of(app)
    running = fan_in_group([tasks.add.s(1, 1), tasks.add.s(2, 2)], then=tasks.collect.s()).apply_async()
    with pytest.raises(BatchNotFinished, match="is still running"):
        retry_failed(fanin, running.batch_id)
    tree = fan_in_group([tasks.add.s(i, i) for i in range(4)], then=tasks.collect.s(), max_width=2).apply_async()
    with store_engine.connect() as conn:
        leaf = conn.execute(
            text("SELECT id FROM fanin_batches WHERE parent_id = :b LIMIT 1"), {"b": tree.batch_id}
        ).scalar_one()
    with pytest.raises(InvalidFanIn, match=f"leaf counter of batch {tree.batch_id}"):
        retry_failed(fanin, leaf)
    with pytest.raises(BatchNotFound):
        retry_failed(fanin, uuid.uuid4())
    with store_engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM fanin_batches WHERE retry_of IS NOT NULL")).scalar_one() == 0


def _report_values(app: Celery, engine: Engine, batch_id: str, outcomes: dict[int, object]) -> None:
    """Report each child of the batch by index: a value (succeeded, its result stored) or the string "failed"."""
    with engine.begin() as conn:
        rows = fetch_all(conn, "SELECT task_id, idx FROM fanin_children WHERE batch_id = :b", b=batch_id)
        for row in rows:
            value = outcomes[row["idx"]]
            if value == "failed":
                record_terminal(Held(conn), row["task_id"], "failed", exc_type="E")
            else:
                record_terminal(Held(conn), row["task_id"], "succeeded", result=encode_result(app, value))
        conn.execute(text("UPDATE fanin_successors SET state = 'succeeded' WHERE batch_id = :b"), {"b": batch_id})


def test_a_rounds_successor_sees_every_childs_last_outcome_across_the_rounds(
    app: Celery, tasks: Tasks, store_engine: Engine, broker: redis.Redis
) -> None:
    """Issue 40, item 4: a successor that sums its children saw only the retried round's (34 of 285). Round k of a
    retry holds the failures of round k - 1 in child order, so its child j stands for that round's j-th failure."""
    first = fan_in_group([tasks.add.s(i, i) for i in range(5)], then=tasks.collect.s("sum")).apply_async()
    _report_values(app, store_engine, first.batch_id, {0: 0, 1: "failed", 2: 4, 3: "failed", 4: 8})
    second = retry_failed(FanIn.of(app), first.batch_id)  # children 1 and 3
    assert second.batch_id is not None
    _report_values(app, store_engine, second.batch_id, {0: 2, 1: "failed"})
    third = retry_failed(FanIn.of(app), first.batch_id)  # child 3 again
    assert third.batch_id is not None
    _report_values(app, store_engine, third.batch_id, {0: 6})
    broker.delete(QUEUE)

    def outcome(batch_id: str) -> BatchOutcome:
        with store_engine.connect() as conn:
            message = build_outcome(conn, queries.batch(conn, uuid.UUID(batch_id)), 100)  # type: ignore[arg-type]
        return BatchOutcome.from_message(message, app=app)

    round2, round3 = outcome(second.batch_id), outcome(third.batch_id)
    assert [(r.index, r.state) for r in round2.results()] == [
        (0, "succeeded"),
        (1, "succeeded"),
        (2, "succeeded"),
        (3, "failed"),
        (4, "succeeded"),
    ]
    assert list(round2.values()) == [0, 2, 4, 8] and sum(round3.values()) == 0 + 2 + 4 + 6 + 8
    assert [r.state for r in round3.results()] == ["succeeded"] * 5
    assert [r.task_id for r in round3.results()][3] == child_ids(store_engine, third.batch_id)[
        0
    ]  # the run that gave child 3's outcome
    assert list(round2.values(rounds="this")) == [2] and list(outcome(first.batch_id).values()) == [0, 4, 8]
    with pytest.raises(ValueError, match="rounds must be"):
        list(round2.results(rounds="every"))
    # The first round's handle answers with the last round's successor (its stored result here).
    with store_engine.begin() as conn:
        conn.execute(
            text(
                "UPDATE fanin_successors SET result = :r, result_content_type = 'application/json', "
                "result_content_encoding = 'utf-8' WHERE batch_id = :b"
            ),
            {"r": b"20", "b": third.batch_id},
        )
    assert first.get(timeout=5) == 20 and first.result == 20
    assert FanInResult(app, second.batch_id).get(timeout=5) == 20
