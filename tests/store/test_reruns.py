"""`fanin_rerun_successor` (issue 40, item 5): only a failed or revoked successor goes back to pending, under a new
task id that its run guard then admits alone (an earlier delivery's copy, or an event about one, is refused), with
the run numbers going on, recorded once per rerun, its outbox row due again; two operators at once rerun it once."""

from __future__ import annotations

import threading
import uuid

import pytest
from sqlalchemy import Engine, text

from celery_fanin.store import batches, successors
from celery_fanin.store.reports import record_terminal
from tests.sql import Held

from .helpers import create, fetch_one

LEASE, GRACE = 60.0, 60.0


def _claim(engine: Engine, batch: batches.NewBatch, task_id: str) -> successors.Run | successors.Refusal:
    with engine.begin() as conn:
        return successors.claim_run(
            Held(conn), batch.id, batch.step, task_id, 0, lease=LEASE, grace=GRACE, owner="w:1:", owner_key="k"
        )


def _finished(engine: Engine, *, state: str = "failed") -> batches.NewBatch:
    """A batch whose successor ran once and ended `state`."""
    batch, children, _ = create(engine, 1)
    with engine.begin() as conn:
        record_terminal(Held(conn), children[0].task_id, "succeeded")
    run = _claim(engine, batch, batch.successor_task_id)
    assert isinstance(run, successors.Run) and run.number == 1
    with engine.begin() as conn:
        assert successors.record_state(
            Held(conn), batch.id, batch.step, state, run=1, exc_type="RuntimeError", exc_message="bug"
        )
    return batch


def _rerun(engine: Engine, batch: batches.NewBatch, task_id: str) -> tuple[object, ...]:
    with engine.begin() as conn:
        return successors.rerun(conn, batch.id, batch.step, task_id, "ops@test")


def test_a_failed_successor_reruns_under_a_new_task_id_alone(store_engine: Engine) -> None:
    batch = _finished(store_engine)
    with store_engine.begin() as conn:  # as the relay left it: sent
        conn.execute(text("UPDATE fanin_outbox SET sent_at = now() WHERE batch_id = :b"), {"b": batch.id})
    assert _rerun(store_engine, batch, "rerun-1") == (1, "pending", batch.successor_task_id, "failed")
    with store_engine.connect() as conn:
        row = fetch_one(
            conn,
            "SELECT s.task_id, s.state, s.runs, s.exc_type, s.result, o.sent_at, o.last_error FROM fanin_successors s"
            " JOIN fanin_outbox o USING (batch_id, step) WHERE s.batch_id = :b",
            b=batch.id,
        )
        [record] = successors.reruns(conn, batch.id, batch.step)
    assert (row["task_id"], row["state"], row["runs"], row["exc_type"]) == ("rerun-1", "pending", 1, None)
    assert row["sent_at"] is None and row["last_error"] == "rerun", "its outbox row is due again"
    assert (record.rerun, record.previous_task_id, record.previous_exc_type, record.previous_runs) == (
        1,
        batch.successor_task_id,
        "RuntimeError",
        1,
    )
    assert record.requested_by == "ops@test"
    # A late copy of the first delivery, and an event about one, are refused; the rerun's delivery is admitted.
    assert isinstance(_claim(store_engine, batch, batch.successor_task_id), successors.Refusal)
    with store_engine.begin() as conn:
        assert not successors.record_state(Held(conn), batch.id, batch.step, "revoked", task_id=batch.successor_task_id)
    run = _claim(store_engine, batch, "rerun-1")
    assert isinstance(run, successors.Run) and run.number == 2, "the run numbers go on"
    with store_engine.begin() as conn:
        assert successors.record_state(Held(conn), batch.id, batch.step, "succeeded", run=2)
    # Succeeded now: not run again; and a rerun's task id must be new.
    assert _rerun(store_engine, batch, "rerun-2") == (None, "succeeded", "rerun-1", "succeeded")


def test_what_is_not_failed_or_revoked_is_refused(store_engine: Engine) -> None:
    running, children, _ = create(store_engine, 1)
    assert _rerun(store_engine, running, "x") == (None, None, None, None), "no successor yet"
    with store_engine.begin() as conn:
        record_terminal(Held(conn), children[0].task_id, "succeeded")
    assert _rerun(store_engine, running, "x")[:2] == (None, "pending")
    assert isinstance(_claim(store_engine, running, running.successor_task_id), successors.Run)
    assert _rerun(store_engine, running, "x")[:2] == (None, "running"), "never under a live run"
    revoked = _finished(store_engine, state="revoked")
    with pytest.raises(Exception, match="a task id of its own"):
        _rerun(store_engine, revoked, revoked.successor_task_id)
    assert _rerun(store_engine, revoked, "r1")[0] == 1
    with store_engine.connect() as conn:
        assert not successors.reruns(conn, running.id, running.step)


def test_two_operators_at_once_rerun_it_once(store_engine: Engine) -> None:
    batch = _finished(store_engine)
    got: list[tuple[object, ...]] = []
    barrier = threading.Barrier(2)

    def one(task_id: str) -> None:
        barrier.wait(10)
        got.append(_rerun(store_engine, batch, task_id))

    threads = [threading.Thread(target=one, args=(f"op-{uuid.uuid4().hex[:6]}",)) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(g[0] is None for g in got) == [False, True], got
    with store_engine.connect() as conn:
        assert len(successors.reruns(conn, batch.id, batch.step)) == 1
