"""What a handle, an operator's command or the dashboard does to a batch in flight: seal it, cancel it."""

from __future__ import annotations

import logging
import uuid

from ..broker.control import revoke_children
from ..context import FanIn
from ..exceptions import BatchNotFound, BatchNotOpen
from ..store import recovery

logger = logging.getLogger("celery_fanin.maintenance")


def _not_open(fanin: FanIn, batch_id: uuid.UUID, doing: str, why: str = "") -> Exception:
    """Why `doing` found nothing to do: no such batch, a leaf, or a batch already past it."""
    with fanin.engine.connect() as conn:
        found = recovery.batch_state(conn, batch_id)
    if found is None:
        return BatchNotFound(f"no fan-in batch with id {batch_id}")
    state, root = found
    if root is not None:
        return BatchNotOpen(f"batch {batch_id} is a leaf counter of batch {root}: {doing} {root} instead")
    return BatchNotOpen(f"batch {batch_id} is {state}: nothing to {doing}{why}")


def seal_batch(fanin: FanIn, batch_id: uuid.UUID) -> recovery.Sealed:
    """An operator's seal: the open batch takes no more children and finishes when the ones it has do.

    A producer still writing it fails on its next chunk with `BatchClosed` (that chunk is not written).
    """
    with fanin.engine.begin() as conn:
        sealed = recovery.seal_open_batch(conn, batch_id)
    if sealed is None:
        raise _not_open(fanin, batch_id, "seal", " (only an open batch can be sealed)")
    logger.warning(
        "batch_id=%s sealed by an operator with %d children",
        batch_id,
        sealed.planned,
        extra={"batch_id": str(batch_id)},
    )
    return sealed


def cancel_batch(fanin: FanIn, batch_id: uuid.UUID, *, proceed: bool = False) -> recovery.Expiry:
    """End an open or running batch now: the deadline path (`expire_batch`) with reason "cancel".

    Every unfinished child is marked `abandoned` (exc_type `Cancelled`) and revoked. By default the batch ends
    `cancelled` and only its `on_expire` runs, if it has one (as `on_deadline="abandon"`); `proceed=True` ends it
    `partial` and runs its successor with what arrived (as `on_deadline="proceed"`).
    """
    with fanin.engine.begin() as conn:
        expiry = recovery.expire_batch(conn, batch_id, reason="cancel", proceed=proceed)
    if expiry is None:
        raise _not_open(fanin, batch_id, "cancel")
    logger.warning(
        "batch_id=%s cancelled (%s): %d unfinished children abandoned",
        batch_id,
        expiry.state,
        len(expiry.abandoned),
        extra={"batch_id": str(batch_id)},
    )
    try:
        revoke_children(fanin, expiry.abandoned, batch_id)
    except Exception:
        logger.warning("could not revoke the abandoned children of batch_id=%s", batch_id, exc_info=True)
    return expiry
