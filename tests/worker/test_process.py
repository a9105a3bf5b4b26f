"""`worker.process`: one object per process for what owns a thread and a queue, made anew in a forked pool
process (whose parent's threads do not exist there, and whose parent's queued work is the parent's)."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from celery_fanin.worker import process, report, starts, successor_runs


class _Owned:
    def __init__(self) -> None:
        self.queued: list[str] = []


def _in_child(check: object) -> int:
    """Fork, run `check` in the child (an assertion error exits 1), and return the child's exit status (-9: it
    hung for 10 s and was killed)."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child's coverage is not collected
        code = 0
        try:
            check()  # type: ignore[operator]
        except BaseException:  # noqa: BLE001 - any failure is the child's exit status
            code = 1
        os._exit(code)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)  # polling a child's exit: there is no waitpid with a timeout
    os.kill(pid, signal.SIGKILL)  # stuck (a lock it inherited held): killed, so that it outlives no test
    os.waitpid(pid, 0)
    return -signal.SIGKILL


@pytest.mark.timeout(30)
def test_each_process_holds_its_own_and_a_forked_child_starts_empty() -> None:
    parent = process.held(_Owned)
    assert process.held(_Owned) is parent, "one object per process"
    parent.queued.append("the parent's")

    def child() -> None:
        mine = process.held(_Owned)
        assert mine is not parent and mine.queued == [], "a forked child used its parent's object"
        assert process.held(_Owned) is mine

    assert _in_child(child) == 0
    assert process.held(_Owned) is parent and parent.queued == ["the parent's"]


@pytest.mark.timeout(30)
def test_the_worker_s_per_process_objects_are_made_anew_after_a_fork() -> None:
    """The three that own a thread: background reports, the start recorders, the successors' heartbeat."""
    ours = (report.background(), process.held(starts._Recorders), successor_runs._heartbeat())
    done = threading.Event()
    ours[0].submit(done.set)  # the parent's background thread runs
    assert done.wait(10)

    def child() -> None:
        theirs = (report.background(), process.held(starts._Recorders), successor_runs._heartbeat())
        assert all(a is not b for a, b in zip(ours, theirs, strict=True)), "a forked child kept a parent's object"
        ran = threading.Event()
        theirs[0].submit(ran.set)  # the child's own thread, started on first use
        assert ran.wait(10), "the child's background reports never ran"
        assert theirs[0].flush(5) and starts.recorders() == []

    assert _in_child(child) == 0


@pytest.mark.timeout(30)
def test_a_lock_held_by_another_thread_at_the_fork_does_not_block_the_child() -> None:
    """A parent thread may be making its object (holding the registry's lock) when a pool process is forked."""
    taken, release = threading.Event(), threading.Event()

    def slow() -> _Slow:
        taken.set()
        release.wait(10)
        return _Slow()

    class _Slow:
        pass

    holder = threading.Thread(target=process.held, args=(slow,))
    holder.start()
    try:
        assert taken.wait(10)
        assert _in_child(lambda: process.held(_Owned)) == 0
    finally:
        release.set()
        holder.join(10)


class _Inner:
    pass


class _Outer:
    """Made by `held`, and asks `held` for another object while it is being made."""

    def __init__(self) -> None:
        self.inner = process.held(_Inner)


@pytest.mark.timeout(30)
def test_a_maker_may_ask_for_another_process_object() -> None:
    """The registry's lock is taken while an object is made: a maker that asks for another one must not deadlock
    on it (second review, 2026-12-05). Run in a thread, so that a deadlock fails the test instead of hanging it."""
    made: list[_Outer] = []
    t = threading.Thread(target=lambda: made.append(process.held(_Outer)), daemon=True)
    t.start()
    t.join(10)
    assert made, "held() deadlocked when a maker called it"
    assert made[0].inner is process.held(_Inner) and process.held(_Outer) is made[0]


@pytest.mark.timeout(30)
def test_a_key_that_would_be_new_on_every_call_is_refused() -> None:
    """A lambda or a partial made at the call is a new key each time: held() would make a new object on every
    call and keep them all, which is the opposite of what it is for."""
    import functools

    with pytest.raises(TypeError, match="module-level function"):
        process.held(lambda: _Owned())
    with pytest.raises(TypeError, match="module-level function"):
        process.held(functools.partial(_Owned))
