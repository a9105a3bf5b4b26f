"""Children committed and not yet published: the rest of a batch after its first chunk (the producer), and the
children of a batch whose producer died before publishing them (the relay's `publish_orphaned_children`).
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

from celery import Celery
from celery.canvas import Signature
from sqlalchemy import Connection

from ..broker import publish
from ..broker.confirms import BrokerRefused
from ..broker.publish import BROKER_ERRORS
from ..codec import decode_signature
from ..context import FanIn
from ..protocol import (
    HEADER_TASK,
    UNPUBLISHABLE_TASK,
)
from ..store import batches

logger = logging.getLogger("celery_fanin.dispatch")


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
