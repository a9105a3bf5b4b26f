"""Retention: delete finished batches older than an age, in short transactions, from the CLI or a periodic task.

A batch is deleted once it is finished (any state but open or running), its successor has
finished too (expired or cancelled: maybe none), it finished before the cut-off, and no retry round of it is still
running. Its leaves, children, successor and outbox rows go with it (ON DELETE CASCADE). Once no batch is left to
delete, sagas that finished for good (succeeded, or compensated) before the cut-off are deleted too, with their
steps and compensations; a saga waiting for an operator is kept, whatever its age. A deleted saga's or batch's
idempotency key can be used again.

Each transaction locks at most `chunk` root batches (`FOR UPDATE SKIP LOCKED`: rows another session holds are left
for the next run) and deletes batches holding at most about `max_children` children: a tree's leaves are deleted
a few at a time before its root, so a batch of a million children is never one transaction. Nothing else is
locked: live batches are never touched, and every transaction is short.

As a periodic task (``celery_fanin.prune``, defined on every app wired with `FanIn(app)`)::

    app.conf.beat_schedule = {
        "fanin-prune": {"task": "celery_fanin.prune", "schedule": crontab(hour=3, minute=17),
                        "kwargs": {"older_than": "30d"}},
    }
"""

from __future__ import annotations

import functools
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from sqlalchemy.exc import SQLAlchemyError

from .. import retry
from ..context import FanIn
from ..exceptions import FanInDatabaseError, summarise
from ..store import admin
from .inspection import parse_duration

logger = logging.getLogger("celery_fanin.retention")


@dataclass
class PruneReport:
    older_than_seconds: float
    batches: int = 0  # root batches deleted (or, with dry_run, that would be)
    leaves: int = 0  # leaf counters of trees deleted before their roots
    children: int = 0  # child rows deleted with them
    sagas: int = 0  # finished sagas deleted (their steps and compensations with them)
    transactions: int = 0
    dry_run: bool = False
    complete: bool = True  # False if `limit` or `max_seconds` stopped it with more left to delete

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def prune(
    fanin: FanIn,
    older_than: float | str,
    *,
    chunk: int = 500,
    max_children: int = 20_000,
    dry_run: bool = False,
    limit: int | None = None,
    max_seconds: float | None = None,
) -> PruneReport:
    """Delete finished batches that finished more than `older_than` ago (seconds, or `30d`, `12h`, ...).

    `chunk`: root batches locked (or sagas deleted) per transaction; `max_children`: children deleted per
    transaction (a batch larger than that is deleted alone, a tree leaf by leaf); `limit`: root batches deleted by
    this call at most; `max_seconds`: stop starting transactions after this long (a periodic task that must not
    overrun). Sagas are deleted only by a call that left no prunable batch behind (`report.complete`).
    """
    age = parse_duration(older_than)
    if chunk < 1 or max_children < 1:
        raise ValueError("chunk and max_children must be at least 1")
    report = PruneReport(older_than_seconds=age, dry_run=dry_run)
    try:
        if dry_run:
            with fanin.engine.connect() as conn:
                report.batches, report.children = admin.prunable_totals(conn, age)
                report.sagas = admin.prunable_sagas(conn, age)
            return report
        started = time.monotonic()
        while True:
            if limit is not None and report.batches >= limit:
                report.complete = False
                break
            if max_seconds is not None and time.monotonic() - started >= max_seconds:
                report.complete = False
                break
            room = chunk if limit is None else min(chunk, limit - report.batches)
            deleted = _with_retries(functools.partial(_one_transaction, fanin, age, room, max_children))
            if deleted is None:
                break
            report.batches += deleted.batches
            report.leaves += deleted.leaves
            report.children += deleted.children
            report.transactions += 1
        while report.complete:  # the sagas, once every batch that could go has gone
            if max_seconds is not None and time.monotonic() - started >= max_seconds:
                report.complete = False
                break
            sagas = _with_retries(functools.partial(_delete_sagas, fanin, age, chunk))
            if not sagas:
                break
            report.sagas += sagas.sagas
            report.transactions += 1
    except SQLAlchemyError as exc:
        raise FanInDatabaseError(f"could not prune: {summarise(exc)}") from exc
    if report.batches or report.leaves or report.sagas:
        logger.info("pruned %d batches (%d leaf counters, %d children) and %d sagas finished over %ss ago in %d "
                    "transactions", report.batches, report.leaves, report.children, report.sagas, age,
                    report.transactions)  # fmt: skip
    return report


@dataclass(frozen=True)
class _Deleted:
    batches: int = 0
    leaves: int = 0
    children: int = 0
    sagas: int = 0


# A late report of a child (a failed_threshold batch's straggler) locks the child row, then its batch row; a delete
# holds the batch row, then deletes the child row: PostgreSQL breaks that rare deadlock, and the transaction is
# simply run again (the report, if it was the one aborted, is retried by its worker and finds no row).
_ATTEMPTS = 5
_BACKOFF = retry.Backoff(first=0.05, maximum=1.0)


def _with_retries(run: Callable[[], _Deleted | None]) -> _Deleted | None:
    try:
        return retry.call(run, what="prune transaction", attempts=_ATTEMPTS, backoff=_BACKOFF)
    except retry.GaveUp as exc:  # the last error as it was: `prune` reports it as a FanInDatabaseError
        cause = exc.__cause__
        assert cause is not None
        raise cause from None


def _one_transaction(fanin: FanIn, age: float, room: int, max_children: int) -> _Deleted | None:
    """Delete one bounded set of rows in one transaction; None when there was nothing (left) to delete."""
    with fanin.engine.begin() as conn:
        roots = admin.lock_prunable(conn, age, room)
        chosen: list[uuid.UUID] = []
        used = 0
        for root in roots:
            if root.leaves:
                if chosen:
                    break  # a tree goes leaf by leaf, in transactions of its own
                picked: list[uuid.UUID] = []
                for leaf_id, planned in admin.lock_leaves(conn, root.id, room):
                    if picked and used + planned > max_children:
                        break
                    picked.append(leaf_id)
                    used += planned
                if not picked:
                    continue  # its leaves are locked by another session: leave it for the next run
                children = admin.child_rows(conn, picked)
                return _Deleted(leaves=admin.delete_batches(conn, picked), children=children)
            if chosen and used + root.planned > max_children:
                break
            chosen.append(root.id)
            used += root.planned
        if not chosen:
            return None
        children = admin.child_rows(conn, chosen)
        return _Deleted(batches=admin.delete_batches(conn, chosen), children=children)


def _delete_sagas(fanin: FanIn, age: float, room: int) -> _Deleted | None:
    """Delete up to `room` finished sagas in one transaction; None when there was none (left)."""
    with fanin.engine.begin() as conn:
        deleted = admin.delete_sagas(conn, age, room)
    return _Deleted(sagas=deleted) if deleted else None
