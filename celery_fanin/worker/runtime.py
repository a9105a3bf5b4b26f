"""What celery-fanin holds in a worker process: its reporter and the markers of the messages its main process holds.

One `WorkerRuntime` per process (`current`). The signal adapter (`hooks`), the task guards (`guards`) and eager mode
reach the reporter through it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .received import ReceivedMarkers
from .reporter import Reporter


@dataclass
class WorkerRuntime:
    reporter: Reporter = field(default_factory=Reporter)
    received: ReceivedMarkers = field(default_factory=ReceivedMarkers)


current = WorkerRuntime()
