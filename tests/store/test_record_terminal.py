"""`store.reports.record_terminal` under racing reports: each child counted once, exactly one successor, one NOTIFY.

Every test talks to the real Postgres; racing reporters are threads (or spawned processes) with connections of
their own, released together by a barrier so the duplicate reports of one child really run concurrently.
"""

from __future__ import annotations

import dataclasses
import random
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine, text

from celery_fanin.store import batches, outbox
from celery_fanin.store import reports as store_reports
from celery_fanin.store.reports import record_terminal
from celery_fanin.store.statements import Runner, q
from tests.sql import Held, successor
from tests.sql import batch as batch_row
from tests.sql import outbox as outbox_rows

from .helpers import (
    Outcome,
    Report,
    create,
    deal,
    fetch_all,
    fetch_one,
    json_encoded,
    new_batch,
    notifications_until_sentinel,
    process_reporter,
    race_threads,
    report_all,
    run_spawned,
    snapshot,
)


def _handed_off(runner: Runner, batch_id: object) -> list[outbox.OutboxRow]:
    """The successor a report of this session created and the relay leaves to it (`fanin_handed_off`), read again."""
    return outbox.handed_off_rows(runner.one(q("handed_off"), {"batch": batch_id})[0])


# Mixed terminal states, one per child in turn: 3 of every 9 succeed.
# Where a report that came after the child was counted may be noted (bookkeeping, never a counter).
LATE_REPORT_COLUMNS = frozenset({"late_state", "late_at", "late_reports"})

STATES = (
    "succeeded",
    "failed",
    "succeeded",
    "time_limit",
    "succeeded",
    "worker_lost",
    "revoked",
    "rejected",
    "unknown",
)


@pytest.fixture
def listener(clean_db: str) -> Iterator[psycopg.Connection]:
    """A separate autocommit connection LISTENing on the relay's channel."""
    with psycopg.connect(clean_db, autocommit=True) as conn:
        conn.execute("LISTEN fanin_outbox")
        yield conn


def _reports(task_ids: list[str], state_of: dict[str, str], seed: int) -> list[Report]:
    """Each child reported 2 or 3 times; the copies of one child are neighbours, so dealing spreads them out."""
    rng = random.Random(seed)
    reports: list[Report] = []
    for task_id in task_ids:
        reports.extend([(task_id, state_of[task_id])] * rng.choice((2, 3)))
    return reports


def _assert_counted_once(outcomes: list[Outcome], task_ids: list[str], planned: int) -> None:
    counted = [o for o in outcomes if o[2]]
    per_child = Counter(o[0] for o in counted)
    assert set(per_child) == set(task_ids), "every child must be counted"
    assert max(per_child.values()) == 1, f"children counted twice: {[t for t, c in per_child.items() if c > 1]}"
    assert sum(1 for o in outcomes if o[2]) == planned
    # The counted reports took `remaining` through every value from planned-1 down to 0, each exactly once: the
    # decrements were serialised on the batch row, none lost and none doubled.
    assert sorted(o[3] for o in counted if o[3] is not None) == list(range(planned))
    # Reports that counted nothing saw no batch update at all.
    assert all(o[3] is None and not o[4] for o in outcomes if not o[2])
    creators = [o for o in outcomes if o[4]]
    assert len(creators) == 1, f"{len(creators)} reports claim to have created the successor"
    assert creators[0][3] == 0


def _assert_complete(engine: Engine, batch_id: uuid.UUID, planned: int, succeeded: int) -> None:
    with engine.connect() as conn:
        b = batch_row(conn, batch_id)
        assert (b["state"], b["remaining"], b["planned"]) == ("complete", 0, planned)
        assert (b["succeeded"], b["failed"]) == (succeeded, planned - succeeded)
        assert b["completed_at"] is not None
        assert conn.execute(text("SELECT count(*) FROM fanin_successors")).scalar_one() == 1
        assert conn.execute(text("SELECT count(*) FROM fanin_outbox")).scalar_one() == 1
        succ = fetch_one(conn, "SELECT * FROM fanin_successors WHERE batch_id = :id", id=batch_id)
        assert (succ["state"], succ["task_id"]) == ("pending", f"s-{batch_id.hex}")
        assert (
            conn.execute(
                text("SELECT count(*) FROM fanin_children WHERE batch_id = :id AND state = 'pending'"), {"id": batch_id}
            ).scalar_one()
            == 0
        )


def test_racing_reports_count_each_child_once_and_create_one_successor(
    store_engine: Engine, listener: psycopg.Connection, clean_db: str
) -> None:
    planned = 300
    batch, children, outbox_id = create(store_engine, planned)
    assert outbox_id is None
    task_ids = [c.task_id for c in children]
    state_of = {t: STATES[i % len(STATES)] for i, t in enumerate(task_ids)}
    expected_succeeded = sum(1 for s in state_of.values() if s == "succeeded")
    assert 0 < expected_succeeded < planned

    outcomes = race_threads(store_engine, deal(_reports(task_ids, state_of, seed=1), hands=16))

    _assert_counted_once(outcomes, task_ids, planned)
    _assert_complete(store_engine, batch.id, planned, expected_succeeded)
    with store_engine.connect() as conn:
        rows = fetch_all(conn, "SELECT task_id, state FROM fanin_children WHERE batch_id = :id", id=batch.id)
        assert {r["task_id"]: r["state"] for r in rows} == state_of
        [(out_id,)] = [tuple(r.values()) for r in outbox_rows(conn, batch.id, "id")]
    # Only the transaction that created the successor notified the relay, with the outbox row's id.
    assert notifications_until_sentinel(listener, clean_db) == [str(out_id)]


def test_conflicting_duplicate_reports_keep_the_state_that_counted(store_engine: Engine) -> None:
    """Copies of one report may disagree (a hard time limit reported while the child's own failure is recorded)."""
    planned = 120
    batch, children, _ = create(store_engine, planned)
    task_ids = [c.task_id for c in children]
    reports: list[Report] = []
    for i, t in enumerate(task_ids):
        reports += [(t, "succeeded"), (t, "failed"), (t, STATES[i % len(STATES)])]
    outcomes = race_threads(store_engine, deal(reports, hands=12))

    _assert_counted_once(outcomes, task_ids, planned)
    winner = {o[0]: o[1] for o in outcomes if o[2]}
    with store_engine.connect() as conn:
        rows = fetch_all(conn, "SELECT task_id, state FROM fanin_children WHERE batch_id = :id", id=batch.id)
    assert {r["task_id"]: r["state"] for r in rows} == winner
    _assert_complete(store_engine, batch.id, planned, sum(1 for s in winner.values() if s == "succeeded"))


def test_racing_reports_from_processes(store_engine: Engine, clean_db: str) -> None:
    planned = 200
    batch, children, _ = create(store_engine, planned)
    task_ids = [c.task_id for c in children]
    state_of = {t: STATES[(i * 7) % len(STATES)] for i, t in enumerate(task_ids)}
    hands = deal(_reports(task_ids, state_of, seed=2), hands=4)

    results = run_spawned(process_reporter, [(clean_db, hand) for hand in hands])
    outcomes: list[Outcome] = [tuple(o) for part in results for o in part]  # type: ignore[misc]

    _assert_counted_once(outcomes, task_ids, planned)
    _assert_complete(store_engine, batch.id, planned, sum(1 for s in state_of.values() if s == "succeeded"))


def test_two_batches_racing_do_not_cross(store_engine: Engine, listener: psycopg.Connection, clean_db: str) -> None:
    a, a_children, _ = create(store_engine, 60)
    b, b_children, _ = create(store_engine, 40)
    reports = [(c.task_id, "succeeded") for c in a_children] * 2 + [(c.task_id, "failed") for c in b_children] * 2
    random.Random(3).shuffle(reports)
    outcomes = race_threads(store_engine, deal(reports, hands=8))
    assert sum(1 for o in outcomes if o[4]) == 2
    with store_engine.connect() as conn:
        rows = fetch_all(conn, "SELECT id, state, remaining, succeeded, failed FROM fanin_batches ORDER BY planned")
        ids = fetch_all(conn, "SELECT id, batch_id FROM fanin_outbox")
    assert [(r["id"], r["state"], r["remaining"], r["succeeded"], r["failed"]) for r in rows] == [
        (b.id, "complete", 0, 0, 40),
        (a.id, "complete", 0, 60, 0),
    ]
    assert sorted(notifications_until_sentinel(listener, clean_db)) == sorted(str(r["id"]) for r in ids)


def _counted_nothing(rec: batches.TerminalRecord) -> bool:
    return (rec.counted, rec.remaining, rec.successor_created) == (False, None, False)


def test_late_report_after_completion_changes_nothing(store_engine: Engine) -> None:
    batch, children, _ = create(store_engine, 3)
    with store_engine.connect() as conn:
        report_all(conn, [(c.task_id, "succeeded") for c in children])
    before = snapshot(store_engine, batch.id, ignore=LATE_REPORT_COLUMNS)
    assert before["batch"][0]["state"] == "complete"

    for state in ("failed", "succeeded", "worker_lost"):
        with store_engine.begin() as conn:
            rec = record_terminal(Held(conn), children[1].task_id, state, exc_type="X", exc_message="late")
        assert _counted_nothing(rec), rec
    # Counters, the child's state, result and exception, the successor and the outbox are all as they were.
    assert snapshot(store_engine, batch.id, ignore=LATE_REPORT_COLUMNS) == before


def test_repeat_report_before_completion_is_not_counted(store_engine: Engine) -> None:
    batch, children, _ = create(store_engine, 2)
    with store_engine.begin() as conn:
        first = record_terminal(Held(conn), children[0].task_id, "failed", exc_type="E", exc_message="first")
    with store_engine.begin() as conn:
        again = record_terminal(Held(conn), children[0].task_id, "succeeded", result=json_encoded(1))
    assert (first.counted, first.remaining, first.successor_created) == (True, 1, False)
    assert _counted_nothing(again), again
    with store_engine.connect() as conn:
        b = fetch_one(conn, "SELECT remaining, succeeded, failed FROM fanin_batches WHERE id = :id", id=batch.id)
        c = fetch_one(conn, "SELECT * FROM fanin_children WHERE task_id = :t", t=children[0].task_id)
    assert b == {"remaining": 1, "succeeded": 0, "failed": 1}
    assert (c["state"], c["exc_message"], c["result"]) == ("failed", "first", None)


@pytest.mark.parametrize("state", ["pending", "started", "running", "SUCCESS", "success", "complete", ""])
def test_non_terminal_state_raises_and_writes_nothing(store_engine: Engine, state: str) -> None:
    batch, children, _ = create(store_engine, 1)
    before = snapshot(store_engine, batch.id)
    with store_engine.begin() as conn, pytest.raises(ValueError, match="not a terminal child state"):
        record_terminal(Held(conn), children[0].task_id, state)
    assert snapshot(store_engine, batch.id) == before


def test_unknown_task_id_counts_nothing(store_engine: Engine) -> None:
    batch, _, _ = create(store_engine, 2)
    before = snapshot(store_engine, batch.id)
    with store_engine.begin() as conn:
        rec = record_terminal(Held(conn), f"not-a-child-{uuid.uuid4()}", "succeeded", result=json_encoded(1))
    assert _counted_nothing(rec), rec
    assert snapshot(store_engine, batch.id) == before


def test_result_and_exception_are_stored(store_engine: Engine) -> None:
    batch, children, _ = create(store_engine, 3)
    binary = batches.Encoded("application/x-python-serialize", "binary", bytes(range(256)) + b"\x00tail")
    as_json = json_encoded({"rows": [1, 2, 3], "text": "é"})
    with store_engine.begin() as conn:
        record_terminal(Held(conn), children[0].task_id, "succeeded", result=binary)
    with store_engine.begin() as conn:
        record_terminal(Held(conn), children[1].task_id, "succeeded", result=as_json)
    with store_engine.begin() as conn:
        record_terminal(
            Held(conn),
            children[2].task_id,
            "time_limit",
            exc_type="TimeLimitExceeded",
            exc_message="TimeLimitExceeded(5)",
        )
    with store_engine.connect() as conn:
        rows = fetch_all(conn, "SELECT * FROM fanin_children WHERE batch_id = :id ORDER BY idx", id=batch.id)
    assert [r["idx"] for r in rows] == [0, 1, 2]
    got = [
        (None if r["result"] is None else bytes(r["result"]), r["result_content_type"], r["result_content_encoding"])
        for r in rows
    ]
    assert got == [
        (binary.body, binary.content_type, binary.content_encoding),
        (as_json.body, "application/json", "utf-8"),
        (None, None, None),
    ]
    assert [(r["exc_type"], r["exc_message"]) for r in rows] == [
        (None, None),
        (None, None),
        ("TimeLimitExceeded", "TimeLimitExceeded(5)"),
    ]
    assert all(r["finished_at"] is not None for r in rows)


def test_only_the_completing_report_notifies(store_engine: Engine, listener: psycopg.Connection, clean_db: str) -> None:
    batch, children, _ = create(store_engine, 5)
    with store_engine.connect() as conn:
        report_all(conn, [(c.task_id, "succeeded") for c in children[:4]])
    assert notifications_until_sentinel(listener, clean_db) == [], "a non-final report notified the relay"

    with store_engine.begin() as conn:
        rec = record_terminal(Held(conn), children[4].task_id, "failed")
    assert rec.successor_created
    with store_engine.connect() as conn:
        [(out_id,)] = [tuple(r.values()) for r in outbox_rows(conn, batch.id, "id")]
    assert notifications_until_sentinel(listener, clean_db) == [str(out_id)]

    with store_engine.connect() as conn:
        report_all(conn, [(c.task_id, "failed") for c in children])  # late duplicates of every child
    assert notifications_until_sentinel(listener, clean_db) == []


def test_rolled_back_completion_neither_counts_nor_notifies(
    store_engine: Engine, listener: psycopg.Connection, clean_db: str
) -> None:
    batch, children, _ = create(store_engine, 1)
    with store_engine.connect() as conn:
        with conn.begin() as tx:
            assert record_terminal(Held(conn), children[0].task_id, "succeeded").successor_created
            tx.rollback()
        assert notifications_until_sentinel(listener, clean_db) == []
        with conn.begin():
            rec = record_terminal(Held(conn), children[0].task_id, "succeeded")
    assert (rec.counted, rec.remaining, rec.successor_created) == (True, 0, True)
    assert len(notifications_until_sentinel(listener, clean_db)) == 1


def test_empty_batch_is_complete_at_creation_and_notifies_once(
    store_engine: Engine, listener: psycopg.Connection, clean_db: str
) -> None:
    batch, _, outbox_id = create(store_engine, 0)
    assert outbox_id is not None
    with store_engine.connect() as conn:
        b = batch_row(conn, batch.id)
        succ = fetch_all(conn, "SELECT batch_id, step, state FROM fanin_successors")
        out = fetch_all(conn, "SELECT id, batch_id, step, sent_at FROM fanin_outbox")
    assert (b["state"], b["planned"], b["remaining"]) == ("complete", 0, 0)
    assert b["completed_at"] is not None
    assert succ == [{"batch_id": batch.id, "step": "merge", "state": "pending"}]
    assert out == [{"id": outbox_id, "batch_id": batch.id, "step": "merge", "sent_at": None}]
    assert notifications_until_sentinel(listener, clean_db) == [str(outbox_id)]


def test_every_racing_duplicate_is_recorded_as_late(store_engine: Engine) -> None:
    planned = 200
    batch, children, _ = create(store_engine, planned)
    reports = [(c.task_id, "succeeded") for c in children for _ in range(3)]
    outcomes = race_threads(store_engine, deal(reports, hands=16))
    _assert_counted_once(outcomes, [c.task_id for c in children], planned)
    with store_engine.connect() as conn:
        late = conn.execute(
            text("SELECT sum(late_reports) FROM fanin_children WHERE batch_id = :id"), {"id": batch.id}
        ).scalar_one()
    assert late == len(reports) - planned, f"{len(reports) - planned} duplicate reports, {late} recorded as late"


def _settle_state(engine: Engine, batch_id: uuid.UUID) -> dict[str, object]:
    with engine.connect() as conn:
        return fetch_one(
            conn,
            "SELECT b.state, b.remaining, b.succeeded, b.failed, b.completed_at,"
            " (SELECT array_agg(kind) FROM fanin_successors s WHERE s.batch_id = b.id) AS successors,"
            " (SELECT count(*) FROM fanin_outbox o WHERE o.batch_id = b.id) AS outbox"
            " FROM fanin_batches b WHERE b.id = :id",
            id=batch_id,
        )


@pytest.mark.parametrize("on_failure", [False, True])
def test_failure_threshold_moves_the_batch_once_and_later_reports_only_count(
    store_engine: Engine, on_failure: bool
) -> None:
    """The report that passes max_failures moves the batch out of `running` and creates its successor (the
    on_failure one if there is one); the reports after it count, and create and move nothing."""
    batch, children = new_batch(5)
    batch = dataclasses.replace(batch, max_failures=1, on_failure=json_encoded("undo") if on_failure else None)
    with store_engine.begin() as conn:
        batches.create_batch(conn, batch, children)
    reports = [(children[0].task_id, "failed"), (children[1].task_id, "succeeded")]
    with store_engine.connect() as conn:
        report_all(conn, reports)
    assert _settle_state(store_engine, batch.id)["state"] == "running"  # one failure is allowed

    with store_engine.begin() as conn:
        moved = record_terminal(Held(conn), children[2].task_id, "failed", exc_type="E", exc_message="x")
    assert (moved.counted, moved.remaining, moved.successor_created) == (True, 2, True)
    after_move = _settle_state(store_engine, batch.id)
    kind = "on_failure" if on_failure else "then"
    assert after_move["state"] == "failed_threshold" and after_move["completed_at"] is not None
    assert (after_move["successors"], after_move["outbox"]) == ([kind], 1)

    for task_id, state in ((children[3].task_id, "failed"), (children[4].task_id, "succeeded")):
        with store_engine.begin() as conn:
            rec = record_terminal(Held(conn), task_id, state, exc_type="E" if state == "failed" else None)
        assert rec.counted and not rec.successor_created
    final = _settle_state(store_engine, batch.id)
    assert (final["state"], final["remaining"], final["succeeded"], final["failed"]) == ("failed_threshold", 0, 2, 3)
    assert final["completed_at"] == after_move["completed_at"]  # the move's time, not a later report's
    assert (final["successors"], final["outbox"]) == ([kind], 1)


def test_a_tree_settles_its_root_once_per_leaf_and_the_last_leaf_creates_the_successor(
    store_engine: Engine,
) -> None:
    batch, children = new_batch(6)
    with store_engine.begin() as conn:
        batches.create_batch(conn, batch, children, leaves=3)
    created = []
    for i, child in enumerate(children):  # child i is on leaf i % 3: leaves finish at reports 3, 4 and 5 (0-based)
        with store_engine.begin() as conn:
            rec = record_terminal(Held(conn), child.task_id, "failed" if i == 1 else "succeeded", exc_type="E")
        assert rec.counted
        created.append(rec.successor_created)
        root = _settle_state(store_engine, batch.id)
        assert root["remaining"] == 3 - max(0, i - 2), (i, root)  # the root counts leaves, each once
    assert created == [False] * 5 + [True]
    root = _settle_state(store_engine, batch.id)
    finished = (root["state"], root["succeeded"], root["failed"], root["successors"], root["outbox"])
    assert finished == ("complete", 5, 1, ["then"], 1)
    with store_engine.connect() as conn:
        leaves = fetch_all(
            conn, "SELECT state, remaining, completed_at FROM fanin_batches WHERE parent_id = :id", id=batch.id
        )
    assert [(leaf["state"], leaf["remaining"]) for leaf in leaves] == [("complete", 0)] * 3
    assert all(leaf["completed_at"] is not None for leaf in leaves)


def _report_all(
    url: str, children: list[batches.NewChild], batch: batches.NewBatch, handoff: float | None = None
) -> list[bool]:
    """Report every child succeeded on one worker-like report connection, with the worker's `handoff` (None: it
    does not publish its successors); whether each created the successor."""
    from celery_fanin.store.reports import ReportConnection

    reports = ReportConnection(url)
    try:
        return [
            record_terminal(
                reports, c.task_id, "succeeded", claim=batches.Claim(str(batch.id), i, c.task_name), handoff=handoff
            ).successor_created
            for i, c in enumerate(children)
        ]
    finally:
        reports.reset()


def _outbox_row(engine: Engine, batch_id: uuid.UUID) -> dict[str, Any]:
    with engine.connect() as conn:
        return fetch_one(
            conn,
            "SELECT id, sent_at IS NOT NULL AS sent, available_at > now() AS handed_off,"
            " extract(epoch FROM available_at - created_at) AS handoff FROM fanin_outbox WHERE batch_id = :id",
            id=batch_id,
        )


def test_a_report_from_a_worker_that_publishes_its_successors_does_not_wake_the_relay(
    store_engine: Engine, listener: psycopg.Connection, clean_db: str
) -> None:
    """`fanin_worker_publishes_successors`: the worker's report says so (`handoff` not None), and the report that
    creates the successor sends no NOTIFY (the worker publishes it after the commit); the row is created all the
    same. With no handoff (`fanin_successor_handoff = 0`) it is due at once and the worker claims it by its batch
    through the relay's claim. Without the setting (`handoff` None), the same report notifies as before."""
    from celery_fanin.store import outbox

    url = store_engine.url.render_as_string(hide_password=False)
    for publishes in (True, False):
        batch, children, _ = create(store_engine, 2)
        created = _report_all(url, children, batch, handoff=0.0 if publishes else None)
        assert created == [False, True]
        row = _outbox_row(store_engine, batch.id)
        assert not row["handed_off"], "no handoff: due for the relay at once"
        assert notifications_until_sentinel(listener, clean_db) == ([] if publishes else [str(row["id"])]), publishes
        with store_engine.begin() as conn:
            [claimed] = outbox.claim(conn, 10, batch_id=batch.id)
            assert claimed.id == row["id"] and claimed.batch is not None and claimed.batch.id == batch.id
            with store_engine.begin() as other:  # a relay's claim meanwhile skips the row this one holds
                assert outbox.claim(other, 10, [row["id"]]) == []
            outbox.mark_sent(conn, [claimed])
        with store_engine.begin() as conn:
            assert outbox.claim(conn, 10, batch_id=batch.id) == [], "sent: nothing left to claim"


def test_a_completed_batch_s_successor_is_handed_to_the_worker_that_reported(
    store_engine: Engine, listener: psycopg.Connection, clean_db: str
) -> None:
    """`fanin_successor_handoff`: the report that completes the batch creates its outbox row not due for the relay
    before the handoff, so the relay's claim skips it while the worker reads it (no lock), publishes, and marks it
    sent on its report connection; a second read finds nothing. Another connection's report (the relay's, a
    producer's) hands nothing off."""
    from celery_fanin.store import outbox
    from celery_fanin.store.reports import ReportConnection

    url = store_engine.url.render_as_string(hide_password=False)
    batch, children, _ = create(store_engine, 3)
    created = _report_all(url, children, batch, handoff=7.5)
    assert created == [False, False, True]
    row = _outbox_row(store_engine, batch.id)
    assert row["handed_off"] and not row["sent"] and float(row["handoff"]) == pytest.approx(7.5, abs=0.5)
    assert notifications_until_sentinel(listener, clean_db) == [], "the worker publishes it: no NOTIFY"
    with store_engine.begin() as conn:
        assert outbox.claim(conn, 10) == [] and outbox.claim(conn, 10, batch_id=batch.id) == [], "not due yet"

    reports = ReportConnection(url)
    try:
        [handed] = _handed_off(reports, batch.id)
        assert (handed.id, handed.batch_id, handed.step) == (row["id"], batch.id, batch.step)
        assert handed.batch is not None and handed.batch.state == "complete" and handed.batch.succeeded == 3
        assert handed.successor is not None and handed.successor.task_id == batch.successor_task_id
        with store_engine.begin() as conn:  # read, not locked: the row's lock is free (a relay would not skip it)
            assert (
                conn.execute(
                    text("SELECT id FROM fanin_outbox WHERE id = :id FOR UPDATE NOWAIT"), {"id": row["id"]}
                ).scalar_one()
                == row["id"]
            )
        store_reports.mark_sent(reports, [handed.id])
        assert _handed_off(reports, batch.id) == [], "sent: nothing left to hand off"
    finally:
        reports.reset()
    assert _outbox_row(store_engine, batch.id)["sent"]
    with store_engine.connect() as conn:
        assert successor(conn, batch.id, "state") == {"state": "sent"}


def test_a_nested_successor_s_end_on_a_handing_off_worker_leaves_the_outer_successor_to_the_relay_at_once(
    store_engine: Engine, listener: psycopg.Connection, clean_db: str
) -> None:
    """Migration 0032's reason: a worker that publishes its successors hands off only those its child reports
    create. A nested batch's successor ends on the same report connection (`successors.record_state`), and that end
    reports the outer child; when it completes the outer batch, nobody on this worker will publish the outer
    successor, so its outbox row is due for the relay now and the relay is woken (NOTIFY). Before 0032 a session
    setting made every statement of that connection hand off, and the outer successor waited out the handoff."""
    from celery_fanin.store import successors
    from celery_fanin.store.reports import ReportConnection

    url = store_engine.url.render_as_string(hide_password=False)
    outer, (outer_child,), _ = create(store_engine, 1)
    inner, (inner_child,) = new_batch(1)
    inner = dataclasses.replace(inner, parent_task_id=outer_child.task_id)
    with store_engine.begin() as conn:
        batches.create_batch(conn, inner, [inner_child])
    reports = ReportConnection(url)
    try:
        # The inner child's report, as a worker that publishes its successors makes it: handed off, no NOTIFY.
        done = record_terminal(
            reports, inner_child.task_id, "succeeded", claim=batches.Claim(str(inner.id), 0, "t.child"), handoff=60.0
        )
        assert done.successor_created
        assert _outbox_row(store_engine, inner.id)["handed_off"]
        assert notifications_until_sentinel(listener, clean_db) == []
        # The inner successor runs on this worker and ends, on the same connection: the outer batch completes.
        run = successors.claim_run(
            reports, inner.id, inner.step, inner.successor_task_id, 0, lease=60.0, grace=60.0, owner="h:m:1:1"
        )
        assert isinstance(run, successors.Run)
        assert successors.record_state(
            reports, inner.id, inner.step, "succeeded", run=run.number, result=json_encoded({"inner": "done"})
        )
    finally:
        reports.reset()
    with store_engine.connect() as conn:
        counted = fetch_one(conn, "SELECT state FROM fanin_children WHERE task_id = :t", t=outer_child.task_id)
    assert counted == {"state": "succeeded"}
    row = _outbox_row(store_engine, outer.id)
    assert not row["sent"] and not row["handed_off"], (
        "the outer successor was handed to a worker that will not publish it"
    )
    assert notifications_until_sentinel(listener, clean_db) == [str(row["id"])], "the relay was not woken"


def test_the_report_that_hands_off_a_successor_returns_it_as_a_claim_reads_it(store_engine: Engine) -> None:
    """Migration 0025: the completing report's statement returns the successor it handed to its session
    (`fanin_handed_off`, called after the report function in the same statement, sees what that function
    inserted), so its worker publishes with no second read; every value the publisher uses equals what the relay's
    claim reads for the same row, the JSON-only types (uuid, bytea, timestamptz, the timeout's seconds)
    included. The other reports return none."""
    from datetime import datetime, timedelta, timezone

    from celery_fanin.store import outbox
    from celery_fanin.store.reports import ReportConnection

    url = store_engine.url.render_as_string(hide_password=False)
    first, _, _ = create(store_engine, 0)
    batch, children = new_batch(3)
    batch = dataclasses.replace(
        batch,
        child_timeout=timedelta(seconds=90.25),
        deadline_at=datetime.now(timezone.utc) + timedelta(hours=1),
        on_expire=batches.Encoded("application/json", "utf-8", b'{"expire": "\\x00 \xc3\xa9"}'),
        on_failure=batches.Encoded("application/x-python-serialize", "binary", bytes(range(256))),
        round=2,
        retry_of=first.id,
    )
    with store_engine.begin() as conn:
        batches.create_batch(conn, batch, children)
    reports = ReportConnection(url)
    try:
        recs = [
            record_terminal(
                reports, c.task_id, "succeeded", claim=batches.Claim(str(batch.id), i, c.task_name), handoff=7.5
            )
            for i, c in enumerate(children)
        ]
        assert [r.handed_off for r in recs[:2]] == [None, None], "no successor created: nothing returned"
        returned = recs[2].handed_off
        assert returned is not None and len(returned) == 1
        read = _handed_off(reports, batch.id)
        # due now: the relay's claim takes it, and reads its columns as SQLAlchemy does
        store_reports.wake_relay(reports, batch.id)
    finally:
        reports.reset()
    with store_engine.begin() as conn:
        [claimed] = outbox.claim(conn, 10, batch_id=batch.id)
    for got in (returned[0], read[0]):
        assert (got.id, got.batch_id, got.step, got.attempts) == (claimed.id, batch.id, batch.step, claimed.attempts)
        assert got.batch == claimed.batch and got.successor == claimed.successor
    assert claimed.batch is not None and claimed.batch.on_failure_message == batch.on_failure
    assert claimed.batch.child_timeout_seconds == 90.25 and claimed.batch.retry_of == first.id


def test_a_batch_past_its_failure_threshold_is_not_handed_off(store_engine: Engine, clean_db: str) -> None:
    """A batch finished by its failure threshold needs its unfinished children abandoned in the claim's
    transaction: its row is due at once (claimed as the relay claims it), whatever the handoff."""
    from celery_fanin.store import outbox
    from celery_fanin.store.reports import ReportConnection

    url = store_engine.url.render_as_string(hide_password=False)
    batch, children = new_batch(3)
    batch = dataclasses.replace(batch, max_failures=0)
    with store_engine.begin() as conn:
        batches.create_batch(conn, batch, children)
    reports = ReportConnection(url)
    try:
        rec = record_terminal(
            reports,
            children[0].task_id,
            "failed",
            claim=batches.Claim(str(batch.id), 0, children[0].task_name),
            handoff=7.5,
        )
        assert rec.successor_created
        assert _handed_off(reports, batch.id) == []
    finally:
        reports.reset()
    assert not _outbox_row(store_engine, batch.id)["handed_off"]
    with store_engine.begin() as conn:
        [claimed] = outbox.claim(conn, 10, batch_id=batch.id)
        assert claimed.batch is not None and claimed.batch.state == "failed_threshold"


def test_wake_relay_makes_a_handed_off_row_due_at_once(
    store_engine: Engine, listener: psycopg.Connection, clean_db: str
) -> None:
    """A successor its worker leaves to the relay (a main-process report, a failed publish): `wake_relay` brings
    the handed-off row forward and notifies, and the relay's claim then takes it."""
    from celery_fanin.store import outbox
    from celery_fanin.store.reports import ReportConnection

    url = store_engine.url.render_as_string(hide_password=False)
    batch, children, _ = create(store_engine, 1)
    assert _report_all(url, children, batch, handoff=60.0) == [True]
    assert _outbox_row(store_engine, batch.id)["handed_off"]
    assert notifications_until_sentinel(listener, clean_db) == []
    reports = ReportConnection(url)
    try:
        store_reports.wake_relay(reports, batch.id)
    finally:
        reports.reset()
    assert not _outbox_row(store_engine, batch.id)["handed_off"]
    assert notifications_until_sentinel(listener, clean_db) == [""]
    with store_engine.begin() as conn:
        [claimed] = outbox.claim(conn, 10)
        assert claimed.batch_id == batch.id


def test_the_report_connection_sends_named_statements_as_positional_ones() -> None:
    """The report connection keeps one cursor and sends a list of values (`Statement.positional`): the names come
    back in the statement's order, repeats included, and a literal `%` is escaped, not taken for a placeholder."""
    from celery_fanin.store.statements import Statement

    sql, names = Statement("t", "a test", "SELECT :a, :b, :a, '100%' LIKE :c, '%(x)s'").positional
    assert sql == "SELECT %s, %s, %s, '100%%' LIKE %s, '%%(x)s'"
    assert names == ("a", "b", "a", "c")
    assert batches.RECORD_TERMINAL.positional[1] == (
        "batch_id", "task_id", "batch_id", "index", "task_name", "state", "result", "rct", "rce", "exc_type",
        "exc_message", "started_at", "attempt", "worker", "handoff",
    )  # fmt: skip
