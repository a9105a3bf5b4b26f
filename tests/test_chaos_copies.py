"""The chaos suite's account of second copies (tests/chaos/copies.py), checked against the real store: a copy
counts once its row's counter moves (a child's late report, a successor's refused duplicate), never before."""

from __future__ import annotations

import psycopg
from sqlalchemy import Engine

from tests.chaos import copies
from tests.store.helpers import create


def _report(conn: psycopg.Connection[tuple[object, ...]], task_id: str) -> None:
    conn.execute(
        "SELECT fanin_record_terminal_v2(%s, 'succeeded', NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL)", (task_id,)
    )


def test_copies_count_only_once_their_effect_is_seen(clean_db: str, direct: Engine) -> None:
    batch, children, _ = create(direct, 2)
    with psycopg.connect(clean_db, autocommit=True) as conn:
        assert copies.send_successors_again(conn, 3) is None  # nothing sent yet: nothing to copy
        rows = copies.unfinished_children(conn, str(batch.id))
        assert sorted((r[2], r[-1]) for r in rows) == sorted((c.task_id, 0) for c in children)
        made = [copies.children_copied(rows)]
        assert copies.seen(made, copies.counts(conn, made)) == {copies.CHILDREN: 0, copies.SUCCESSORS: 0}

        _report(conn, children[0].task_id)  # the first copy: counted, not late
        assert copies.seen(made, copies.counts(conn, made))[copies.CHILDREN] == 0
        _report(conn, children[0].task_id)  # the second: late
        assert copies.seen(made, copies.counts(conn, made))[copies.CHILDREN] == 1

        _report(conn, children[1].task_id)  # completes the batch: its successor and outbox row
        (outbox_id,) = conn.execute("SELECT id FROM fanin_outbox WHERE batch_id = %s", (batch.id,)).fetchone() or ()
        conn.execute("SELECT fanin_outbox_sent(%s)", ([outbox_id],))
        again = copies.send_successors_again(conn, 3)
        assert again == copies.Copies(copies.SUCCESSORS, {batch.successor_task_id: 0})
        sent = conn.execute("SELECT sent_at FROM fanin_outbox WHERE id = %s", (outbox_id,)).fetchone()
        assert sent == (None,)  # back in line for the relay
        made.append(again)
        assert copies.seen(made, copies.counts(conn, made)) == {copies.CHILDREN: 1, copies.SUCCESSORS: 0}
        conn.execute("SELECT fanin_count_duplicate(%s, %s)", (batch.id, batch.step))  # the copy refused
        assert copies.seen(made, copies.counts(conn, made)) == {copies.CHILDREN: 1, copies.SUCCESSORS: 1}


def test_a_copy_of_rows_that_are_gone_or_unchanged_is_not_seen() -> None:
    made = [copies.Copies(copies.CHILDREN, {"a": 1, "b": 0}), copies.Copies(copies.SUCCESSORS, {"s": 2})]
    assert copies.seen(made, {copies.CHILDREN: {"a": 1}, copies.SUCCESSORS: {"s": 2}}) == {
        copies.CHILDREN: 0,
        copies.SUCCESSORS: 0,
    }
    assert copies.seen(made, {copies.CHILDREN: {"b": 1}, copies.SUCCESSORS: {"s": 3}}) == {
        copies.CHILDREN: 1,
        copies.SUCCESSORS: 1,
    }


def test_the_ledger_awaits_copies_for_their_patience_and_keeps_counts_through_an_outage() -> None:
    clock = [0.0]
    store: list[copies.Counts | None] = [{}]
    ledger = copies.Ledger(lambda made: store[0], patience=60.0, clock=lambda: clock[0])
    assert not ledger.waiting(copies.CHILDREN)  # nothing made: due
    ledger.add(copies.Copies(copies.CHILDREN, {"a": 0}))
    ledger.refresh()
    assert ledger.waiting(copies.CHILDREN) and not ledger.waiting(copies.SUCCESSORS)
    assert ledger.applied() == {copies.CHILDREN: 1}
    assert ledger.seen() == {copies.CHILDREN: 0, copies.SUCCESSORS: 0}
    clock[0] = 61.0
    assert not ledger.waiting(copies.CHILDREN)  # past its patience: presumed lost, due again
    store[0] = {copies.CHILDREN: {"a": 1}}
    ledger.refresh()
    assert ledger.seen() == {copies.CHILDREN: 1, copies.SUCCESSORS: 0}
    store[0] = None  # the store cannot be reached: what was read last stands
    ledger.refresh()
    assert ledger.seen()[copies.CHILDREN] == 1
    ledger.add(copies.Copies(copies.CHILDREN, {"b": 0}))  # a later application, not seen yet: awaited
    assert ledger.waiting(copies.CHILDREN) and ledger.applied() == {copies.CHILDREN: 2}
