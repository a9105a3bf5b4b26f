"""What celery-fanin holds in a worker process: its reporter and the markers of the messages its main process holds.

One `WorkerRuntime` per process (`current`). The signal adapter (`hooks`), the task guards (`guards`) and eager mode
reach the reporter through it; `use_publisher` replaces the publisher of the successors its reports create (the
tests' fault injection, the benchmark's tracing).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .received import ReceivedMarkers
from .reporter import PublishSuccessor, Reporter


@dataclass
class WorkerRuntime:
    reporter: Reporter = field(default_factory=Reporter)
    received: ReceivedMarkers = field(default_factory=ReceivedMarkers)

    def use_publisher(self, publish: PublishSuccessor | None) -> None:
        """Publish the successors this process's reports create with `publish` (None: leave them to the relay)."""
        self.reporter.publish_successor = publish


current = WorkerRuntime()
