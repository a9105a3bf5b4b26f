"""Trees of counters end to end: a failure threshold stops a whole tree early and its other children are revoked;
a successor's outcome stays small however many failures it lists. Real prefork workers and the relay."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from celery_fanin import BatchOutcome, FanIn, fan_in_group
from celery_fanin.relay import Relay
from tests import app as tasks
from tests.sql import rows
from tests.workers import RELAY_PUBLISHES, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(150)]

Runs = Callable[[str], list[dict[str, Any]]]


def test_a_tree_passes_max_failures_on_two_leaves_and_every_other_leaf_s_children_are_revoked(
    producer: Any, processes: Any, successor_runs: Runs
) -> None:
    processes.worker(concurrency=1)
    processes.relay()
    # 4 leaves of 3 (max_width=3), child i on leaf i % 4: the two failures are on leaves 1 and 2, and no leaf can
    # finish before the threshold passes (each still has two 2 s children to run).
    children = [tasks.sleepy.s(0), tasks.fail.s(1), tasks.fail.s(2), *[tasks.sleepy.s(2) for _ in range(9)]]
    handle = fan_in_group(
        children,
        then=tasks.record_run.s("then"),
        max_failures=1,
        on_failure=tasks.record_run.s("too-many"),
        max_width=3,
    ).apply_async()
    leaves = rows(producer, "SELECT id FROM fanin_batches WHERE parent_id = :b", b=handle.batch_id)
    assert len(leaves) == 4

    status = handle.wait_batch(timeout=60)
    assert status.state == "failed_threshold"
    runs = successor_runs(handle.batch_id)
    assert [r["label"] for r in runs] == ["too-many"]
    outcome = runs[0]["outcome"]
    assert (outcome["failed"], outcome["partial"]) == (2, True)
    assert outcome["succeeded"] <= 2 and outcome["unfinished"] >= 8  # well before the tree could have finished

    # The relay stopped the whole tree: every unfinished child of every leaf abandoned, the counters final.
    final = handle.batch_status()
    assert (final.remaining, final.succeeded + final.failed) == (0, 12)
    abandoned = rows(
        producer,
        "SELECT c.task_id, c.batch_id FROM fanin_children c JOIN fanin_batches b ON b.id = c.batch_id"
        " WHERE b.parent_id = :b AND c.state = 'abandoned'",
        b=handle.batch_id,
    )
    assert len(abandoned) >= 8 and len({r.batch_id for r in abandoned}) == 4
    # The revoke reached the worker: queued copies were discarded, reported as revoked, recorded late, not counted.
    wait_for(
        lambda: (
            rows(
                producer,
                "SELECT count(*) AS n FROM fanin_children c JOIN fanin_batches b ON b.id = c.batch_id"
                " WHERE b.parent_id = :b AND c.state = 'abandoned' AND c.late_state = 'revoked'",
                b=handle.batch_id,
            )[0].n
            >= 6
        ),
        60,
        message="the abandoned children's revoked reports",
    )
    ran = rows(
        producer,
        "SELECT count(*) AS n FROM fanin_children c JOIN fanin_batches b ON b.id = c.batch_id"
        " WHERE b.parent_id = :b AND c.state = 'succeeded'",
        b=handle.batch_id,
    )[0].n
    assert ran <= 3  # most of the 2 s children never ran
    after = handle.batch_status()
    assert (after.remaining, after.succeeded, after.failed) == (0, final.succeeded, final.failed)
    assert len(successor_runs(handle.batch_id)) == 1


@pytest.fixture
def small_outcomes(producer: Any) -> Iterator[int]:
    """The in-process relay of these tests lists at most 8 KiB of failures in an outcome."""
    before = producer.conf.get("fanin_outcome_max_bytes")
    producer.conf.fanin_outcome_max_bytes = 8192
    yield 8192
    producer.conf.fanin_outcome_max_bytes = before


def test_an_outcome_with_many_large_failures_stops_at_its_byte_budget_and_the_rest_stream_from_postgres(
    producer: Any, processes: Any, successor_runs: Runs, small_outcomes: int
) -> None:
    processes.worker(RELAY_PUBLISHES, concurrency=2)  # this test's relay round publishes it
    big = "x" * 2000
    # Each child fails with its (large) argument in its exception message too: about 4 KiB an entry.
    handle = fan_in_group([tasks.fail.s(f"{i}:{big}") for i in range(40)], then=tasks.record_run.s("big")).apply_async()
    relay = Relay(FanIn.of(producer))
    wait_for(lambda: relay.run_once() >= 1, 60, message="the successor published")
    status = handle.wait_batch(timeout=60)
    assert (status.failed, status.successor_state) == (40, "succeeded")
    [run] = successor_runs(handle.batch_id)
    outcome = run["outcome"]
    assert (outcome["failures_truncated"], outcome["failures_truncated_by"]) == (True, "bytes")
    listed = outcome["failures"]
    assert 0 < len(listed) < 40 and len(json.dumps(listed).encode()) <= small_outcomes
    assert all(f["args"] == [f"{f['index']}:{big}"] for f in listed)  # whole entries, arguments included
    # Everything past the last listed child is still in Postgres, streamed in child order.
    result = BatchOutcome.from_message(outcome, app=producer)
    rest = list(result.iter_failures(after=listed[-1]["index"], fetch_size=5))
    assert [f["index"] for f in listed + rest] == list(range(40))


@pytest.fixture
def small_chunks(producer: Any) -> Iterator[int]:
    """The producer writes a streamed batch 4 children per chunk."""
    producer.conf.fanin_chunk_size = 4
    yield 4
    producer.conf.fanin_chunk_size = None  # the default again


def test_a_streamed_tree_passing_its_threshold_before_it_is_sealed_stops_its_producer(
    producer: Any, processes: Any, successor_runs: Runs, small_chunks: int
) -> None:
    processes.worker(concurrency=1)
    processes.relay()
    consumed: list[int] = []

    def children() -> Iterator[Any]:
        for i in range(100):
            if i == 8:  # two chunks written and published: wait until the workers' failures stopped the batch
                wait_for(
                    lambda: rows(producer, "SELECT 1 FROM fanin_batches WHERE state = 'failed_threshold'"),
                    60,
                    message="the open batch to pass its threshold",
                )
            consumed.append(i)
            yield tasks.fail.s(i) if i < 3 else tasks.sleepy.s(2)

    handle = fan_in_group(
        children(),
        then=tasks.record_run.s("then"),
        max_failures=2,
        on_failure=tasks.record_run.s("too-many"),
        max_width=2,
    ).apply_async()
    assert len(consumed) <= 8 + small_chunks  # the chunk read after the threshold was rolled back, and no more read
    status = handle.wait_batch(timeout=60)
    assert (status.state, status.planned) == ("failed_threshold", 8)
    runs = successor_runs(handle.batch_id)
    assert [r["label"] for r in runs] == ["too-many"]
    assert runs[0]["outcome"]["failed"] == 3
    final = handle.batch_status()
    assert (final.remaining, final.succeeded + final.failed) == (0, 8)
    abandoned = rows(
        producer,
        "SELECT count(*) AS n FROM fanin_children WHERE state = 'abandoned'"
        " AND batch_id IN (SELECT id FROM fanin_batches WHERE id = :b OR parent_id = :b)",
        b=handle.batch_id,
    )[0].n
    assert abandoned >= 3  # of the five 2 s children, at most two ran before the relay stopped the batch
