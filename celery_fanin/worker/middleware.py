"""The worker's signal adapter, in dramatiq's middleware style: one no-op method per Celery signal celery-fanin
listens to, overridden by `hooks.WorkerHooks`, and `connect` to attach a middleware's methods once per process."""

from __future__ import annotations

import threading
from typing import Any

from celery import signals

# The signals `connect` attaches, with the dispatch uid each had (`celery_fanin.<uid>`).
SIGNALS = (
    ("task_prerun", "prerun"),
    ("task_postrun", "postrun"),
    ("task_received", "received"),
    ("before_task_publish", "claim"),  # protocol.CLAIM_RECEIVER: the fast path tells it from other receivers
    ("task_failure", "failure"),
    ("task_revoked", "revoked"),
    ("task_unknown", "unknown"),
    ("task_rejected", "rejected"),
    ("worker_init", "worker_init"),
    ("worker_shutdown", "worker_shutdown"),
    ("worker_process_shutdown", "worker_process_shutdown"),
    ("worker_process_init", "worker_process_init"),
)


class Middleware:
    """One method per signal in `SIGNALS`, each a no-op here, called with the signal's keyword arguments."""

    def before_task_publish(self, sender: Any = None, body: Any = None, headers: Any = None, **_: Any) -> None:
        """A message is about to be published (in the publishing process)."""

    def task_received(self, sender: Any = None, request: Any = None, **_: Any) -> None:
        """The main process took a message and built its request."""

    def task_prerun(self, sender: Any = None, task_id: str | None = None, task: Any = None, **_: Any) -> None:
        """A pool process is about to run a task."""

    def task_postrun(
        self,
        sender: Any = None,
        task_id: str | None = None,
        task: Any = None,
        retval: Any = None,
        state: str | None = None,
        **_: Any,
    ) -> None:
        """A pool process ran a task, whatever its state."""

    def task_failure(
        self, sender: Any = None, task_id: str | None = None, exception: BaseException | None = None, **_: Any
    ) -> None:
        """A task failed (in the pool process, or in the main process for a hard time limit or a lost process)."""

    def task_revoked(
        self, sender: Any = None, request: Any = None, terminated: bool = False, expired: bool = False, **_: Any
    ) -> None:
        """The main process revoked, terminated or expired a request."""

    def task_unknown(
        self,
        sender: Any = None,
        message: Any = None,
        exc: BaseException | None = None,
        name: str | None = None,
        id: str | None = None,
        **_: Any,
    ) -> None:
        """The main process got a message for a task it does not know."""

    def task_rejected(
        self, sender: Any = None, message: Any = None, exc: BaseException | None = None, **_: Any
    ) -> None:
        """The main process refused a message (a content type it does not accept)."""

    def worker_init(self, sender: Any = None, **_: Any) -> None:
        """The worker's main process starts, before its pool."""

    def worker_process_init(self, **_: Any) -> None:
        """A pool process starts."""

    def worker_shutdown(self, **_: Any) -> None:
        """The worker's main process stops."""

    def worker_process_shutdown(self, **_: Any) -> None:
        """A pool process stops."""


_connected: set[type[Middleware]] = set()
_lock = threading.Lock()


def connect(middleware: Middleware) -> None:
    """Connect each of `middleware`'s signal methods once per process (again for the same class: nothing more)."""
    with _lock:
        if type(middleware) in _connected:
            return
        for signal, uid in SIGNALS:
            getattr(signals, signal).connect(
                getattr(middleware, signal), weak=False, dispatch_uid=f"celery_fanin.{uid}"
            )
        _connected.add(type(middleware))
