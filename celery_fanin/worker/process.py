"""What one worker process keeps for itself: the objects that own a thread and a queue (the reports sent in the
background, the start writers, the successors' lease heartbeat).

Each is made on first use in a process and made again in a forked one: a prefork pool process inherits its parent's
objects, but not their threads, and whatever they had queued is the parent's to send. This is the one place in the
worker that knows about fork (`os.register_at_fork`); the objects themselves only start their thread when they
first need it. (Below the worker, the app's engine and report connection each forget inherited connections.)
What the whole worker shares, inherited by its pool processes on purpose (the signal adapter's wiring, the worker's
key), is elsewhere: `worker.runtime` and `successor_runs.worker_key`.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar

_T = TypeVar("_T")

# Reentrant: a maker may itself ask for another process object (a reporter that needs the start writers).
_lock = threading.RLock()
_held: dict[Callable[[], Any], Any] = {}


def held(make: Callable[[], _T]) -> _T:
    """This process's one object made by `make`: made on first use here. `make` is the key, so it must be the same
    object on every call: a class or a module-level function, not a lambda or a `functools.partial` made at the call
    (each would be a new key, and a new object every time)."""
    found = _held.get(make)  # a dict read needs no lock: only a miss does
    if found is None:
        if getattr(make, "__name__", "<lambda>") == "<lambda>":  # a partial has no __name__
            raise TypeError(f"process.held needs a class or a module-level function as its key, not {make!r}")
        with _lock:
            found = _held.get(make)
            if found is None:
                found = _held[make] = make()
    return found  # type: ignore[no-any-return]


def _forked() -> None:
    """In a new child process: forget the parent's objects (their threads are not here) and its lock, which a
    parent thread may have held at the fork."""
    global _lock
    _lock = threading.RLock()
    _held.clear()


os.register_at_fork(after_in_child=_forked)
