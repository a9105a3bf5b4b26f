"""The one claim-and-publish of successors (`publish_outbox`): the producer (an empty batch), a worker whose report
created a successor (`publish_created_successor`), eager mode and the relay all send a successor through it.
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
from sqlalchemy import Connection

from ..broker import publish
from ..broker.confirms import BrokerRefused
from ..broker.control import revoke_children
from ..broker.publish import BROKER_ERRORS
from ..codec import decode_result, decode_signature, serialize
from ..context import FanIn
from ..protocol import (
    CHORD_OPTION,
    BatchState,
    ChildState,
    OutcomePayload,
    SuccessorKind,
)
from ..store import outbox, queries, recovery, reports
from ..store.outcomes import build_outcome
from . import inline

logger = logging.getLogger("celery_fanin.dispatch")


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
            reports.wake_relay(fanin.reports, batch_id)
        return 0


def _publish_handed_off(fanin: FanIn, rows: Sequence[outbox.OutboxRow]) -> int:
    """Publish the rows `handed_off` read, then mark them sent (not durably: a mark lost in a crash publishes the
    successor again, and its run guard, whose commit is durable, refuses the copy if the first one started).

    Published but not marked (the database lost meanwhile), a row goes out again from the relay once due (not
    sooner: the relay is not woken for it), and the guard refuses that copy. Only a completed batch is handed off,
    so nothing here abandons children."""
    here: list[tuple[Due, inline.Message]] = []
    with contextlib.ExitStack() as stack:
        send = _to_broker_when_needed(fanin.app, stack, batched=len(rows) > 1)
        if len(rows) == 1 and fanin.settings.successor_inline and inline.job_reason_not(fanin.app) is None:
            send = _here_or(fanin.app, send, here)
        # A complete batch with no failures needs no read for its outcome (see build_outcome).
        failures = any(row.batch is not None and row.batch.failed for row in rows)
        conn = stack.enter_context(fanin.engine.connect()) if failures else None
        for row in rows:
            _send_successor(fanin, conn, send, row)
    if here:  # after the engine's connection went back: the successor's body may take any time
        _run_here(fanin, rows, *here[0])
        return len(rows)
    # After the producer's batch flushed (and, on RabbitMQ, was confirmed): a failed publish raised above.
    _log_published(rows)
    mark_sent(fanin, rows[0].batch_id, [row.id for row in rows])
    return len(rows)


def _to_broker_when_needed(app: Celery, stack: contextlib.ExitStack, batched: bool) -> Callable[[Due], None]:
    """`_to_broker` on a producer taken from the pool at the first message (none for a successor run here),
    flushed when `stack` closes."""
    send: Callable[[Due], None] | None = None

    def deliver(due: Due) -> None:
        nonlocal send
        if send is None:
            send = _to_broker(app, stack.enter_context(publish.producer(app, batched=batched)))
        send(due)

    return deliver


def _here_or(
    app: Celery, to_broker: Callable[[Due], None], here: list[tuple[Due, inline.Message]]
) -> Callable[[Due], None]:
    """Keep a successor this process may run (`dispatch.inline`) in `here`, with its message; publish any other."""

    def deliver(due: Due) -> None:
        built = publish.successor_message(
            app, due.batch_id, due.step, due.task_id, due.signature, due.outcome, due.chord
        )
        msg = inline.message(app, due.task_id, built) if built is not None else None
        if msg is None:
            to_broker(due)
        else:
            here.append((due, msg))

    return deliver


def _run_here(fanin: FanIn, rows: Sequence[outbox.OutboxRow], due: Due, msg: inline.Message) -> None:
    """Run a completed batch's successor in this process (`fanin_successor_inline`). Its outbox row is marked sent
    (not durably, as after a publish) by its run guard once admitted (`inline.take_unsent`), else here."""
    extra = {"batch_id": str(due.batch_id), "step": due.step}
    logger.info(
        "running successor batch_id=%s step=%s here, where its batch completed", due.batch_id, due.step, extra=extra
    )
    inline.hold_unsent(msg.task_id, [row.id for row in rows])
    try:
        inline.run(fanin.app, msg)
    finally:
        unsent = inline.take_unsent(msg.task_id)  # its guard did not take them (refused it, or never got that far)
        if unsent:
            mark_sent(fanin, due.batch_id, unsent)


def mark_sent(fanin: FanIn, batch_id: uuid.UUID | str, ids: list[int]) -> None:
    """Mark a handed-off successor's outbox rows sent (`store.reports.mark_sent`, not durable), after its publish or
    once its run here was admitted. Never raises: a row left unsent goes out again from the relay once due, and
    its run guard refuses that copy."""
    try:
        reports.mark_sent(fanin.reports, ids)
    except Exception:  # noqa: BLE001 - see above
        logger.warning(
            "could not mark the successor of batch_id=%s sent; the relay publishes it again once due, and its run "
            "guard refuses that copy",
            batch_id,
            exc_info=True,
            extra={"batch_id": str(batch_id)},
        )


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
