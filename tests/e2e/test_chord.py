"""`from celery_fanin import chord` (issue 40, item 1): Celery's chord, changed by one import, with the fan-in's
guarantees, run by real workers with no result backend (tests/app.py sets none). Celery's own test_chord cases,
ported, are in test_chord_celery_cases.py; these are the drop-in's own promises: every call form, the list in
header order, the body not run (and its errbacks called once) when a header task fails, the bounds."""

from __future__ import annotations

import json
import uuid
from typing import Any

import psycopg
import pytest
from celery import chain, group, states
from celery.backends.base import DisabledBackend
from celery.exceptions import ChordError

from celery_fanin import ChordHeaderFailed, FanIn, FanInResult, InvalidFanIn, chord, fan_in_group
from celery_fanin.exceptions import SuccessorNotRerunnable
from celery_fanin.ops.rounds import retry_failed
from tests import app as tasks
from tests.sql import row_count, unsend_outbox
from tests.workers import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(150)]

TIMEOUT = 60


@pytest.fixture
def notes(e2e_env: dict[str, str]) -> Any:
    url = e2e_env["FANIN_DATABASE_URL"]
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(tasks.NOTES_TABLE_DDL)
        conn.execute("TRUNCATE e2e_notes")

    def read() -> list[tuple[str, Any]]:
        with psycopg.connect(url, autocommit=True) as conn:
            return [(r[0], r[1]) for r in conn.execute("SELECT label, value FROM e2e_notes ORDER BY id")]

    return read


def test_every_call_form_gives_the_body_the_results_in_header_order(producer: Any, processes: Any) -> None:
    assert isinstance(producer.backend, DisabledBackend), "the body's list is read from PostgreSQL"
    processes.worker(concurrency=4)
    processes.relay()
    header = [tasks.identity.s(i) for i in range(8)]  # finish in any order; the list keeps the header's
    handles: dict[str, FanInResult] = {
        "apply_async": chord(header, tasks.identity.s()).apply_async(),
        "delay": chord(header, tasks.tsum.s()).delay(),
        "called": chord(header, tasks.tsum.s(extra=100))(),
        "header then body": chord(header)(tasks.tsum.s(extra=1000)),
        "a group as header": chord(group(header), tasks.tsum.s()).apply_async(),
        # a chain in the header gives its last task's result
        "a chain in the header": chord(
            [tasks.add.s(1, 2) | tasks.add.s(3), tasks.identity.s(10)], tasks.identity.s()
        )(),
        "piped": (chord(header, tasks.tsum.s()) | tasks.add.s(1)).apply_async(),  # the task joins the body
        "in a chain": chain(tasks.identity.si(5), chord([tasks.add.s(1), tasks.add.s(2)], tasks.identity.s()))(),
        "immutable body": chord(header, tasks.identity.si("no results"))(),
        "a chain as body": chord(header, tasks.tsum.s() | tasks.add.s(1))(),
    }
    expected = {
        "apply_async": list(range(8)),
        "delay": 28,
        "called": 128,
        "header then body": 1028,
        "a group as header": 28,
        "a chain in the header": [6, 10],
        "piped": 29,
        "in a chain": [6, 7],  # the previous result reaches each header task first, as Celery's chord passes it
        "immutable body": "no results",
        "a chain as body": 29,
    }
    got = {name: handle.get(timeout=TIMEOUT) for name, handle in handles.items()}
    assert got == expected
    in_group = group(chord(header[:2], tasks.tsum.s()), chord(header[2:4], tasks.tsum.s())).apply_async()
    assert in_group.get(timeout=TIMEOUT) == [1, 5]
    first = handles["apply_async"]
    assert first.state == states.SUCCESS and first.parent.completed_count() == 8


def test_a_group_as_the_body_needs_no_result_backend(
    producer: Any, processes: Any, e2e_env: dict[str, str], notes: Any
) -> None:
    """A group as a chord's body, or `then=group(...)`, is written as a fan-in of its own, whose successor returns
    the members' values in order: no result backend (Celery's `replace` makes a group a chord, which needs one).
    The body's callbacks and the chain after it get that list; each batch writes one stage, under a key that a
    second run of its successor finds."""
    assert isinstance(producer.backend, DisabledBackend)
    processes.worker(concurrency=4)
    processes.relay()
    handle = chord([tasks.identity.s(1), tasks.identity.s(2)], group(tasks.tsum.s(), tasks.identity.s())).delay()
    linked = fan_in_group([tasks.ok.s(1), tasks.ok.s(2)], then=group(tasks.sum_values.s(), tasks.sum_values.s()))
    linked.link(tasks.note.s("linked"))
    linked_handle = linked.apply_async()
    chain(chord([tasks.identity.s(5)], group(tasks.tsum.s(), tasks.tsum.s(extra=1))), tasks.note.s("chained"))()
    assert handle.get(timeout=TIMEOUT) == [3, [1, 2]]
    assert linked_handle.get(timeout=TIMEOUT) == [30, 30]
    wait_for(
        lambda: sorted(notes()) == [("chained", [5, 6]), ("linked", [30, 30])],
        TIMEOUT,
        message="the callback and the chain to get the group's list",
    )
    with psycopg.connect(e2e_env["FANIN_DATABASE_URL"], autocommit=True) as conn:
        stages = conn.execute(
            "SELECT b.key, s.result IS NOT NULL FROM fanin_batches b JOIN fanin_successors s ON s.batch_id = b.id"
            " WHERE b.key LIKE 'then:%' ORDER BY b.key"
        ).fetchall()
    outer = sorted(f"then:{h.batch_id}:{h.batch_status().step}" for h in (handle, linked_handle))
    assert len(stages) == 3 and all(done for _, done in stages), stages
    assert outer == sorted(k for k, _ in stages if k in outer), "one stage for each batch, keyed by it"


def test_a_failed_header_task_stops_the_body_and_calls_its_errbacks_once(
    producer: Any, processes: Any, e2e_env: dict[str, str], notes: Any, successor_runs: Any
) -> None:
    processes.worker(concurrency=2)
    processes.relay()
    body = tasks.record_run.s("must not run")
    body.link_error(tasks.note.si("body errback", "errback"))
    handle = chord([tasks.ok.s(1), tasks.fail.s(2), tasks.ok.s(3), tasks.die.s(4)], body).apply_async()
    with pytest.raises(ChordHeaderFailed) as caught:
        handle.get(timeout=TIMEOUT)
    err = caught.value
    assert isinstance(err, ChordError), "a chord's error, as Celery's chord raises"
    assert [f["index"] for f in err.failures] == [1, 3] and err.batch_id == handle.batch_id
    text = str(err)
    assert "2 of 4 header tasks succeeded" in text and "tests.app.fail" in text and "tests.app.die" in text
    assert handle.state == states.FAILURE and handle.traceback is not None
    wait_for(lambda: notes() == [("errback", "body errback")], TIMEOUT, message="the body's errback to run")
    assert successor_runs(handle.batch_id) == [], "the body's code never ran"
    with psycopg.connect(e2e_env["FANIN_DATABASE_URL"], autocommit=True) as conn:
        row = conn.execute(
            "SELECT runs, state, exc_type FROM fanin_successors WHERE batch_id = %s", (handle.batch_id,)
        ).fetchone()
    assert row == (1, "failed", "ChordHeaderFailed"), "its run admitted once, and failed instead of run"
    # A copy of the body's message (the relay publishing its outbox row again) finds the run ended: refused by the
    # run guard, so no second errback.
    unsend_outbox(e2e_env, handle.batch_id)

    def duplicates() -> int:
        with psycopg.connect(e2e_env["FANIN_DATABASE_URL"], autocommit=True) as conn:
            found = conn.execute("SELECT duplicates FROM fanin_successors WHERE batch_id = %s", (handle.batch_id,))
            return int(found.fetchone()[0])  # type: ignore[index]

    wait_for(lambda: duplicates() == 1, TIMEOUT, message="the copy of the body's message to be refused")
    assert notes() == [("errback", "body errback")]
    restored = FanInResult.restore(handle.batch_id, producer)
    assert isinstance(restored.get(timeout=5, propagate=False), ChordHeaderFailed)
    assert json.dumps(err.failures)  # plain data, as Celery's errbacks may be sent it


def test_bounds_and_bad_input_are_refused_before_anything_is_written(producer: Any, e2e_env: dict[str, str]) -> None:
    def batches() -> int:
        return row_count(e2e_env, "fanin_batches")

    before = batches()
    producer.conf.fanin_chord_max_header = 3
    try:
        with pytest.raises(InvalidFanIn, match="fanin_chord_max_header=3.*fan_in_group"):
            chord([tasks.ok.s(i) for i in range(4)], tasks.tsum.s()).apply_async()
    finally:
        producer.conf.fanin_chord_max_header = 10_000
    with pytest.raises(InvalidFanIn, match="is a group"):
        chord([group(tasks.ok.s(1), tasks.ok.s(2))], tasks.tsum.s()).apply_async()
    with pytest.raises(InvalidFanIn, match="not one"):
        chord(tasks.ok.s(1), tasks.tsum.s())
    with pytest.raises(InvalidFanIn, match="needs then="):
        chord([tasks.ok.s(1)]).apply_async()
    assert batches() == before


def test_results_past_the_byte_bound_fail_the_body_with_a_clear_error(
    producer: Any, processes: Any, e2e_env: dict[str, str]
) -> None:
    # The worker whose report completes the batch publishes the body (or, after the handoff, the relay): both read
    # the bound.
    processes.worker(extra_env={"FANIN_TEST_CHORD_MAX_BYTES": "64"})
    producer.conf.fanin_chord_max_bytes = 64
    try:
        processes.relay()
        handle = chord([tasks.identity.s("x" * 50), tasks.identity.s("y" * 50)], tasks.record_run.s("too big"))()
        with pytest.raises(ChordHeaderFailed, match="fanin_chord_max_bytes.*fan_in_group"):
            handle.get(timeout=TIMEOUT)
        small = chord([tasks.identity.s("x"), tasks.identity.s("y")], tasks.identity.s())()
        assert small.get(timeout=TIMEOUT) == ["x", "y"]
    finally:
        producer.conf.fanin_chord_max_bytes = 16 * 1024 * 1024


def test_retry_failed_gives_the_body_every_result_across_the_rounds(producer: Any, processes: Any) -> None:
    """A chord whose header failed, retried with `fanin retry-failed` once the cause is gone: the retry round's body
    gets the whole header's results, in header order, and the first handle answers with it."""
    processes.worker(concurrency=2)
    processes.relay()
    key = f"chord-retry-{uuid.uuid4()}"
    first = chord([tasks.identity.s(1), tasks.fail_first_time.s(key), tasks.identity.s(3)], tasks.identity.s())()
    with pytest.raises(ChordHeaderFailed, match="2 of 3 header tasks succeeded"):
        first.get(timeout=TIMEOUT)
    round_two = retry_failed(FanIn.of(producer), first.batch_id)
    assert round_two.round == 2 and round_two.children == 1
    assert FanInResult.restore(str(round_two.batch_id), producer).get(timeout=TIMEOUT) == [1, key, 3]
    assert first.get(timeout=5) == [1, key, 3]
    # Round 1's body ran again in round 2: rerunning round 1's would run it (and its errbacks) twice.
    with pytest.raises(SuccessorNotRerunnable, match="retried since"):
        first.rerun()


def test_a_chain_or_group_bodys_own_errbacks_are_called_once_when_the_header_fails(
    producer: Any, processes: Any, notes: Any
) -> None:
    """As Celery's `chord_error_from_stack`: a chain body's `link_error`, and each member's of a group body."""
    processes.worker(concurrency=2)
    processes.relay()
    chained = tasks.identity.s() | tasks.identity.s()
    chained.link_error(tasks.note.si("chain body", "errback"))
    first, second = tasks.identity.s(), tasks.identity.s()
    first.link_error(tasks.note.si("group member 0", "errback"))
    second.link_error(tasks.note.si("group member 1", "errback"))
    handles = [chord([tasks.fail.s(1)], chained)(), chord([tasks.fail.s(2)], group(first, second))()]
    for handle in handles:
        with pytest.raises(ChordHeaderFailed):
            handle.get(timeout=TIMEOUT)
    expected = [("errback", "chain body"), ("errback", "group member 0"), ("errback", "group member 1")]
    wait_for(lambda: sorted(notes()) == expected, TIMEOUT, message="each body's errbacks, once")
