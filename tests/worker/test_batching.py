"""Group commits of terminal reports: `store.reports.record_terminals` (one statement for many reports) against the
real database, and `worker.batching`'s batcher thread with clients that stand for pool processes (the e2e tests
run it in a real prefork worker: tests/e2e/test_batched_reports.py)."""

from __future__ import annotations

import random
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery import Celery
from sqlalchemy import Engine, text

from celery_fanin import retry
from celery_fanin.context import FanIn
from celery_fanin.store import batches
from celery_fanin.store.reports import ReportConnection, record_terminals, reported
from celery_fanin.store.statements import Statement
from celery_fanin.worker import batching, process
from tests.sql import Held
from tests.sql import batch as batch_row
from tests.sql import outbox as outbox_rows
from tests.store.helpers import create

pytestmark = pytest.mark.timeout(120)


def _params(
    child: batches.NewChild, batch: batches.NewBatch, index: int, state: str = "succeeded", named_index: int = -1
) -> dict[str, object]:
    named = batches.Claim(str(batch.id), index if named_index < 0 else named_index, child.task_name)
    exc = None if state == "succeeded" else "ValueError"
    return batches.terminal_params(child.task_id, state, None, exc, exc, None, named, 5.0)


def _together(target: Callable[[Any], None], hands: list[Any]) -> None:
    """`target(hand)` for each hand, each in a thread of its own, at once; returns when all have ended."""
    threads = [threading.Thread(target=target, args=(hand,)) for hand in hands]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert not any(t.is_alive() for t in threads), "a thread did not end"


def test_a_group_counts_each_report_as_it_would_alone(store_engine: Engine) -> None:
    """Two batches' reports in one statement: counted, late (the same child twice in the group), refused (a claim
    that names another index), and the one that completes its batch gets the successor handed off to it."""
    a, a_children, _ = create(store_engine, 3)
    b, b_children, _ = create(store_engine, 2)
    group = [
        _params(a_children[2], a, 2),  # given first, but run last of its batch: sorted by batch and index
        _params(b_children[1], b, 1),
        _params(a_children[0], a, 0),
        _params(a_children[1], a, 1, "failed"),
        _params(a_children[1], a, 1),  # a copy of the same child: late, its first state kept
        _params(b_children[0], b, 0, named_index=1),  # names another index: refused, counts nothing
    ]
    with store_engine.begin() as conn:
        recs = [reported(row) for row in record_terminals(Held(conn), group, 5.0)]
    assert [(r.counted, r.late, r.refused) for r in recs] == [
        (True, False, False),
        (True, False, False),
        (True, False, False),
        (True, False, False),
        (False, True, False),
        (False, False, True),
    ]
    assert recs[0].successor_created and recs[0].remaining == 0
    assert recs[0].handed_off is not None and [h.batch_id for h in recs[0].handed_off] == [a.id]
    assert not any(r.successor_created for r in recs[1:])
    assert batch_row(store_engine, a.id, "state", "succeeded", "failed") == {
        "state": "complete",
        "succeeded": 2,
        "failed": 1,
    }
    assert batch_row(store_engine, b.id, "remaining")["remaining"] == 1


def test_racing_groups_over_a_tree_count_each_child_once_and_create_one_successor(store_engine: Engine) -> None:
    """Four reporters send a 600-child tree's reports (each child two or three times) in groups of up to 16, in
    shuffled orders: each child is counted once, exactly one report creates the successor. Two groups that meet
    in a deadlock (a leaf completed in one, its root held by the other) are sent again, as the batcher's pool
    processes would after its transient answer."""
    url = store_engine.url.render_as_string(hide_password=False)
    batch, children, _ = create(store_engine, 600)
    reports = [_params(c, batch, i) for i, c in enumerate(children) for _ in range(random.randint(2, 3))]
    random.Random(7).shuffle(reports)
    hands = [reports[i::4] for i in range(4)]
    counted: Counter[str] = Counter()
    created: list[str] = []
    lock = threading.Lock()
    start = threading.Barrier(4)
    errors: list[BaseException] = []

    def reporter(hand: list[dict[str, object]]) -> None:
        runner = ReportConnection(url)
        try:
            start.wait()
            for i in range(0, len(hand), 16):
                group = hand[i : i + 16]
                rows = retry.call(lambda g=group: record_terminals(runner, g, None), what="a group", timeout=60)
                with lock:
                    for params, row in zip(group, rows, strict=True):
                        rec = reported(row)
                        counted[str(params["task_id"])] += rec.counted
                        if rec.successor_created:
                            created.append(str(params["task_id"]))
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)
        finally:
            runner.reset()

    _together(reporter, hands)
    assert not errors, errors
    assert sorted(counted.values()) == [1] * 600
    assert len(created) == 1
    assert batch_row(store_engine, batch.id, "state", "remaining") == {"state": "complete", "remaining": 0}


@pytest.fixture
def batcher(app: Celery, monkeypatch: pytest.MonkeyPatch) -> Iterator[batching.ReportBatcher]:
    """The app's batcher thread, running in this process; the test's threads stand for pool processes (each with a
    client of its own, as each pool process has), so `active` is made true here."""
    app.conf.fanin_report_timeout = 10.0
    process.held(batching._client).close()  # this process's client, if an earlier test's batcher left it connected
    running = batching.ReportBatcher(FanIn.of(app))
    monkeypatch.setattr(batching, "_address", running.address)
    monkeypatch.setattr(batching, "_main_pid", -1)
    try:
        yield running
    finally:
        running.stop()
        process.held(batching._client).close()


def _through_batcher(fanin: FanIn, params: dict[str, object], client: batching._Client) -> batches.TerminalRecord:
    kind, what = client.call(params)
    assert kind == "row", what
    return reported(what)


def _pool_processes(app: Celery, store_engine: Engine, n: int, processes: int) -> dict[int, batches.TerminalRecord]:
    """`processes` clients (each a pool process's) report an `n`-child batch's children at once, each a share of
    them in turn: every child's record, by index."""
    fanin = FanIn.of(app)
    batch, children, _ = create(store_engine, n)
    recs: dict[int, batches.TerminalRecord] = {}
    start = threading.Barrier(processes)

    def pool_process(indexes: list[int]) -> None:
        client = batching._Client()
        try:
            start.wait()
            for i in indexes:
                recs[i] = _through_batcher(fanin, _params(children[i], batch, i), client)
        finally:
            client.close()

    _together(pool_process, [list(range(i, n, processes)) for i in range(processes)])
    assert sorted(recs) == list(range(n)) and all(r.counted for r in recs.values())
    return recs


def test_the_batcher_commits_reports_that_arrive_together_in_one_statement(
    app: Celery, store_engine: Engine, batcher: batching.ReportBatcher
) -> None:
    """Twelve clients report a 240-child batch at once: every child is counted once, the one that completes it
    gets the successor handed off, and reports shared statements (fewer statements than reports)."""
    recs = _pool_processes(app, store_engine, 240, 12)
    [done] = [r for r in recs.values() if r.successor_created]
    assert done.handed_off is not None and len(done.handed_off) == 1
    assert batcher.reports == 240 and batcher.groups < 240, (batcher.reports, batcher.groups)


def test_a_stopped_batcher_leaves_each_report_to_its_process(
    app: Celery, store_engine: Engine, batcher: batching.ReportBatcher
) -> None:
    """A worker stopping (its batcher gone, the socket removed): the pool process's report is sent on its own
    connection, counted as before."""
    fanin = FanIn.of(app)
    batch, (child,), _ = create(store_engine, 1)
    batcher.stop()
    rec = batching.record_terminal(fanin.reports, _params(child, batch, 0))
    assert rec.counted and rec.successor_created


def test_a_group_the_batcher_cannot_commit_is_sent_alone_on_the_pool_process_s_connection(
    app: Celery, store_engine: Engine, batcher: batching.ReportBatcher, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The batcher's own connection fails (here: a server that is not there; in a real run, a connection limit or a
    lost backend): the pool process sends its report alone at once, on its own connection, which still works,
    rather than sending it through the batcher again until `fanin_report_timeout` gives it up."""
    batch, (child,), _ = create(store_engine, 1)
    monkeypatch.setattr(batcher, "_runner", ReportConnection("postgresql://127.0.0.1:1/none"))
    rec = batching.record_terminal(FanIn.of(app).reports, _params(child, batch, 0))
    assert rec.counted and rec.successor_created
    assert batcher.groups == 0


def test_a_group_waiting_on_a_locked_batch_gives_up_its_wait_and_its_reports_go_alone(
    app: Celery, store_engine: Engine, batcher: batching.ReportBatcher
) -> None:
    """Another session holds a batch's row: the batcher's statement gives up waiting after LOCK_TIMEOUT, so that the
    reports of other batches queued behind it are not held for as long as the lock is; the report of the locked
    batch waits alone, on its pool process's connection, as it would without the batcher."""
    fanin = FanIn.of(app)
    locked, (held_child,), _ = create(store_engine, 1)
    other, (free_child,), _ = create(store_engine, 1)
    done: dict[str, batches.TerminalRecord] = {}
    with store_engine.connect() as holder:
        holder.execute(text("SELECT 1 FROM fanin_batches WHERE id = :b FOR UPDATE"), {"b": locked.id})
        waiting = threading.Thread(
            target=lambda: done.setdefault(
                "locked", batching.record_terminal(fanin.reports, _params(held_child, locked, 0))
            )
        )
        waiting.start()
        started = time.monotonic()
        done["other"] = batching.record_terminal(FanIn.of(app).reports, _params(free_child, other, 0))
        assert done["other"].counted and time.monotonic() - started < batching.LOCK_TIMEOUT + 5
        assert "locked" not in done, "the locked batch's report waits while the lock is held"
        holder.rollback()
    waiting.join(30)
    assert done["locked"].counted and done["locked"].successor_created


def test_an_interrupted_client_drops_its_socket_so_the_next_report_reads_its_own_answer(
    app: Celery, store_engine: Engine, batcher: batching.ReportBatcher, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A soft time limit raised while a pool process waits for its answer: the socket is closed, so that the answer
    still to come is never read as the next report's."""
    fanin = FanIn.of(app)
    batch, children, _ = create(store_engine, 2)
    client = batching._Client()

    def interrupted(sock: Any, size: int) -> bytes:
        raise KeyboardInterrupt("stands for SoftTimeLimitExceeded")

    with monkeypatch.context() as m:
        m.setattr(batching, "_receive", interrupted)
        with pytest.raises(KeyboardInterrupt):
            client.call(_params(children[0], batch, 0))
    assert client.sock is None
    rec = _through_batcher(fanin, _params(children[1], batch, 1), client)
    assert rec.counted and rec.remaining in (0, 1)
    second = _through_batcher(fanin, _params(children[0], batch, 0), client)
    assert not second.counted and second.late  # the interrupted one was committed: this copy is late
    client.close()


def test_the_batcher_starts_for_a_prefork_pool_only(app: Celery, monkeypatch: pytest.MonkeyPatch) -> None:
    app.conf.fanin_report_batching = True
    fanin = FanIn.of(app)
    for pool in ("solo", "threads"):
        assert batching.start(fanin, pool) is None
        assert not batching.active()
    started = batching.start(fanin, "prefork")
    try:
        assert started is not None and batching._address == started.address
        assert not batching.active(), "the main process's own reports never wait for its batcher"
    finally:
        batching.stop()
    assert batching._address is None and batching._batcher is None


def test_batching_is_off_by_default(app: Celery) -> None:
    assert batching.start(FanIn.of(app), "prefork") is None


def test_a_pool_process_whose_group_is_stuck_sends_its_report_alone_after_a_while(
    app: Celery, store_engine: Engine, batcher: batching.ReportBatcher, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A group stuck (on a row lock, say) must not hold every pool process: after `WAIT_SECONDS` each sends its
    report alone; the stuck group, once it goes on, finds the child counted (late) and counts nothing twice."""
    batch, (child,), _ = create(store_engine, 1)
    release = threading.Event()
    commit = batcher._commit

    def stuck(group: Any) -> None:
        release.wait(30)
        commit(group)

    monkeypatch.setattr(batcher, "_commit", stuck)
    try:
        rec = batching.record_terminal(FanIn.of(app).reports, _params(child, batch, 0), timeout=0.5)
    finally:
        release.set()
    assert rec.counted and rec.successor_created
    assert batch_row(store_engine, batch.id, "succeeded", "remaining") == {"succeeded": 1, "remaining": 0}


def test_a_report_the_batcher_committed_without_an_answer_wakes_the_relay_when_sent_alone(
    app: Celery, store_engine: Engine, batcher: batching.ReportBatcher, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The batcher committed the report that completed the batch, but its answer was lost: the report sent alone
    comes back late, and the successor handed to nobody is made due for the relay at once, not after the
    hand-off."""
    batch, (child,), _ = create(store_engine, 1)
    monkeypatch.setattr(batcher, "_answer", lambda sock, answer: batcher._forget(sock))
    rec = batching.record_terminal(FanIn.of(app).reports, _params(child, batch, 0))
    assert rec.late and not rec.counted
    [row] = outbox_rows(store_engine, batch.id, "sent_at", "available_at")
    with store_engine.connect() as conn:
        due = conn.execute(text("SELECT :at <= now()"), {"at": row["available_at"]}).scalar_one()
    assert row["sent_at"] is None and due, "the successor waits out the hand-off"


def test_a_connection_that_sends_something_unreadable_is_dropped_and_the_batcher_goes_on(
    app: Celery, store_engine: Engine, batcher: batching.ReportBatcher
) -> None:
    batch, (child,), _ = create(store_engine, 1)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as bad:
        bad.connect(batcher.address)
        bad.sendall(struct.pack("!I", 5) + b"\x00junk")
        bad.settimeout(5)
        assert bad.recv(16) == b"", "the batcher kept a connection that sent no report"
    client = batching._Client()
    try:
        assert _through_batcher(FanIn.of(app), _params(child, batch, 0), client).counted
    finally:
        client.close()


def test_groups_larger_than_max_group_are_split_and_each_report_answered(
    app: Celery, store_engine: Engine, batcher: batching.ReportBatcher, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(batching, "MAX_GROUP", 2)
    _pool_processes(app, store_engine, 60, 6)
    assert batcher.reports == 60 and batcher.groups >= 30


def _show(setting: str) -> Statement:
    return Statement(f"show_{setting}", "", f"SHOW {setting}")


def test_the_batcher_s_lock_timeout_is_added_to_the_url_s_own_options(database_url: str) -> None:
    """The lock bound is the batcher connection's alone, and keeps what the URL's `options` already set."""
    sep = "&" if "?" in database_url else "?"
    runner = ReportConnection(f"{database_url}{sep}options=-c%20statement_timeout%3D7000", lock_timeout=0.25)
    try:
        assert runner.one(_show("lock_timeout"), {}) == ("250ms",)
        assert runner.one(_show("statement_timeout"), {}) == ("7s",)
    finally:
        runner.reset()
    plain = ReportConnection(database_url)
    try:
        assert plain.one(_show("lock_timeout"), {}) == ("0",)
    finally:
        plain.reset()
