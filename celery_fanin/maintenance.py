"""The relay's periodic duties: children that never report, passed deadlines, and reconciliation.

Each duty runs one short transaction per batch or child (see `store/recovery.py`), so it can run beside live
traffic and beside other relays doing the same: every change is conditional on the state it found.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from . import publish
from .dispatch import revoke_children
from .extension import FanIn
from .store import recovery, successors

logger = logging.getLogger("celery_fanin.maintenance")


@dataclass
class LostReport:
    redriven: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)


def handle_lost_children(fanin: FanIn, limit: int = 500) -> LostReport:
    """Redrive (same task id) or fail as `lost` every child past its batch's child_timeout."""
    report = LostReport()
    app = fanin.app
    with fanin.engine.connect() as conn:
        overdue = recovery.overdue_children(conn, limit)
        conn.commit()
    for child in overdue:
        extra = {"batch_id": str(child.batch_id), "child_index": child.idx, "task_id": child.task_id}
        if child.on_lost == "redrive" and child.redrives < child.max_redrives:
            with fanin.engine.begin() as conn:
                claimed = recovery.claim_redrive(conn, child)
            if claimed:
                sig = publish.decode_signature(app, child.message)
                with publish.producer(app) as prod:
                    publish.publish_children(app, prod, child.batch_id, [(child.idx, child.task_id, sig)])
                report.redriven.append(child.task_id)
                logger.warning("redrove lost child batch_id=%s index=%d task_id=%s (redrive %d of %d)",
                               child.batch_id, child.idx, child.task_id, child.redrives + 1, child.max_redrives,
                               extra=extra)  # fmt: skip
            continue
        with fanin.engine.begin() as conn:
            counted = recovery.fail_lost(conn, child)
        if counted:
            report.failed.append(child.task_id)
            logger.warning("child lost batch_id=%s index=%d task_id=%s: counted as failed (state lost)",
                           child.batch_id, child.idx, child.task_id, extra=extra)  # fmt: skip
    if report.failed:
        # A lost child may still sit in a queue somewhere; if it ever runs, its report is recorded as late.
        revoke_children(fanin, report.failed)
    return report


def revoke_expired_children(fanin: FanIn, limit: int = 500) -> list[str]:
    """Count as `revoked` (expired) every pending child whose `expires` passed over `fanin_expires_grace` ago.

    A broker may drop an expired message unconsumed (RabbitMQ: Celery gives it a TTL), and then no worker ever
    reports it; where a worker does see it (Redis), its report and this one race and the child counts once."""
    grace = float(fanin.settings.expires_grace)
    with fanin.engine.connect() as conn:
        due = recovery.expired_children(conn, grace, limit)
        conn.commit()
    done = []
    for task_id, batch_id, idx in due:
        with fanin.engine.begin() as conn:
            counted = recovery.revoke_expired(conn, task_id, grace)
        if counted:
            done.append(task_id)
            logger.warning("child expired unconsumed batch_id=%s index=%d task_id=%s: counted as revoked",
                           batch_id, idx, task_id,
                           extra={"batch_id": str(batch_id), "child_index": idx, "task_id": task_id})  # fmt: skip
    return done


def restart_stalled_successors(fanin: FanIn, limit: int = 100) -> list[tuple[str, str]]:
    """Publish again every successor whose message was lost or whose run died (see `store.successors.stalled`)."""
    settings = fanin.settings
    timeout, grace = settings.successor_timeout, settings.successor_lease_grace
    with fanin.engine.connect() as conn:
        stalled = successors.stalled(conn, timeout, grace, limit)
        conn.commit()
    done = []
    for batch_id, step in stalled:
        with fanin.engine.begin() as conn:
            if successors.republish(conn, batch_id, step, timeout, grace):
                done.append((str(batch_id), step))
                logger.warning(
                    "successor of batch_id=%s step=%s stalled (message lost or run dead): publishing it again",
                    batch_id,
                    step,
                    extra={"batch_id": str(batch_id), "step": step},
                )
    return done


def apply_deadlines(fanin: FanIn, limit: int = 100) -> list[recovery.Expiry]:
    """Finish every running batch whose deadline has passed, as its `on_deadline` says."""
    done = []
    with fanin.engine.connect() as conn:
        due = recovery.due_deadlines(conn, limit)
        conn.commit()
    for batch_id in due:
        with fanin.engine.begin() as conn:
            expiry = recovery.expire_batch(conn, batch_id)
        if expiry is None:
            continue
        done.append(expiry)
        logger.warning("deadline passed for batch_id=%s: %s, %d children abandoned", batch_id,
                       "successor runs with a partial outcome" if expiry.on_deadline == "proceed" else "expired",
                       len(expiry.abandoned), extra={"batch_id": str(batch_id)})  # fmt: skip
        try:
            revoke_children(fanin, expiry.abandoned, batch_id)
        except Exception:
            logger.warning("could not revoke abandoned children of batch_id=%s", batch_id, exc_info=True)
    return done


def reconcile(fanin: FanIn, limit: int = 1000) -> list[recovery.Repair]:
    """Recompute every open batch's counters from its children and repair what disagrees."""
    repairs = []
    with fanin.engine.connect() as conn:
        candidates = recovery.batches_to_reconcile(conn, limit)
        conn.commit()
    for batch_id in candidates:
        with fanin.engine.begin() as conn:
            repair = recovery.reconcile_batch(conn, batch_id)
        if repair is not None:
            repairs.append(repair)
            logger.warning("reconciled batch_id=%s: %s; %s", batch_id, "; ".join(repair.problems),
                           "; ".join(repair.actions) or "reported only", extra={"batch_id": str(batch_id)})  # fmt: skip
    return repairs
