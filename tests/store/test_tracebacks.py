"""A failed child's and a failed successor's traceback (issue 40, item 3): written once, after the report that
counted the failure, bounded by the function whatever the caller sends, and never for a success."""

from __future__ import annotations

import uuid

from sqlalchemy import Engine, text

from celery_fanin.store import queries
from celery_fanin.store.outcomes import build_outcome
from celery_fanin.store.reports import record_terminal
from tests.sql import Held

from .helpers import create, fetch_one


def _note(engine: Engine, task_id: str, trace: str) -> bool:
    with engine.begin() as conn:
        return bool(conn.execute(text("SELECT fanin_note_traceback(:t, :tb)"), {"t": task_id, "tb": trace}).scalar())


def test_a_failed_childs_traceback_is_kept_once_bounded_and_out_of_the_outcome(store_engine: Engine) -> None:
    batch, children, _ = create(store_engine, 3)
    failed, succeeded, pending = (c.task_id for c in children)
    assert not _note(store_engine, failed, "too early"), "a child not counted yet takes none"
    with store_engine.begin() as conn:
        record_terminal(Held(conn), failed, "failed", exc_type="ValueError", exc_message="boom")
        record_terminal(Held(conn), succeeded, "succeeded")
    long = "Traceback (most recent call last):\n" + "x" * 20_000 + "\nValueError: boom"
    assert _note(store_engine, failed, long)
    assert not _note(store_engine, failed, "a second copy's"), "the counted run's traceback stays"
    assert not _note(store_engine, succeeded, "never for a success")
    assert not _note(store_engine, pending, "nor for a child still running")
    assert not _note(store_engine, "no-such-task", "nor for nothing")
    with store_engine.connect() as conn:
        row = fetch_one(conn, "SELECT traceback FROM fanin_children WHERE task_id = :t", t=failed)
        [entry] = queries.failures(conn, batch.id)
        others = fetch_one(
            conn, "SELECT count(traceback) AS n FROM fanin_children WHERE task_id IN (:a, :b)", a=succeeded, b=pending
        )
    assert len(row["traceback"]) == 16_000 and row["traceback"].endswith("ValueError: boom"), "its end is kept"
    assert entry.traceback == row["traceback"] and others["n"] == 0
    with store_engine.begin() as conn:
        record_terminal(Held(conn), pending, "succeeded")
        outcome = build_outcome(conn, queries.batch(conn, batch.id), 100)  # type: ignore[arg-type]
    assert outcome["failures"][0]["exc_type"] == "ValueError" and "traceback" not in outcome["failures"][0]


def test_a_failed_successors_traceback_only_once_it_failed(store_engine: Engine) -> None:
    batch, children, _ = create(store_engine, 1)
    with store_engine.begin() as conn:
        record_terminal(Held(conn), children[0].task_id, "succeeded")

    def note(trace: str) -> bool:
        with store_engine.begin() as conn:
            sql = text("SELECT fanin_note_successor_traceback(:b, :s, :tb)")
            return bool(conn.execute(sql, {"b": batch.id, "s": batch.step, "tb": trace}).scalar())

    assert not note("the successor has not failed")
    with store_engine.begin() as conn:
        conn.execute(
            text("UPDATE fanin_successors SET state = 'failed', exc_type = 'E' WHERE batch_id = :b"), {"b": batch.id}
        )
    assert note("Traceback ...\nRuntimeError: no") and not note("again")
    with store_engine.connect() as conn:
        succ = queries.successor(conn, uuid.UUID(str(batch.id)), batch.step)
    assert succ is not None and succ.traceback == "Traceback ...\nRuntimeError: no"
