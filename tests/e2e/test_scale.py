"""Scale end to end: streaming producers, trees of counters, idempotent keys, the depth bound, nested fan-ins and
pipelines."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import redis

from celery_fanin import FanIn, fan_in_group
from celery_fanin.store.reports import record_terminal
from tests import app as tasks
from tests.sql import Held, rows
from tests.workers import ROOT, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

Runs = Callable[[str], list[dict[str, Any]]]


def test_generator_of_20k_children_streams_into_a_tree_and_counts_exactly(producer: Any, clean_redis: str) -> None:
    """20,000 children from a generator, written and published a chunk at a time into a tree of 1,000-wide leaves
    (more leaves than the 16 a stream fills at once, so leaves fill up and new ones open), and exact counts when
    every child's outcome is reported (by 12 reporters here, racing as workers would). The size of the batch is
    not the claim (the benchmark runs 100,000): the chunks, the leaves and the race are."""
    n = 20_000
    source = (tasks.ok.s(i).set(queue="scale-test-nobody") for i in range(n))  # nobody consumes: reported below
    handle = fan_in_group(source, then=tasks.record_run.s("20k"), max_width=1000).apply_async()
    status = handle.batch_status()
    assert (status.planned, status.published, status.state) == (n, n, "running")
    shape = rows(
        producer,
        "SELECT count(*) AS leaves, coalesce(max(planned), 0) AS widest FROM fanin_batches WHERE parent_id = :b",
        b=handle.batch_id,
    )[0]
    assert shape.leaves >= 20 and shape.widest == 1000
    assert redis.Redis.from_url(clean_redis).llen("scale-test-nobody") == n
    task_ids = [
        r.task_id
        for r in rows(
            producer,
            "SELECT task_id FROM fanin_children WHERE batch_id IN (SELECT id FROM fanin_batches "
            "WHERE id = :b OR parent_id = :b)",
            b=handle.batch_id,
        )
    ]
    assert len(task_ids) == n
    rng = random.Random(7)
    states = {tid: ("failed" if rng.random() < 0.1 else "succeeded") for tid in task_ids}
    random.Random(8).shuffle(task_ids)
    engine = FanIn.of(producer).engine
    created = []

    def report(part: list[str]) -> None:
        # A connection per reporter, as a worker process keeps one; each report is its own transaction.
        with engine.connect() as conn:
            for tid in part:
                with conn.begin():
                    rec = record_terminal(Held(conn), tid, states[tid])
                if rec.successor_created:
                    created.append(tid)

    with ThreadPoolExecutor(12) as pool:  # within the engine's pool (5 + 10 overflow)
        list(pool.map(report, [task_ids[k::12] for k in range(12)]))
    final = handle.batch_status()
    expected_failed = sum(1 for s in states.values() if s == "failed")
    assert (final.succeeded, final.failed, final.remaining, final.state) == (
        n - expected_failed,
        expected_failed,
        0,
        "complete",
    )
    assert len(created) == 1
    assert final.successor_state == "pending"  # no relay running: it waits in the outbox


def test_producer_killed_mid_stream_resumes_with_the_same_key(
    e2e_env: dict[str, str], producer: Any, processes: Any, successor_runs: Runs
) -> None:
    env = {**os.environ, **e2e_env, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.e2e.producer_crash", "3000", "4", "--stream", "resume-me"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == -9, proc.stdout + proc.stderr
    batch_id = proc.stdout.split()[0]
    from celery_fanin import FanInResult

    open_status = FanInResult(producer, batch_id).batch_status()
    assert open_status.state == "open" and open_status.planned == 2000  # four chunks committed, three published
    processes.worker()
    processes.relay()
    chunk_size = tasks.app.conf.get("fanin_chunk_size")
    tasks.app.conf.fanin_chunk_size = 500
    try:
        handle = fan_in_group(
            (tasks.ok.s(i) for i in range(3000)), then=tasks.record_run.s("resumed"), key="resume-me"
        ).apply_async()
    finally:
        tasks.app.conf.fanin_chunk_size = chunk_size
    assert handle.batch_id == batch_id
    final = handle.wait_batch(timeout=180)
    assert (final.planned, final.succeeded, final.failed) == (3000, 3000, 0)
    idx = rows(
        producer,
        "SELECT count(*) AS n, count(DISTINCT idx) AS d, min(idx) AS lo, max(idx) AS hi FROM fanin_children "
        "WHERE batch_id IN (SELECT id FROM fanin_batches WHERE id = :b OR parent_id = :b)",  # a tree's too
        b=batch_id,
    )[0]
    assert (idx.n, idx.d, idx.lo, idx.hi) == (3000, 3000, 0, 2999)
    assert len(successor_runs(batch_id)) == 1


def test_concurrent_creation_with_the_same_key_returns_one_batch(producer: Any, clean_redis: str) -> None:
    barrier = threading.Barrier(8)
    ids: list[str] = []

    def create() -> None:
        barrier.wait()
        h = fan_in_group([tasks.ok.s(i) for i in range(50)], then=tasks.record_run.s("k"), key="cron:2026-11-29")
        ids.append(h.apply_async().batch_id)

    threads = [threading.Thread(target=create) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(ids) == 8 and len(set(ids)) == 1
    assert rows(producer, "SELECT count(*) AS n FROM fanin_batches")[0].n == 1
    assert rows(producer, "SELECT count(*) AS n FROM fanin_children")[0].n == 50
    assert redis.Redis.from_url(clean_redis).llen("celery") == 50  # published once
    from celery_fanin import InvalidFanIn

    with pytest.raises(InvalidFanIn, match="different child list"):
        fan_in_group(
            [tasks.ok.s(i) for i in range(51)], then=tasks.record_run.s("k"), key="cron:2026-11-29"
        ).apply_async()


def test_tree_batch_with_leaves_completing_concurrently(producer: Any, processes: Any, successor_runs: Runs) -> None:
    processes.worker(concurrency=2)
    processes.worker(concurrency=2)
    processes.relay()
    children = [tasks.fail.s(i) if i % 10 == 0 else tasks.ok.s(i) for i in range(600)]
    handle = fan_in_group(children, then=tasks.record_run.s("tree", with_values=True), max_width=50).apply_async()
    leaves = rows(
        producer,
        "SELECT count(*) AS n, max(planned) AS widest FROM fanin_batches WHERE parent_id = :b",
        b=handle.batch_id,
    )[0]
    assert (leaves.n, leaves.widest) == (12, 50)

    def consistent() -> bool:
        s = handle.batch_status()
        assert s.succeeded + s.failed + s.remaining == s.planned == 600
        return s.finished

    wait_for(consistent, 120, 0.2, "the tree batch to finish")
    run = successor_runs(handle.batch_id)
    assert len(run) == 1
    outcome = run[0]["outcome"]
    assert (outcome["planned"], outcome["succeeded"], outcome["failed"]) == (600, 540, 60)
    assert [f["index"] for f in outcome["failures"]] == list(range(0, 600, 10))
    assert run[0]["values"] == [i * 10 for i in range(600) if i % 10]


def test_depth_bound_raises_at_the_right_level(e2e_env: dict[str, str], producer: Any, processes: Any) -> None:
    processes.worker(extra_env={"FANIN_TEST_MAX_DEPTH": "2"})
    processes.relay()
    fan_in_group([tasks.recurse.s(1)], then=tasks.record_run.s("level-0")).apply_async()

    def deepest_failed() -> Any:
        found = rows(
            producer,
            "SELECT b.depth, c.state, c.exc_type, c.exc_message FROM fanin_children c "
            "JOIN fanin_batches b ON b.id = c.batch_id WHERE c.state = 'failed'",
        )
        return found[0] if found else None

    failed = wait_for(deepest_failed, 60, 0.2, "the child past the depth bound to fail")
    assert failed.depth == 2 and failed.exc_type == "FanInDepthExceeded"
    assert "past fanin_max_depth=2" in failed.exc_message
    depths = sorted(r.depth for r in rows(producer, "SELECT depth FROM fanin_batches"))
    assert depths == [0, 1, 2]  # nothing was written for depth 3
    lineage = rows(producer, "SELECT count(*) AS n FROM fanin_batches WHERE depth > 0 AND lineage IS NOT NULL")
    assert lineage[0].n == 2


def test_three_stage_pipeline_final_result_from_the_first_handle(producer: Any, processes: Any) -> None:
    processes.worker()
    processes.relay()
    pipeline = fan_in_group(
        [tasks.ok.s(i) for i in range(5)],
        then=fan_in_group(
            [tasks.ok.s(i) for i in range(3)],
            then=fan_in_group([tasks.ok.s(1), tasks.ok.s(2)], then=tasks.sum_values.s()),
        ),
    )
    first = pipeline.apply_async()
    assert first.final(timeout=90) == 30
    chain = rows(producer, "SELECT depth, lineage IS NOT NULL AS has_parent FROM fanin_batches ORDER BY depth")
    assert [(r.depth, r.has_parent) for r in chain] == [(0, False), (1, True), (2, True)]


def test_fan_in_whose_children_are_fan_ins(producer: Any, processes: Any, successor_runs: Runs) -> None:
    processes.worker(concurrency=2)
    processes.relay()
    children = [
        fan_in_group([tasks.ok.s(i) for i in range(4)], then=tasks.sum_values.s()),  # 0+10+20+30 = 60
        fan_in_group([tasks.ok.s(1)], then=tasks.failing_successor.s("inner")),  # its failure is the child's
        tasks.ok.s(7),
    ]
    handle = fan_in_group(children, then=tasks.record_run.s("outer", with_values=True)).apply_async()
    status = handle.wait_batch(timeout=90)
    assert (status.planned, status.succeeded, status.failed) == (3, 2, 1)
    run = successor_runs(handle.batch_id)
    assert len(run) == 1
    assert run[0]["values"] == [60, 70]
    failure = run[0]["outcome"]["failures"][0]
    assert failure["index"] == 1 and failure["exc_type"] == "RuntimeError"
    nested = rows(producer, "SELECT count(*) AS n FROM fanin_batches WHERE parent_task_id IS NOT NULL")[0].n
    assert nested == 2
