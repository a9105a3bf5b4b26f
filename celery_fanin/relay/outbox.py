"""Moving committed rows onto the broker: the one claim-and-publish of successors (`publish_outbox`, called by
the producer, the relay and eager mode), and children whose producer died before publishing them.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from celery import Celery
from celery.canvas import Signature
from kombu import Producer
from kombu.exceptions import OperationalError as KombuOperationalError
from sqlalchemy import Connection

from ..broker import publish
from ..broker.confirms import BrokerRefused
from ..broker.control import revoke_children
from ..codec import decode_signature
from ..context import FanIn
from ..protocol import BatchState
from ..store import batches, outbox, recovery
from .payload import build_outcome

logger = logging.getLogger("celery_fanin.dispatch")

# Errors that mean "the broker cannot be reached" rather than "this message is bad".
BROKER_ERRORS = (KombuOperationalError, ConnectionError, OSError)


def _retry_delay(attempts: int) -> float:
    return float(min(60, 2 ** min(attempts, 6)))


@dataclass(frozen=True)
class Due:
    """A claimed outbox row's successor as it is sent: its task id, its signature and the outcome it receives."""

    row: outbox.OutboxRow
    batch_id: uuid.UUID
    step: str
    task_id: str
    signature: Signature
    outcome: dict[str, Any]


def publish_outbox(
    fanin: FanIn,
    ids: Sequence[int] | None = None,
    limit: int | None = None,
    *,
    deliver: Callable[[Due], None] | None = None,
    batch_id: uuid.UUID | None = None,
) -> int:
    """Claim due outbox rows, publish their successors and mark them sent, all in one transaction.

    The row locks taken by the claim are held until the commit that marks the rows sent, so no other relay (or
    producer) publishes them meanwhile. If publishing fails as a whole (the broker is down), the transaction rolls
    back and the rows stay pending; a row that fails on its own is kept pending with a backoff and its error.
    Returns the number of successors published.

    `deliver` stands in for the broker in eager mode: it is handed each successor inside the transaction and must
    not run it there (its run guard would wait for this claim's row locks); a row that fails then raises, since
    nothing would retry it. `batch_id` claims only that batch's rows (the worker whose report created its
    successor publishes it so, `publish_created_successor`).
    """
    app = fanin.app
    settings = fanin.settings
    limit = limit or settings.relay_batch_size
    with fanin.engine.begin() as conn:
        rows = outbox.claim(conn, limit, ids, batch_id)
        if not rows:
            return 0
        sent: list[outbox.OutboxRow] = []
        abandoned: list[tuple[uuid.UUID, list[str]]] = []
        isolate = deliver is None
        with contextlib.ExitStack() as stack:
            send = deliver or _to_broker(app, stack.enter_context(publish.producer(app)))
            for row in rows:
                try:
                    stopped = _send_successor(fanin, conn, send, row)
                    if stopped:
                        abandoned.append((row.batch_id, stopped))
                except BrokerRefused as exc:
                    # The broker took the others and refused this one (its queue is full, say): like any row that
                    # fails on its own, it waits out a backoff, and the rows beside it are not held back with it.
                    delay = _retry_delay(row.attempts)
                    logger.warning(
                        "the broker refused the successor of batch_id=%s step=%s (%s); retrying in %.0fs",
                        row.batch_id,
                        row.step,
                        exc,
                        delay,
                        extra={"batch_id": str(row.batch_id), "step": row.step},
                    )
                    outbox.mark_failed(conn, row, repr(exc), delay)
                except BROKER_ERRORS:
                    raise  # the broker is down: roll the claim back, every row stays pending as it was
                except Exception as exc:  # one bad row must not hold back the others
                    if not isolate:
                        raise
                    logger.exception(
                        "could not publish successor batch_id=%s step=%s",
                        row.batch_id,
                        row.step,
                        extra={"batch_id": str(row.batch_id), "step": row.step},
                    )
                    outbox.mark_failed(conn, row, repr(exc), _retry_delay(row.attempts))
                else:
                    sent.append(row)
        # Only after the producer's batch flushed: a failed flush raises and rolls the claim back.
        outbox.mark_sent(conn, sent)
    for row in sent:
        logger.info(
            "published successor batch_id=%s step=%s",
            row.batch_id,
            row.step,
            extra={"batch_id": str(row.batch_id), "step": row.step},
        )
    for batch_id, task_ids in abandoned:
        # The batch passed its failure threshold: the children still queued or running are no longer wanted (they
        # were marked abandoned with the claim's commit, so whatever they report now is recorded as late).
        try:
            revoke_children(fanin, task_ids, batch_id)
        except Exception:
            logger.warning("could not revoke the unfinished children of batch_id=%s", batch_id, exc_info=True)
    return len(sent)


def publish_created_successor(fanin: FanIn, batch_id: uuid.UUID) -> int:
    """Publish a successor from the worker whose report created it, right after that report committed, as the
    producer publishes its children: the relay's claim of the batch's outbox rows (so the worker and a relay never
    both publish it), the outcome built the same way, a confirmed publish on the app's producer pool, and the row
    marked sent. Never raises: a failure is logged and leaves the row to the relay's periodic scan."""
    try:
        return publish_outbox(fanin, batch_id=batch_id)
    except Exception:  # noqa: BLE001 - the child's report is done; the relay publishes what this could not
        logger.warning(
            "could not publish the successor of batch_id=%s after its last report; the relay will",
            batch_id,
            exc_info=True,
            extra={"batch_id": str(batch_id)},
        )
        return 0


def _to_broker(app: Celery, prod: Producer) -> Callable[[Due], None]:
    def send(due: Due) -> None:
        publish.publish_successor(app, prod, due.batch_id, due.step, due.task_id, due.signature, due.outcome)

    return send


def _send_successor(fanin: FanIn, conn: Connection, deliver: Callable[[Due], None], row: outbox.OutboxRow) -> list[str]:
    """Send one outbox row's successor. If its batch finished early on its failure threshold, abandon its
    unfinished children (every leaf's, for a tree), after the outcome was built from what had happened by then,
    and return their task ids to revoke."""
    batch, succ = row.batch, row.successor  # read by the claim
    if batch is None:  # cascade-deleted rows cannot be claimed; this guards a hand-edited database
        raise LookupError(f"batch {row.batch_id} of outbox row {row.id} is gone")
    task_id = succ.task_id if succ is not None else batch.successor_task_id
    kind = succ.kind if succ is not None else "then"
    sig = decode_signature(fanin.app, batch.message_for(kind))
    settings = fanin.settings
    outcome = build_outcome(conn, batch, settings.outcome_failures_limit, max_bytes=settings.outcome_max_bytes)
    deliver(Due(row, batch.id, row.step, task_id, sig, outcome))
    if batch.state != BatchState.FAILED_THRESHOLD:
        return []
    return recovery.abandon_after_threshold(conn, batch.id)


def publish_remaining_children(fanin: FanIn, conn: Connection, batch_id: uuid.UUID) -> int:
    """Publish a batch's children from its `published_upto` mark onwards, a chunk at a time.

    The caller holds the batch's publish lock on `conn`. Each chunk's mark is committed after the chunk reached
    the broker, so a crash republishes at most one chunk (duplicates are counted once by the terminal guard).
    Children no longer pending (started, counted, abandoned) are skipped, and the mark moves past them too.
    """
    app = fanin.app
    chunk = fanin.settings.chunk_size
    total = 0
    while True:
        rows = batches.unpublished_children(conn, batch_id, chunk)
        conn.commit()
        if rows:
            with publish.producer(app) as prod:
                publish.publish_children(
                    app,
                    prod,
                    batch_id,
                    ((idx, task_id, decode_signature(app, enc)) for idx, task_id, enc in rows),
                )
        # A short chunk was the last: nothing past it is pending, so the mark reaches the end of the batch.
        batches.mark_published(conn, batch_id, rows[-1][0] + 1 if len(rows) == chunk else None)
        conn.commit()
        total += len(rows)
        if len(rows) < chunk:
            return total


def publish_orphaned_children(fanin: FanIn, limit: int = 100) -> int:
    """Finish publishing every batch whose producer is gone; skips batches a live producer is still publishing."""
    total = 0
    refused: BrokerRefused | None = None
    with fanin.engine.connect() as conn:
        pending = batches.unpublished_batches(conn, limit)
        conn.commit()
        for batch_id in pending:
            if not batches.try_publish_lock(conn, batch_id):
                conn.commit()
                continue
            try:
                count = publish_remaining_children(fanin, conn, batch_id)
            except BrokerRefused as exc:
                # This batch's children were refused (their queue is full, say): the batches after it go on. It
                # is raised once they are done, so that the relay retries it after its backoff, not at once.
                logger.warning(
                    "the broker refused children of batch_id=%s (%s)", batch_id, exc, extra={"batch_id": str(batch_id)}
                )
                refused = refused or exc
                continue
            finally:
                conn.rollback()
                batches.release_publish_lock(conn, batch_id)
                conn.commit()
            if count:
                logger.warning(
                    "published %d children of batch_id=%s that its producer did not",
                    count,
                    batch_id,
                    extra={"batch_id": str(batch_id)},
                )
            total += count
    if refused is not None:
        raise refused
    return total
