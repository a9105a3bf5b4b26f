"""Children held back on queues no worker consumes until the test says so, instead of racing them against time.

A test routes the children that must wait to queues of its own (`.set(queue=...)`) and, when the moment comes,
tells one running worker to start consuming such a queue (a remote-control `add_consumer` sent to that worker
alone: on RabbitMQ the vhost is shared with other sessions' workers). Nothing depends on how fast anything runs.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from tests.workers import CeleryProcess, wait_for


def consume(app: Any, worker: CeleryProcess, queue: str) -> None:
    """Make `worker` consume `queue` from now on (returns once the worker said it does)."""
    replies = app.control.add_consumer(queue, destination=[worker.name], reply=True, timeout=10)
    answers = [reply[worker.name] for reply in replies or [] if worker.name in reply]
    assert answers and "ok" in answers[0], f"add_consumer {queue} to {worker.name}: {replies!r}"


def wait_revoked(app: Any, worker: CeleryProcess, task_ids: Iterable[str], timeout: float = 30) -> None:
    """Wait until `worker` has received the revokes of `task_ids` (a revoke is a broadcast: it may lag the commit
    that abandoned the children), so that a held copy it takes later is discarded as revoked."""
    wanted = set(task_ids)

    def received() -> bool:
        replies = app.control.inspect(timeout=5, destination=[worker.name]).revoked() or {}
        return wanted <= set(replies.get(worker.name, []))

    wait_for(received, timeout, interval=0.2, message=f"{worker.name} to receive {len(wanted)} revokes")
