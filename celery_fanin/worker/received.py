"""The fan-in messages a worker's main process holds a request for: what its own signals (a hard time limit, a
lost pool process, a revoke) need to know of a message whose pool process never reported."""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from typing import Any

from ..protocol import Marker


class ReceivedMarkers:
    """task id -> marker for the fan-in messages the main process holds a request for.

    An entry lives as long as Celery's `Request` for the message: the main process needs the marker only while
    that request can still end in a main-process failure (hard time limit, lost pool process), and no signal
    fires in the main process when a child succeeds. A weak reference's callback drops the entry when Celery
    lets the request go, so the map holds the worker's reserved and running fan-in requests, not its history.
    The bound is a safety net for requests kept alive elsewhere; the oldest entry goes first.
    """

    def __init__(self, limit: int = 100_000) -> None:
        self._data: OrderedDict[str, tuple[Marker, weakref.ref[Any]]] = OrderedDict()
        self._limit = limit
        # Reentrant: a garbage collection can start at any allocation inside `add` and release a request whose
        # callback then runs on this thread, with the lock held.
        self._lock = threading.RLock()

    def add(self, task_id: str, marker: Marker, request: Any) -> None:
        def release(ref: weakref.ref[Any]) -> None:
            with self._lock:
                entry = self._data.get(task_id)
                if entry is not None and entry[1] is ref:  # a redelivery under the same id keeps its own entry
                    del self._data[task_id]

        with self._lock:
            self._data[task_id] = (marker, weakref.ref(request, release))
            if len(self._data) > self._limit:
                self._data.popitem(last=False)

    def get(self, task_id: str) -> Marker | None:
        with self._lock:
            entry = self._data.get(task_id)
        return entry[0] if entry is not None else None

    def pop(self, task_id: str) -> Marker | None:
        with self._lock:
            entry = self._data.pop(task_id, None)
        return entry[0] if entry is not None else None

    def request(self, task_id: str) -> Any:
        """The main process's request for this task id's message, while Celery holds it (else None)."""
        with self._lock:
            entry = self._data.get(task_id)
        return entry[1]() if entry is not None else None

    def __len__(self) -> int:
        return len(self._data)
