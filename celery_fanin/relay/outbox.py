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
from kombu.exceptions import EncodeError
from kombu.exceptions import OperationalError as KombuOperationalError
from sqlalchemy import Connection

from ..broker import publish
from ..broker.confirms import BrokerRefused
from ..broker.control import revoke_children
from ..codec import decode_result, decode_signature, serialize
from ..context import FanIn
from ..protocol import (
    CHORD_OPTION,
    HEADER_TASK,
    UNPUBLISHABLE_TASK,
    BatchState,
    ChildState,
    OutcomePayload,
    SuccessorKind,
)
from ..store import batches, outbox, queries, recovery
from ..store.outcomes import build_outcome

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
    # What the successor gets first: the outcome mapping; for a chord whose header all succeeded, the results
    outcome: Any
    # A chord's body that must not run (`HEADER_CHORD`: "failed", "too_large"), or None
    chord: str | None = None


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
    limit = limit or int(fanin.settings.relay_batch_size)
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
        # Only after the producer's batch flushed: a failed flush raises and rolls the claim back. The commit does
        # not wait for the WAL flush unless children were abandoned in it (`outbox.mark_sent`).
        outbox.mark_sent(conn, sent, durable=bool(abandoned))
    _log_published(sent)
    for batch_id, task_ids in abandoned:
        # The batch passed its failure threshold: the children still queued or running are no longer wanted (they
        # were marked abandoned with the claim's commit, so whatever they report now is recorded as late).
        try:
            revoke_children(fanin, task_ids, batch_id)
        except Exception:
            logger.warning("could not revoke the unfinished children of batch_id=%s", batch_id, exc_info=True)
    return len(sent)


def publish_created_successor(fanin: FanIn, batch_id: uuid.UUID, handed_off: Sequence[outbox.OutboxRow]) -> int:
    """Publish a successor from the worker whose report created it, right after that report committed, as the
    producer publishes its children. Never raises: a failure is logged and leaves the row to the relay.

    A completed batch's successor was handed to this worker (`fanin_successor_handoff`: the relay's claim skips
    its outbox row for that long): the report returned it (`handed_off`), it is published, and marked sent on
    the report connection, with no lock held in between, so the successor's
    delivery never waits on this worker's transaction. Any other (a
    batch past its failure threshold, whose unfinished children are abandoned in the same transaction as the
    mark; the handoff off) goes through the relay's claim (`publish_outbox`), the row locked until marked sent.
    """
    try:
        if not handed_off:
            return publish_outbox(fanin, batch_id=batch_id)
        return _publish_handed_off(fanin, handed_off)
    except Exception:  # noqa: BLE001 - the child's report is done; the relay publishes what this could not
        logger.warning(
            "could not publish the successor of batch_id=%s after its last report; the relay will",
            batch_id,
            exc_info=True,
            extra={"batch_id": str(batch_id)},
        )
        with contextlib.suppress(Exception):  # due at once rather than after the handoff (the database may be down)
            fanin.reports.wake_relay(batch_id)
        return 0


def _publish_handed_off(fanin: FanIn, rows: Sequence[outbox.OutboxRow]) -> int:
    """Publish the rows `handed_off` read, then mark them sent (not durably: a mark lost in a crash publishes the
    successor again, and its run guard, whose commit is durable, refuses the copy if the first one started).

    Published but not marked (the database lost meanwhile), a row goes out again from the relay once due (not
    sooner: the relay is not woken for it), and the guard refuses that copy. Only a completed batch is handed off,
    so nothing here abandons children."""
    with contextlib.ExitStack() as stack:
        send = _to_broker(fanin.app, stack.enter_context(publish.producer(fanin.app, batched=len(rows) > 1)))
        # A complete batch with no failures needs no read for its outcome (see build_outcome).
        failures = any(row.batch is not None and row.batch.failed for row in rows)
        conn = stack.enter_context(fanin.engine.connect()) if failures else None
        for row in rows:
            _send_successor(fanin, conn, send, row)
    # After the producer's batch flushed (and, on RabbitMQ, was confirmed): a failed publish raised above.
    _log_published(rows)
    try:
        fanin.reports.mark_sent([row.id for row in rows])
    except Exception:  # noqa: BLE001 - published: the relay's copy, once the row is due, meets the run guard
        logger.warning(
            "published the successor of batch_id=%s but could not mark it sent; the relay publishes it again once "
            "due, and its run guard refuses the second copy",
            rows[0].batch_id,
            exc_info=True,
            extra={"batch_id": str(rows[0].batch_id)},
        )
    return len(rows)


def _log_published(rows: Sequence[outbox.OutboxRow]) -> None:
    for row in rows:
        extra = {"batch_id": str(row.batch_id), "step": row.step}
        logger.info("published successor batch_id=%s step=%s", row.batch_id, row.step, extra=extra)


def _to_broker(app: Celery, prod: Producer) -> Callable[[Due], None]:
    def send(due: Due) -> None:
        publish.publish_successor(
            app, prod, due.batch_id, due.step, due.task_id, due.signature, due.outcome, chord=due.chord
        )

    return send


def _send_successor(
    fanin: FanIn, conn: Connection | None, deliver: Callable[[Due], None], row: outbox.OutboxRow
) -> list[str]:
    """Send one outbox row's successor. If its batch finished early on its failure threshold, abandon its
    unfinished children (every leaf's, for a tree), after the outcome was built from what had happened by then,
    and return their task ids to revoke. `conn` may be None only for a complete batch without failures (a
    successor handed to its worker: `build_outcome` reads nothing for it)."""
    batch, succ = row.batch, row.successor  # read by the claim
    if batch is None:  # cascade-deleted rows cannot be claimed; this guards a hand-edited database
        raise LookupError(f"batch {row.batch_id} of outbox row {row.id} is gone")
    task_id = succ.task_id if succ is not None else batch.successor_task_id
    kind = succ.kind if succ is not None else SuccessorKind.THEN
    sig = decode_signature(fanin.app, batch.message_for(kind))
    limit, max_bytes = fanin.settings.outcome_failures_limit, fanin.settings.outcome_max_bytes
    outcome = build_outcome(conn, batch, limit, max_bytes=max_bytes)
    if sig.options.pop(CHORD_OPTION, None) and kind == SuccessorKind.THEN:
        first, why = _chord_results(fanin, batch, outcome)
        if why is None and not _encodable(fanin, sig, first):
            first, why = outcome, "unencodable"
        deliver(Due(row, batch.id, row.step, task_id, sig, first, why))
    else:
        deliver(Due(row, batch.id, row.step, task_id, sig, outcome))
    if batch.state != BatchState.FAILED_THRESHOLD:
        return []
    if conn is None:  # never handed off (fanin_create_successor hands off only a complete batch)
        raise ValueError(f"batch {batch.id} passed its failure threshold: abandoning its children needs a connection")
    return recovery.abandon_after_threshold(conn, batch.id)


def _chord_results(fanin: FanIn, batch: queries.BatchRow, outcome: OutcomePayload) -> tuple[Any, str | None]:
    """What a chord's body is sent: the header's results in header order, read from PostgreSQL (across retry
    rounds), if every header task succeeded and they fit `fanin_chord_max_bytes`; else the outcome, with why the
    body must not run (its run guard then fails it with `ChordHeaderFailed`)."""
    if batch.state != BatchState.COMPLETE or outcome["failed"] or outcome["abandoned"] or outcome["unfinished"]:
        return outcome, "failed"
    budget = int(fanin.settings.chord_max_bytes)
    used, values = 0, []
    for _index, _task_id, state, encoded in queries.child_results(fanin.engine, batch.id, across_rounds=True):
        if state != ChildState.SUCCEEDED:  # a retry round's view: an earlier round's failure not retried yet
            return outcome, "failed"
        if encoded is not None:
            used += len(encoded.body)
            if used > budget:
                return outcome, "too_large"
        values.append(decode_result(fanin.app, encoded) if encoded is not None else None)
    return values, None


def _encodable(fanin: FanIn, sig: Signature, values: list[Any]) -> bool:
    """Whether the body's serializer carries the results (a result serializer may carry what the task serializer
    cannot: a set under pickle, read back for JSON): if not, the body fails with why, rather than the row failing
    to publish forever."""
    try:
        serialize(values, sig.options.get("serializer") or fanin.app.conf.task_serializer)
    except EncodeError:
        return False
    return True


def publish_remaining_children(fanin: FanIn, conn: Connection, batch_id: uuid.UUID, *, reject: bool = False) -> int:
    """Publish a batch's children from its `published_upto` mark onwards, a chunk at a time.

    The caller holds the batch's publish lock on `conn`. Each chunk's mark is committed after the chunk reached
    the broker, so a crash republishes at most one chunk (duplicates are counted once by the terminal guard).
    Children no longer pending (started, counted, abandoned) are skipped, and the mark moves past them too.
    With `reject` (the relay's orphan publishing), a child that cannot be published goes out as a rejection in its
    place (`rejection`) with the rest of its chunk: one bad child must hold back neither its batch nor the relay's
    round. Without (a producer), the error propagates, as an `apply_async` of that child would raise.
    Returns the number of children published (rejections not included).
    """
    app = fanin.app
    chunk = fanin.settings.chunk_size
    total = 0
    while True:
        rows = batches.unpublished_children(conn, batch_id, chunk)
        conn.commit()
        ready: list[tuple[int, str, Signature]] = []
        rejected: set[int] = set()
        for idx, task_id, task_name, enc in rows:
            sig = None
            try:
                sig = decode_signature(app, enc)
                publish.check_arguments(app, sig)
            except Exception as exc:  # noqa: BLE001 - whatever the stored message's fault, it is this child's
                if not reject:
                    raise
                ready.append((idx, task_id, rejection(app, batch_id, idx, task_id, task_name, exc, sig)))
                rejected.add(idx)
            else:
                ready.append((idx, task_id, sig))
        if ready:
            try:
                with publish.producer(app) as prod:
                    publish.publish_children(app, prod, batch_id, ready)
            except BROKER_ERRORS:
                raise  # the broker's fault (BrokerRefused too), not a child's: the caller decides
            except Exception:  # a message no check above foresaw cannot be built: find it, one child at a time
                if not reject:
                    raise
                logger.warning(
                    "a child of batch_id=%s cannot be published: publishing its chunk one child at a time",
                    batch_id,
                    exc_info=True,
                    extra={"batch_id": str(batch_id)},
                )
                names = {idx: task_name for idx, _, task_name, _ in rows}
                rejected |= _publish_one_by_one(fanin, batch_id, ready, names)
        # A short chunk was the last: nothing past it is pending, so the mark reaches the end of the batch.
        batches.mark_published(conn, batch_id, rows[-1][0] + 1 if len(rows) == chunk else None)
        conn.commit()
        total += len(ready) - len(rejected)
        if len(rows) < chunk:
            return total


def _publish_one_by_one(
    fanin: FanIn, batch_id: uuid.UUID, children: list[tuple[int, str, Signature]], names: dict[int, str]
) -> set[int]:
    """Publish each child alone, a rejection in place of each that fails on its own; returns the indexes of those.

    Only after a chunk failed on a child: the children before it in the chunk may have reached the broker already
    (on RabbitMQ they were written before the failure), and are published again (counted once, as after a crash).
    """
    app = fanin.app
    rejected = set()
    for idx, task_id, sig in children:
        try:
            with publish.producer(app) as prod:
                publish.publish_children(app, prod, batch_id, [(idx, task_id, sig)])
        except BROKER_ERRORS:
            raise
        except Exception as exc:  # noqa: BLE001 - this child's message, alone, cannot be built or sent
            stand_in = rejection(app, batch_id, idx, task_id, names[idx], exc, sig)
            with publish.producer(app) as prod:
                publish.publish_children(app, prod, batch_id, [(idx, task_id, stand_in)])
            rejected.add(idx)
    return rejected


# The options of a child's own signature that say where its messages go: its rejection goes there too.
_ROUTING_OPTIONS = ("queue", "exchange", "routing_key", "exchange_type", "priority")


def rejection(
    app: Celery,
    batch_id: uuid.UUID,
    idx: int,
    task_id: str,
    task_name: str,
    exc: Exception,
    sig: Signature | None,
) -> Signature:
    """What the relay publishes in place of a child it cannot publish (its stored message does not decode, its
    arguments do not fit its task, its message cannot be built): `celery_fanin.unpublishable`, under the child's
    task id, batch headers and task name, which the worker that takes it rejects, so that the worker hooks count
    the child `rejected` (exc_type `Reject`, the reason in its message), once, through the workers' checked report.

    Why a message and not a write: left pending the child would be tried again every round and its batch would
    never finish, and counting an outcome is the workers' right, not the relay's (docs/how-to/database-roles.md).
    It goes where the child would have (its own queue option, else the route of its task's name).
    """
    reason = f"not published by the relay: {type(exc).__name__}: {exc}"[:2000]
    logger.error(
        "child of batch_id=%s index=%d task_id=%s cannot be published (%s: %s): published as a rejection",
        batch_id,
        idx,
        task_id,
        type(exc).__name__,
        exc,
        extra={"batch_id": str(batch_id), "child_index": idx, "task_id": task_id},
    )
    options: dict[str, Any] = {}
    if sig is not None:  # plain values only: whatever made this child unpublishable must not follow it
        options = {k: v for k in _ROUTING_OPTIONS if isinstance(v := sig.options.get(k), (str, int))}
    if "queue" not in options:
        try:
            queue = app.amqp.router.route({}, task_name).get("queue")
        except Exception:  # noqa: BLE001 - a routing function that fails for this name: the default queue
            queue = None
        if queue is not None:
            options["queue"] = getattr(queue, "name", queue)
    options["headers"] = {HEADER_TASK: task_name}
    return app.signature(UNPUBLISHABLE_TASK, args=(reason,), options=options)


def publish_orphaned_children(fanin: FanIn, limit: int = 100) -> int:
    """Finish publishing every batch whose producer is gone; skips batches a live producer is still publishing.

    A child that cannot be published goes out as a rejection in its place, which a worker counts `rejected`
    (`publish_remaining_children`): the round goes on with the others, and the batch can finish."""
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
                count = publish_remaining_children(fanin, conn, batch_id, reject=True)
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
