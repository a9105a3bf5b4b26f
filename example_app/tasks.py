"""The fan-out: `partner_sync` (the scheduler), `sync_user` (one per user) and `write_report` (the fan-in successor).

The scheduler only reads, filters and enqueues; each user is its own task that retries and fails on its own; the
report runs once, after every `sync_user` has ended, whatever each ended in. That last part is what celery-fanin
adds over a plain `group`: a chord body never runs if one child fails.
"""

from __future__ import annotations

import itertools
import logging
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, TypeVar

import psycopg
from celery import Task
from celery.canvas import Signature
from celery.utils.log import get_task_logger

from celery_fanin import BatchOutcome, FanIn, FanInResult, fan_in_group

from . import db, partner_api
from .celeryapp import NIGHTLY_RECORDS, app
from .partner_api import PermanentError, RateLimitExceeded, RetryableError
from .warehouse import DEFAULT_SEED, DataWarehouseClient, WarehouseRow

logger: logging.Logger = get_task_logger(__name__)

# Rows per slice: bounds the `= ANY(%s)` array of the filtering query and the memory one slice holds.
BATCH_SIZE = 1_000
PARTNER_ID = "acme"
# Calls after the first one; the backoff is 1 s, then 2 s (retry_backoff_max): Celery's backoff is whole seconds.
MAX_RETRIES = 3

T = TypeVar("T")


def database_url() -> str:
    """The app's tables sit in the fan-in database (any other database would do as well)."""
    return FanIn.of(app).database_url


def child_task_id(run_label: str, external_id: str) -> str:
    """A child's task id names its user, so that logs and `fanin failures` show whom a failed task was for."""
    return f"partner-sync:{run_label}:{external_id}"


def chunked(items: Iterable[T], size: int) -> Iterator[list[T]]:
    """Ruby's `each_slice` (`itertools.batched` needs Python 3.12)."""
    it = iter(items)
    while chunk := list(itertools.islice(it, size)):
        yield chunk


@dataclass
class ScheduledRun:
    """What the scheduler did: rows read, tasks fanned out, and the handle of the batch (None if skipped)."""

    run_label: str
    scanned: int = 0
    planned: int = 0
    handle: FanInResult | None = None

    @property
    def skipped(self) -> bool:
        """True when a run with this label had been scheduled already (an overlapping cron run)."""
        return self.handle is None

    def as_dict(self) -> dict[str, Any]:
        return {
            "run_label": self.run_label,
            "batch_id": self.handle.batch_id if self.handle else None,
            "scanned": self.scanned,
            "planned": self.planned,
            "skipped": self.skipped,
        }


def _children(
    conn: psycopg.Connection[Any], rows: Iterable[WarehouseRow], run: ScheduledRun, partner_id: str
) -> Iterator[Signature]:
    """One `sync_user` signature per row whose user exists locally, filtered with one query per slice."""
    seen: set[str] = set()  # a warehouse export can repeat a row; two children with one task id are refused
    for rows_slice in chunked(rows, BATCH_SIZE):
        run.scanned += len(rows_slice)
        candidate_ids = [r["external_id"] for r in rows_slice if r["external_id"]]
        if not candidate_ids:
            continue
        existing = db.existing_ids(conn, candidate_ids)
        for external_id in candidate_ids:
            if external_id in existing and external_id not in seen:
                seen.add(external_id)
                run.planned += 1
                yield sync_user.s(external_id, partner_id).set(task_id=child_task_id(run.run_label, external_id))


def schedule_partner_sync(
    run_label: str, total: int, *, seed: int = DEFAULT_SEED, partner_id: str = PARTNER_ID
) -> ScheduledRun:
    """The scheduler's body, callable in-process (the demo does) to get the batch handle back.

    The label is claimed first so that a second run with the same label does nothing. The batch and all its
    children are recorded in one transaction, so the claim is released only when the fan-out recorded nothing.
    """
    run = ScheduledRun(run_label)
    with db.connect(database_url()) as conn:
        db.setup(conn)  # idempotent: a fresh deployment's first nightly run needs no manual step
        if not db.claim_run(conn, run_label):
            logger.warning("partner sync %s was scheduled before; skipping this run", run_label)
            return run
        rows = DataWarehouseClient(seed).execute(total)
        try:
            run.handle = fan_in_group(
                _children(conn, rows, run, partner_id), then=write_report.s(run_label), step="report"
            ).apply_async()
        except Exception:
            db.release_claim(conn, run_label)
            raise
        db.mark_scheduled(conn, run_label, run.handle.batch_id, run.scanned, run.planned)
    logger.info(
        "partner sync %s: %d of %d rows fanned out as batch %s",
        run_label,
        run.planned,
        run.scanned,
        run.handle.batch_id,
    )
    return run


@app.task
def partner_sync(run_label: str | None = None, total: int = NIGHTLY_RECORDS) -> dict[str, Any]:
    """The nightly entry point (beat). Without a label the run is named after the UTC date."""
    label = run_label or f"daily-{datetime.now(timezone.utc).date().isoformat()}"
    return schedule_partner_sync(label, total).as_dict()


@app.task(
    bind=True,
    autoretry_for=(RateLimitExceeded, RetryableError),
    retry_backoff=True,
    retry_backoff_max=2,
    retry_jitter=False,
    max_retries=MAX_RETRIES,
    throws=(PermanentError,),  # expected: logged without a traceback, and the child fails at once
)
def sync_user(self: Task, external_id: str, partner_id: str) -> partner_api.SyncResult:
    """Push one user to the partner. Transient errors are retried; a permanent one fails this child only."""
    result = partner_api.sync_user(external_id, partner_id, attempt=self.request.retries)
    if result["status"] == "user_not_found":
        # Expected (the partner deleted the user since the export): a success with a note, never retried.
        logger.info("partner %s does not know %s; discarded", partner_id, external_id)
    return result


@app.task
def write_report(outcome: Mapping[str, Any], run_label: str) -> dict[str, Any]:
    """The fan-in successor: runs once, after every `sync_user` of the run succeeded or failed for good."""
    batch = BatchOutcome.from_message(outcome, app=app)
    # The message lists at most `fanin_outcome_failures_limit` failures; Postgres has all of them.
    failures = batch.all_failures()
    discarded = sum(1 for value in batch.values() if value and value.get("status") == "user_not_found")
    report = db.SyncReport(
        run_label=run_label,
        batch_id=batch.batch_id,
        planned=batch.planned,
        succeeded=batch.succeeded,
        synced=batch.succeeded - discarded,
        discarded=discarded,
        failed=batch.failed,
        # A failure carries its child's arguments (JSON children): sync_user(external_id, partner_id).
        failed_external_ids=sorted(f["args"][0] for f in failures),
        failure_types=dict(sorted(Counter(f["exc_type"] or f["state"] for f in failures).items())),
    )
    with db.connect(database_url()) as conn:
        db.save_report(conn, report)
    logger.info(
        "partner sync %s: %d planned, %d synced, %d discarded, %d failed",
        run_label,
        report.planned,
        report.synced,
        report.discarded,
        report.failed,
    )
    return report.as_dict()
