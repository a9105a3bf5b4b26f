"""Control broadcasts: revoking the children a finished batch no longer waits for."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence

from ..context import FanIn

logger = logging.getLogger("celery_fanin.dispatch")


def revoke_children(fanin: FanIn, task_ids: Sequence[str], batch_id: uuid.UUID | None = None) -> None:
    """Broadcast a revoke (no terminate) for children a finished batch no longer waits for.

    Queued copies are then discarded by the workers and reported as revoked; a running one finishes, and its
    report is recorded as late (if the batch had already stopped counting it) or counted.
    """
    for start in range(0, len(task_ids), 1000):
        fanin.app.control.revoke(list(task_ids[start : start + 1000]))
    if task_ids:
        logger.info("revoked %d unfinished children (batch_id=%s)", len(task_ids), batch_id or "several")
