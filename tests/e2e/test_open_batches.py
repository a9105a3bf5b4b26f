"""Open (streaming) batches always end, with real workers, the relay and producer subprocesses: a producer killed
mid-stream is sealed after `fanin_open_batch_grace`; a generator that raises; `fanin seal` and `fanin cancel`
through Celery's CLI; deadlines and reconciliation of open batches; and `wait()` returning for every final state."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from celery.canvas import Signature
from celery.exceptions import TaskRevokedError

from celery_fanin import BatchNotOpen, FanInResult, fan_in_group
from tests import app as tasks
from tests.e2e.test_cli import celery, fanin
from tests.sql import rows
from tests.workers import ROOT, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

Runs = Callable[[str], list[dict[str, Any]]]
NOWHERE = "fanin-no-worker-consumes-this"  # children sent here never run: their batch waits for its deadline


class StreamProducer:
    """`python -m tests.e2e.stream_producer ...` in a subprocess, its output in a file read as it grows."""

    def __init__(self, env: dict[str, str], tmp_path: Path, *args: str) -> None:
        self.out = tmp_path / f"producer-{os.getpid()}-{len(list(tmp_path.iterdir()))}.out"
        self._file = self.out.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.e2e.stream_producer", *args],
            cwd=ROOT,
            env={**os.environ, **env, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"},
            stdout=self._file,
            stderr=subprocess.STDOUT,
        )

    def lines(self) -> list[str]:
        return self.out.read_text().splitlines()

    def wait_paused(self) -> str:
        """Wait until every chunk before the pause is committed and published; returns the batch id."""
        wait_for(lambda: "PAUSED" in self.lines() or self.proc.poll() is not None, 60, message="producer paused")
        assert "PAUSED" in self.lines(), self.out.read_text()
        return self.lines()[0]

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def finish(self) -> tuple[int, str]:
        code = self.proc.wait(60)
        self._file.close()
        return code, self.out.read_text()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.kill()
        self._file.close()


@pytest.fixture
def stream_producers(e2e_env: dict[str, str], tmp_path: Path) -> Iterator[Callable[..., StreamProducer]]:
    started: list[StreamProducer] = []

    def start(*args: str) -> StreamProducer:
        p = StreamProducer(e2e_env, tmp_path, *args)
        started.append(p)
        return p

    yield start
    for p in started:
        p.close()


def _stream(children: Iterator[Signature], **options: Any) -> FanInResult:
    chunk_size = tasks.app.conf.get("fanin_chunk_size")
    tasks.app.conf.fanin_chunk_size = 5
    try:
        return fan_in_group(children, then=tasks.record_run.s("stream"), **options).apply_async()
    finally:
        tasks.app.conf.fanin_chunk_size = chunk_size


# --- a producer that dies mid-stream ---------------------------------------------------------------------------


def test_producer_killed_mid_stream_is_sealed_after_the_grace(
    producer: Any, processes: Any, stream_producers: Callable[..., StreamProducer], successor_runs: Runs
) -> None:
    grace = 3.0
    processes.worker()
    processes.relay(extra_env={"FANIN_TEST_OPEN_BATCH_GRACE": str(grace)})
    streaming = stream_producers("10")
    batch_id = streaming.wait_paused()
    handle = FanInResult(producer, batch_id)
    wait_for(lambda: handle.batch_status().succeeded == 10, 30, message="the ten children written so far to finish")
    # While the producer lives (paused in its generator, its lock held), the relay keeps renewing its lease: the
    # batch stays open well past the grace since its last chunk.
    last_chunk = rows(producer, "SELECT producer_seen_at FROM fanin_batches WHERE id = :b", b=batch_id)[0][0]
    wait_for(
        lambda: rows(
            producer,
            "SELECT 1 FROM fanin_batches WHERE id = :b AND state = 'open' "
            "AND producer_seen_at > :t + make_interval(secs => :g)",
            b=batch_id,
            t=last_chunk,
            g=grace,
        ),
        30,
        message="the relay to see the live producer past the grace",
    )
    assert handle.batch_status().state == "open" and successor_runs(batch_id) == []
    streaming.kill()
    final = handle.wait_batch(timeout=60)
    assert (final.state, final.planned, final.succeeded, final.failed) == ("complete", 10, 10, 0)
    assert final.successor_state == "succeeded"
    # Sealed no sooner than the grace after the producer was last seen alive (the lease is not renewed once the
    # batch is sealed, so it still says when that was).
    [(seen, completed)] = rows(
        producer, "SELECT producer_seen_at, completed_at FROM fanin_batches WHERE id = :b", b=batch_id
    )
    assert (completed - seen).total_seconds() >= grace
    runs = successor_runs(batch_id)
    assert len(runs) == 1 and runs[0]["outcome"]["planned"] == 10 and runs[0]["outcome"]["succeeded"] == 10


# --- a generator that raises -----------------------------------------------------------------------------------


def _raising(n: int) -> Iterator[Signature]:
    for i in range(n):
        yield tasks.ok.s(i)
    raise RuntimeError("the source API failed")


def test_generator_that_raises_without_a_key_cancels_its_batch(
    producer: Any, processes: Any, successor_runs: Runs
) -> None:
    processes.worker()
    processes.relay()
    with pytest.raises(RuntimeError, match="the source API failed"):
        _stream(
            _raising(7), deadline=timedelta(hours=1), on_deadline="abandon", on_expire=tasks.record_run.s("cleanup")
        )
    [(batch_id,)] = rows(producer, "SELECT id FROM fanin_batches WHERE parent_id IS NULL")
    status = FanInResult(producer, str(batch_id)).wait_batch(timeout=30)
    # The first chunk (5 children) was written and sent; the two pulled for the second were lost with the error.
    assert (status.state, status.planned, status.remaining) == ("cancelled", 5, 0)
    assert status.succeeded + status.failed == 5
    runs = successor_runs(str(batch_id))
    assert [r["label"] for r in runs] == ["cleanup"]  # on_expire, once; never the successor
    assert runs[0]["outcome"]["state"] == "cancelled"


def test_generator_that_raises_with_a_key_stays_open_for_a_rerun(
    producer: Any, processes: Any, successor_runs: Runs
) -> None:
    processes.worker()
    processes.relay()
    with pytest.raises(RuntimeError):
        _stream(_raising(7), key="flaky-source")
    [(batch_id, state, planned)] = rows(producer, "SELECT id, state, planned FROM fanin_batches")
    assert (state, planned) == ("open", 5)
    handle = _stream((tasks.ok.s(i) for i in range(12)), key="flaky-source")
    assert handle.batch_id == str(batch_id)
    final = handle.wait_batch(timeout=30)
    assert (final.state, final.planned, final.succeeded) == ("complete", 12, 12)
    assert len(successor_runs(handle.batch_id)) == 1


# --- operators: fanin seal and fanin cancel ----------------------------------------------------------------------


def test_fanin_seal_finishes_a_dead_producers_batch(
    e2e_env: dict[str, str],
    producer: Any,
    processes: Any,
    stream_producers: Callable[..., StreamProducer],
    successor_runs: Runs,
) -> None:
    processes.worker()
    processes.relay()  # the default grace (300 s): only the operator seals it here
    streaming = stream_producers("10")
    batch_id = streaming.wait_paused()
    streaming.kill()
    handle = FanInResult(producer, batch_id)
    wait_for(lambda: handle.batch_status().succeeded == 10, 30, message="the children to finish")
    assert handle.batch_status().state == "open"
    sealed = celery(e2e_env, "seal", batch_id)
    assert sealed.returncode == 0, sealed.stderr
    assert f"sealed batch {batch_id} with 10 children" in sealed.stdout
    final = handle.wait_batch(timeout=30)
    assert (final.state, final.successor_state) == ("complete", "succeeded")
    assert len(successor_runs(batch_id)) == 1
    again = fanin(producer, "seal", batch_id)  # the same command in this process (tests/e2e/test_cli.py)
    assert again.returncode == 1 and f"batch {batch_id} is complete: nothing to seal" in again.stderr
    unknown = fanin(producer, "seal", "5b2c1c3e-8f7e-4c1e-9a51-0d5b6a1e2f30")
    assert unknown.returncode == 1 and "no fan-in batch" in unknown.stderr


def test_fanin_cancel_ends_a_running_batch_and_runs_nothing(
    e2e_env: dict[str, str], producer: Any, processes: Any, successor_runs: Runs
) -> None:
    processes.worker()
    processes.relay()
    handle = fan_in_group(
        [tasks.ok.s(0), tasks.ok.s(1).set(queue=NOWHERE)], then=tasks.record_run.s("then")
    ).apply_async()
    wait_for(lambda: handle.batch_status().succeeded == 1, 30, message="the first child")
    done = celery(e2e_env, "cancel", handle.batch_id)
    assert done.returncode == 0, done.stderr
    assert f"cancelled batch {handle.batch_id}: cancelled, 1 unfinished children abandoned" in done.stdout
    status = handle.wait_batch(timeout=10)
    assert (status.state, status.successor_state, status.succeeded, status.failed) == ("cancelled", None, 1, 1)
    assert isinstance(handle.result, TaskRevokedError)  # as Celery has a revoked task's: nothing ran
    assert successor_runs(handle.batch_id) == []
    again = fanin(producer, "cancel", handle.batch_id)
    assert again.returncode == 1 and "is cancelled: nothing to cancel" in again.stderr


def test_fanin_cancel_proceed_runs_the_successor_with_what_arrived(
    e2e_env: dict[str, str], producer: Any, processes: Any, successor_runs: Runs
) -> None:
    processes.worker()
    processes.relay()
    handle = fan_in_group(
        [tasks.ok.s(0), tasks.ok.s(1).set(queue=NOWHERE)], then=tasks.record_run.s("then")
    ).apply_async()
    wait_for(lambda: handle.batch_status().succeeded == 1, 30, message="the first child")
    done = celery(e2e_env, "cancel", "--proceed", "--json", handle.batch_id)
    assert done.returncode == 0, done.stderr
    assert '"state": "partial"' in done.stdout
    status = handle.wait_batch(timeout=30)
    assert (status.state, status.successor_state) == ("partial", "succeeded")
    [run] = successor_runs(handle.batch_id)
    assert run["outcome"]["partial"] is True and run["outcome"]["abandoned"] == 1
    assert [f["exc_type"] for f in run["outcome"]["failures"]] == ["Cancelled"]


def test_fanin_cancel_of_a_live_producers_batch_stops_the_producer(
    e2e_env: dict[str, str],
    producer: Any,
    processes: Any,
    stream_producers: Callable[..., StreamProducer],
    tmp_path: Path,
    successor_runs: Runs,
) -> None:
    processes.worker()
    processes.relay()
    go = tmp_path / "go"
    streaming = stream_producers("10", "--go", str(go), "5")
    batch_id = streaming.wait_paused()
    done = celery(e2e_env, "cancel", batch_id)
    assert done.returncode == 0, done.stderr
    go.touch()  # the producer goes on: its next chunk finds the batch closed
    code, out = streaming.finish()
    assert code == 3 and "RAISED BatchClosed" in out, out
    status = FanInResult(producer, batch_id).wait_batch(timeout=10)
    assert (status.state, status.planned) == ("cancelled", 10)
    assert successor_runs(batch_id) == []


# --- deadlines and reconciliation of open batches ----------------------------------------------------------------


def test_deadline_ends_an_open_batch_under_a_live_producer(
    producer: Any,
    processes: Any,
    stream_producers: Callable[..., StreamProducer],
    tmp_path: Path,
    successor_runs: Runs,
) -> None:
    processes.worker()
    processes.relay()
    go = tmp_path / "go"
    streaming = stream_producers("10", "--deadline", "2", "--go", str(go), "5")
    batch_id = streaming.wait_paused()
    status = FanInResult(producer, batch_id).wait_batch(timeout=60)
    assert (status.state, status.planned, status.successor_state) == ("partial", 10, "succeeded")
    assert len(successor_runs(batch_id)) == 1
    go.touch()
    code, out = streaming.finish()
    assert code == 3 and "RAISED BatchClosed" in out, out
    assert FanInResult(producer, batch_id).batch_status().planned == 10


def test_reconcile_repairs_an_open_batch_and_leaves_it_open(
    e2e_env: dict[str, str],
    producer: Any,
    processes: Any,
    stream_producers: Callable[..., StreamProducer],
) -> None:
    processes.worker()
    streaming = stream_producers("10")
    batch_id = streaming.wait_paused()
    handle = FanInResult(producer, batch_id)
    wait_for(lambda: handle.batch_status().succeeded == 10, 30, message="the children to finish")
    rows(producer, "UPDATE fanin_batches SET remaining = 50, succeeded = 3 WHERE id = :b", b=batch_id)
    repaired = celery(e2e_env, "reconcile", "--json")
    assert repaired.returncode == 0, repaired.stderr
    assert batch_id in repaired.stdout and "counters recomputed from child rows" in repaired.stdout
    [(state, remaining, succeeded)] = rows(
        producer, "SELECT state, remaining, succeeded FROM fanin_batches WHERE id = :b", b=batch_id
    )
    assert (state, remaining, succeeded) == ("open", 1, 10)  # every child counted, the live producer's token kept


# --- wait() returns for every final state ------------------------------------------------------------------------


def test_wait_returns_for_every_final_state(producer: Any, processes: Any) -> None:
    processes.worker()
    processes.relay()
    then = tasks.record_run.s("then")
    stuck = tasks.ok.s(9).set(queue=NOWHERE)
    soon = {"deadline": timedelta(seconds=1)}
    handles = {
        "complete": fan_in_group([tasks.ok.s(1)], then=then).apply_async(),
        "partial": fan_in_group([tasks.ok.s(1), stuck], then=then, on_deadline="proceed", **soon).apply_async(),
        "expired": fan_in_group([stuck], then=then, on_deadline="abandon", **soon).apply_async(),
        "expired+on_expire": fan_in_group(
            [stuck], then=then, on_deadline="abandon", on_expire=tasks.record_run.s("x"), **soon
        ).apply_async(),
        "failed_threshold": fan_in_group([tasks.fail.s(1), stuck], then=then, max_failures=0).apply_async(),
        "cancelled": fan_in_group([stuck], then=then).apply_async(),
        "sealed-empty": _stream(iter([])),
    }
    assert handles["cancelled"].cancel().state == "cancelled"
    final = {name: h.wait_batch(timeout=30) for name, h in handles.items()}
    assert {name: (st.state, st.successor_state) for name, st in final.items()} == {
        "complete": ("complete", "succeeded"),
        "partial": ("partial", "succeeded"),
        "expired": ("expired", None),
        "expired+on_expire": ("expired", "succeeded"),
        "failed_threshold": ("failed_threshold", "succeeded"),
        "cancelled": ("cancelled", None),
        "sealed-empty": ("complete", "succeeded"),
    }
    assert isinstance(handles["expired"].result, TaskRevokedError)
    assert isinstance(handles["cancelled"].result, TaskRevokedError)
    with pytest.raises(BatchNotOpen, match="nothing to cancel"):
        handles["complete"].cancel()
    with pytest.raises(BatchNotOpen, match="nothing to seal"):
        handles["sealed-empty"].seal()
