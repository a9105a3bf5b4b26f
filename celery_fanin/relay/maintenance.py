"""The relay's periodic duties: children that never report, passed deadlines, and reconciliation.

Each duty runs one short transaction per batch or child (see `store/recovery.py`), so it can run beside live
traffic and beside other relays doing the same: every change is conditional on the state it found.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from ..broker import publish
from ..broker.control import revoke_children
from ..broker.publish import BROKER_ERRORS
from ..codec import decode_signature
from ..context import FanIn
from ..dispatch.children import rejection
from ..protocol import OnDeadline, OnLost
from ..store import batches, recovery, successors

logger = logging.getLogger("celery_fanin.maintenance")


@dataclass
class LostReport:
    redriven: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)


def handle_lost_children(fanin: FanIn, limit: int = 500) -> LostReport:
    """Redrive (same task id) or fail as `lost` every child past its batch's child_timeout."""
    report = LostReport()
    with fanin.engine.connect() as conn:
        overdue = recovery.overdue_children(conn, limit)
        conn.commit()
    for child in overdue:
        extra = {"batch_id": str(child.batch_id), "child_index": child.idx, "task_id": child.task_id}
        if child.on_lost == OnLost.REDRIVE and child.redrives < child.max_redrives:
            with fanin.engine.begin() as conn:
                claimed = recovery.claim_redrive(conn, child)
            if claimed:
                _redrive(fanin, child)
                report.redriven.append(child.task_id)
                logger.warning(
                    "redrove lost child batch_id=%s index=%d task_id=%s (redrive %d of %d)",
                    child.batch_id,
                    child.idx,
                    child.task_id,
                    child.redrives + 1,
                    child.max_redrives,
                    extra=extra,
                )
            continue
        with fanin.engine.begin() as conn:
            counted = recovery.fail_lost(conn, child)
        if counted:
            report.failed.append(child.task_id)
            logger.warning(
                "child lost batch_id=%s index=%d task_id=%s: counted as failed (state lost)",
                child.batch_id,
                child.idx,
                child.task_id,
                extra=extra,
            )
    if report.failed:
        # A lost child may still sit in a queue somewhere; if it ever runs, its report is recorded as late.
        revoke_children(fanin, report.failed)
    return report


def _redrive(fanin: FanIn, child: recovery.OverdueChild) -> None:
    """Publish a lost child again under its task id; one whose message cannot be built (it no longer decodes, a
    serializer is gone) goes out as a rejection in its place, as the relay's orphan publishing does, so that neither
    it nor the children after it in this round are held back."""
    app = fanin.app
    try:
        sig = decode_signature(app, child.message)
        with publish.producer(app) as prod:
            publish.publish_children(app, prod, child.batch_id, [(child.idx, child.task_id, sig)])
    except BROKER_ERRORS:
        raise  # the broker's fault, not the child's: the round stops and the relay retries it
    except Exception as exc:  # noqa: BLE001 - this child's stored message, alone, cannot be published
        stand_in = rejection(app, child.batch_id, child.idx, child.task_id, child.task_name, exc, None)
        with publish.producer(app) as prod:
            publish.publish_children(app, prod, child.batch_id, [(child.idx, child.task_id, stand_in)])


def expiry_grace(fanin: FanIn) -> float:
    """Seconds past a child's `expires` before the sweep may count it: `fanin_expires_grace` + `fanin_report_timeout`.

    "Still pending" means "no worker took it" only once any start could have landed. A worker that took the
    message before it expired queues the child's start when the body begins (a pool's own queue may hold it a
    while: `fanin_expires_grace`), then keeps retrying it through an outage for up to its `fanin_report_timeout`
    (`worker.starts`). Past both, a pending child was never taken (or its worker died before writing the start).
    """
    settings = fanin.settings
    return max(0.0, float(settings.expires_grace)) + max(0.0, float(settings.report_timeout))


def revoke_expired_children(fanin: FanIn, limit: int = 500) -> list[str]:
    """Count as `revoked` (expired) every pending child whose `expires` passed over `expiry_grace` ago.

    A broker may drop an expired message unconsumed (RabbitMQ: Celery gives it a TTL), and then no worker ever
    reports it; where a worker does see it (Redis), its report and this one race and the child counts once. A
    child a worker took is `started` by then (its start is written through an outage shorter than
    `fanin_report_timeout`), so the sweep leaves it to its own report."""
    grace = expiry_grace(fanin)
    with fanin.engine.connect() as conn:
        due = recovery.expired_children(conn, grace, limit)
        conn.commit()
    done = []
    for task_id, batch_id, idx in due:
        with fanin.engine.begin() as conn:
            counted = recovery.revoke_expired(conn, task_id, grace)
        if counted:
            done.append(task_id)
            logger.warning(
                "child expired unconsumed batch_id=%s index=%d task_id=%s: counted as revoked",
                batch_id,
                idx,
                task_id,
                extra={"batch_id": str(batch_id), "child_index": idx, "task_id": task_id},
            )
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


def fail_lost_replacements(fanin: FanIn, limit: int = 100) -> list[tuple[str, str]]:
    """Record failed (`ReplacementLost`) every replaced successor whose carrier did not come or whose carrier's run
    died `fanin_replaced_timeout` seconds ago (no bound, and nothing done, unless that is set)."""
    timeout = fanin.settings.replaced_timeout
    if timeout is None:
        return []
    with fanin.engine.connect() as conn:
        lost = successors.lost_replacements(conn, timeout, limit)
        conn.commit()
    done = []
    # The carrier's token stays out of the message: `status` and the dashboard show it to read-only viewers.
    message = (
        f"the replacement's carrier (the task that takes the successor's task id) did not come or its run died,"
        f" and fanin_replaced_timeout ({timeout:g} s) passed"
    )
    for batch_id, step in lost:
        with fanin.engine.begin() as conn:
            if successors.fail_lost_replacement(conn, batch_id, step, timeout, message):
                done.append((str(batch_id), step))
                logger.warning(
                    "replaced successor of batch_id=%s step=%s lost its replacement: recorded failed (ReplacementLost)",
                    batch_id,
                    step,
                    extra={"batch_id": str(batch_id), "step": step},
                )
    return done


def apply_deadlines(fanin: FanIn, limit: int = 100) -> list[recovery.Expiry]:
    """Finish every open or running batch whose deadline has passed, as its `on_deadline` says."""
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
        logger.warning(
            "deadline passed for batch_id=%s: %s, %d children abandoned",
            batch_id,
            "successor runs with a partial outcome" if expiry.on_deadline == OnDeadline.PROCEED else "expired",
            len(expiry.abandoned),
            extra={"batch_id": str(batch_id)},
        )
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
            logger.warning(
                "reconciled batch_id=%s: %s; %s%s",
                batch_id,
                "; ".join(repair.problems),
                "; ".join(repair.actions) or "reported only",
                "".join(f"; {note}" for note in repair.unchecked),
                extra={"batch_id": str(batch_id)},
            )
    return repairs


def seal_lapsed_open_batches(fanin: FanIn, limit: int = 100) -> list[recovery.Sealed]:
    """Seal every open batch whose producer has been gone for longer than `fanin_open_batch_grace`.

    Each is sealed under its publish lock, the lock a producer or a resumer holds while it writes: a producer
    that comes back (a rerun with the same key) either got the lock first, and is left alone, or waits for it and
    then finds the batch sealed. Its successor then runs once, with the children that were written.
    """
    grace = fanin.settings.open_batch_grace
    done = []
    with fanin.engine.connect() as conn:
        lapsed = recovery.lapsed_open_batches(conn, grace, limit)
        conn.commit()
        for batch_id in lapsed:
            locked = batches.try_publish_lock(conn, batch_id)
            conn.commit()  # the session lock outlives the transaction that took it
            if not locked:
                continue
            try:
                with conn.begin():
                    sealed = recovery.seal_open_batch(conn, batch_id, lapsed_grace=grace)
            finally:
                conn.rollback()
                batches.release_publish_lock(conn, batch_id)
                conn.commit()
            if sealed is not None:
                done.append(sealed)
                logger.warning(
                    "batch_id=%s was open with no producer for over %ss: sealed with %d children%s",
                    batch_id,
                    grace,
                    sealed.planned,
                    " (all finished: successor created)" if sealed.successor_created else "",
                    extra={"batch_id": str(batch_id)},
                )
    return done
