"""Timestamps along the successor's path, for `python -m bench.latency --trace` (BENCH_TRACE=<dir>).

Installed by `bench.tasks` only when BENCH_TRACE names a directory: it wraps, in the worker's processes, the calls
a successor goes through (the report that creates it, the publisher's claim, outcome, publish and commit, the
worker's receipt of the message, the run guard) and appends `key<TAB>event<TAB>time.time()` lines to a file per
process, one `os.write` each (no flush, no network on the path). The library itself carries no timer.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from typing import Any

_fd: int | None = None
_pid: int | None = None
_local = threading.local()


def note(key: str, event: str, t: float | None = None) -> None:
    global _fd, _pid
    if _fd is None or _pid != os.getpid():
        _pid = os.getpid()
        _fd = os.open(os.path.join(os.environ["BENCH_TRACE"], f"{_pid}.tsv"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.write(_fd, f"{key}\t{event}\t{t if t is not None else time.time():.6f}\n".encode())


def _around(module: Any, name: str, key_of: Any, start: str | None, end: str) -> None:
    original = getattr(module, name)

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        key = key_of(args, kwargs)
        if key is None:
            return original(*args, **kwargs)
        if start:
            note(key, start)
        try:
            return original(*args, **kwargs)
        finally:
            note(key, end)

    setattr(module, name, wrapper)


def install() -> None:
    from celery import signals

    from celery_fanin.broker import publish
    from celery_fanin.dispatch import successors as successor_dispatch
    from celery_fanin.store import outbox, reports, successors
    from celery_fanin.worker import successor_runs

    # The publishing pool process: the batch it publishes is the key from publish_outbox on.
    def current(_args: Any, _kwargs: Any) -> str | None:
        return getattr(_local, "batch", None)

    original_publish = successor_dispatch.publish_outbox

    @functools.wraps(original_publish)
    def publish_outbox(fanin: Any, *args: Any, batch_id: Any = None, **kwargs: Any) -> Any:
        if batch_id is None or getattr(_local, "batch", None) is not None:  # the relay's, or inside the worker's
            return original_publish(fanin, *args, batch_id=batch_id, **kwargs)
        key = str(batch_id)
        _local.batch = key
        note(key, "pub.enter")
        try:
            return original_publish(fanin, *args, batch_id=batch_id, **kwargs)
        finally:
            note(key, "pub.committed")
            _local.batch = None

    successor_dispatch.publish_outbox = publish_outbox
    # The worker's publish of the successor its report created (from issue 23's third round on: a completed
    # batch's is handed to it and read without a claim, then marked sent on its report connection).
    from celery_fanin.worker import runtime as worker_runtime

    original_created = worker_runtime.current.reporter.publish_successor
    if original_created is not None:

        def publish_created(fanin: Any, batch_id: Any, handed_off: Any) -> Any:
            key = str(batch_id)
            _local.batch = key
            note(key, "pub.enter")
            if handed_off:  # the report returned the row (migration 0025): nothing is read or claimed here
                note(key, "pub.claimed")
            try:
                return original_created(fanin, batch_id, handed_off)
            finally:
                note(key, "pub.committed")
                _local.batch = None

        worker_runtime.current.reporter.publish_successor = publish_created
        _around(reports, "mark_sent", current, "pub.flushed", "pub.marked")
    _around(outbox, "claim", current, None, "pub.claimed")
    _around(successor_dispatch, "build_outcome", current, None, "pub.outcome")
    _around(publish, "publish_successor", current, "pub.send", "pub.sent")
    _around(outbox, "mark_sent", current, "pub.flushed", "pub.marked")

    # The report that created it (its key is only known after it returns: noted then, with the start time kept).
    original_send = reports.record_terminal

    def record_terminal(*args: Any, **kwargs: Any) -> Any:
        t0 = time.time()
        rec = original_send(*args, **kwargs)
        if rec.successor_created:
            claim = kwargs.get("claim")
            key = str(claim.batch_id) if claim is not None else "?"
            note(key, "report.sent", t0)
            note(key, "report.done")
        return rec

    reports.record_terminal = record_terminal

    # The successor's delivery: received by the main process, then its guard in a pool process.
    @signals.task_received.connect(weak=False)
    def received(request: Any = None, **_: Any) -> None:
        headers = getattr(request, "request_dict", None) or {}
        batch = headers.get("fanin_successor") if isinstance(headers, dict) else None
        if batch is None and getattr(request, "name", None) == "bench.mark":
            args = getattr(request, "args", None) or ()
            note(f"run:{args[-1]}" if args else "?", "recv")
        elif batch is not None:
            note(str(batch), "recv")

    @signals.task_prerun.connect(weak=False)
    def prerun(task: Any = None, args: Any = None, **_: Any) -> None:
        if getattr(task, "name", None) == "bench.mark" and args:
            note(f"run:{args[-1]}", "prerun")

    def admit_key(args: Any, kwargs: Any) -> str:
        return str(args[1])

    _around(successor_runs, "admit", admit_key, "guard.enter", "guard.done")
    # The guard's statement (on the report connection: `successors.claim_run(runner, batch_id, ...)`).
    _around(successors, "claim_run", lambda a, k: str(a[1]), "guard.stmt", "guard.stmt_done")

    # A chord's body is published from the last child's process, inside the result backend's chord hook.
    from bench.tasks import app

    backend = app.backend
    original_chord = backend.on_chord_part_return

    def on_chord_part_return(request: Any, state: Any, result: Any, **kwargs: Any) -> Any:
        t0 = time.time()
        out = original_chord(request, state, result, **kwargs)
        note(f"chordpart:{request.id}", "chord.part", t0)
        note(f"chordpart:{request.id}", "chord.part_done")
        return out

    backend.on_chord_part_return = on_chord_part_return
