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


def _note_v2(engine: Engine, task_id: str, trace: str, exc_type: str | None, exc_message: str | None) -> bool:
    with engine.begin() as conn:
        sql = text("SELECT fanin_note_traceback_v2(:t, :tb, :et, :em)")
        return bool(conn.execute(sql, {"t": task_id, "tb": trace, "et": exc_type, "em": exc_message}).scalar())


def test_the_traceback_goes_only_onto_the_counted_failure_of_the_same_error(store_engine: Engine) -> None:
    """`fanin_note_traceback_v2` (version 35): a late report's traceback is written only where the counted failure
    has its error's type and text, since the late report may be another copy's, which failed otherwise."""
    _, children, _ = create(store_engine, 2)
    failed, lost = (c.task_id for c in children)
    with store_engine.begin() as conn:
        record_terminal(Held(conn), failed, "failed", exc_type="ValueError", exc_message="boom")
        record_terminal(Held(conn), lost, "lost", exc_type="WorkerLostError", exc_message=None)
    assert not _note_v2(store_engine, failed, "another copy's", "KeyError", "boom")
    assert not _note_v2(store_engine, failed, "another copy's", "ValueError", "bang")
    assert not _note_v2(store_engine, lost, "a copy that raised", "ValueError", "boom")
    assert _note_v2(store_engine, failed, "the counted run's", "ValueError", "boom")
    assert not _note_v2(store_engine, failed, "a second time", "ValueError", "boom"), "the first stays"
    assert _note_v2(store_engine, lost, "no message on either side", "WorkerLostError", None)
    with store_engine.connect() as conn:
        rows = conn.execute(
            text("SELECT task_id, traceback FROM fanin_children WHERE task_id IN (:a, :b)"), {"a": failed, "b": lost}
        ).all()
    assert dict(rows) == {failed: "the counted run's", lost: "no message on either side"}


def test_a_resent_failure_that_comes_back_late_keeps_its_traceback(store_engine: Engine, app: object) -> None:
    """The worker's report path: the first copy of a failure's report was counted but its answer never came back
    (a soft time limit in the wait; here the report sent straight to the store), so the worker sends it again,
    which is late. Its traceback is written, as the counted report's would have been; a late report of another
    error is not."""
    from celery_fanin import FanIn, protocol
    from celery_fanin.worker import runtime

    fanin = FanIn.of(app)  # type: ignore[arg-type]
    batch, children, _ = create(store_engine, 2)

    def fail(message: str) -> ValueError:
        try:
            raise ValueError(message)
        except ValueError as exc:
            return exc

    exc, other = fail("boom"), fail("another run's")
    for child in children:  # counted, the answers lost: no traceback written
        with store_engine.begin() as conn:
            record_terminal(Held(conn), child.task_id, "failed", exc_type="ValueError", exc_message="boom")
    resent, stranger = (
        runtime.current.reporter.record_child(
            fanin, c.task_id, protocol.Marker(str(batch.id), i, None, task_name="t.child"), "failed", exc=e
        )
        for i, (c, e) in enumerate(zip(children, (exc, other), strict=True))
    )
    assert resent is not None and resent.late and not resent.counted
    assert stranger is not None and stranger.late
    with store_engine.connect() as conn:
        rows = dict(
            conn.execute(
                text("SELECT task_id, traceback FROM fanin_children WHERE batch_id = :b"), {"b": batch.id}
            ).all()
        )
    assert rows[children[0].task_id] is not None and rows[children[0].task_id].endswith("ValueError: boom\n")
    assert rows[children[1].task_id] is None, "a late report of another error writes nothing"
