"""Writing a batch and publishing its children: committed before published, in one transaction or streamed a
chunk at a time, flat or as a tree (docs/concepts/producer.md).
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import itertools
import logging
import math
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from celery.canvas import Signature
from sqlalchemy import Connection
from sqlalchemy.exc import SQLAlchemyError

from ..broker import publish
from ..broker.control import revoke_children
from ..context import FanIn
from ..dispatch.children import publish_remaining_children
from ..dispatch.successors import publish_outbox
from ..exceptions import BatchClosed, FanInDatabaseError, InvalidFanIn, summarise
from ..protocol import BatchState
from ..store import batches, outbox, recovery
from .transaction import CallerTransaction, publish_committed, wake_relay

logger = logging.getLogger("celery_fanin.producer")

# Turns a signature (and its position) into the child row to write; raises InvalidFanIn for bad input.
Encoder = Callable[[int, Any], tuple[batches.NewChild, Signature]]


@dataclass
class Written:
    """What a call to `write` did."""

    batch_id: uuid.UUID
    created: int  # children this call created (0 when it returned an existing batch)
    existing: bool = False  # the key was taken: the handle is the existing batch's
    successor_outbox_id: int | None = None
    successor_task_id: str | None = None  # the existing batch's, where the handle cannot read it yet


def digest_step(digest: bytes, child: batches.NewChild) -> bytes:
    """The chain over children's messages in order: equal for the same child list, whatever their task ids."""
    return hashlib.sha256(digest + hashlib.sha256(child.message.body).digest()).digest()


EMPTY_DIGEST = hashlib.sha256(b"celery-fanin").digest()
# RabbitMQ: chunks written but not yet confirmed while the next is built. The broker confirms persistent messages
# after it syncs them to disk, in bursts; with a single chunk in flight the producer waited for most bursts.
CHUNKS_IN_FLIGHT = 4


def _connect(fanin: FanIn) -> Connection:
    try:
        return fanin.engine.connect()
    except SQLAlchemyError as exc:
        raise FanInDatabaseError(f"cannot reach the fan-in database; nothing was published: {summarise(exc)}") from exc


# --- where children go: the root, or leaves of a tree -------------------------------------------------------------


@dataclass
class _Leaf:
    id: uuid.UUID
    size: int


@dataclass
class Layout:
    """Assigns each new child to the root (up to `direct_left` more) or to a leaf of the current window."""

    max_width: int
    fanout: int
    direct_left: int
    window: list[_Leaf] = field(default_factory=list)
    _next: int = 0

    def place(self, n: int) -> tuple[list[uuid.UUID | None], list[uuid.UUID], list[uuid.UUID]]:
        """Targets for the next `n` children (None: the root), leaves to open first, and leaves now full."""
        targets: list[uuid.UUID | None] = []
        opened: list[uuid.UUID] = []
        full: list[uuid.UUID] = []
        for _ in range(n):
            if self.direct_left > 0:
                self.direct_left -= 1
                targets.append(None)
                continue
            open_leaves = [leaf for leaf in self.window if leaf.size < self.max_width]
            if not open_leaves:
                self.window = [_Leaf(uuid.uuid4(), 0) for _ in range(self.fanout)]
                opened.extend(leaf.id for leaf in self.window)
                open_leaves = self.window
                self._next = 0
            leaf = open_leaves[self._next % len(open_leaves)]
            self._next += 1
            leaf.size += 1
            targets.append(leaf.id)
            if leaf.size == self.max_width:
                full.append(leaf.id)
        return targets, opened, full

    def unsealed(self) -> list[uuid.UUID]:
        return [leaf.id for leaf in self.window if leaf.size < self.max_width]


# --- the two paths, and the caller's transaction ------------------------------------------------------------------


def _in_transaction(
    fanin: FanIn,
    tx: CallerTransaction,
    root: batches.NewBatch,
    source: Iterable[Any],
    encode: Encoder,
    ratio: float | None,
    max_width: int,
) -> Written:
    """Write the batch `root` and every child on the caller's connection, under a savepoint, in the caller's
    transaction; publish after its commit (see `celery_fanin.producer.transaction`). A list of children only:
    a stream commits chunk by chunk, which a transaction that is not ours cannot do."""
    if not isinstance(source, Sequence) or isinstance(source, (str, bytes)):
        raise InvalidFanIn("transaction= needs a list of children (a generator is written in chunks of its own)")
    root, prepared, leaves = _prepare_list(root, source, encode, ratio, max_width)
    digest = root.digest
    children = [c for c, _ in prepared]
    conn = tx.conn
    try:
        with conn.begin_nested():
            try:
                outbox_id = batches.create_batch(conn, root, children, leaves=leaves, chunk=fanin.settings.chunk_size)
            except batches.KeyTaken:
                found = batches.find_by_key(conn, root.app_name or "", root.key or "")
                if found is None or found[2] != len(children) or found[3] != digest:
                    raise InvalidFanIn(
                        f"key {root.key!r} is taken by batch {found[0] if found else '?'} with a different child list"
                    ) from None
                successor = batches.successor_task_id(conn, found[0])  # perhaps not committed yet: read it here
                return Written(found[0], 0, existing=True, successor_task_id=successor)
            wake_relay(conn, root.id)
    except SQLAlchemyError as exc:
        raise FanInDatabaseError(f"could not record the batch in the caller's transaction: {summarise(exc)}") from exc
    if tx.after_commit is not None:
        tx.after_commit(lambda: publish_committed(fanin, root.id, outbox_id))
    return Written(root.id, len(children), successor_outbox_id=None)


def write(
    fanin: FanIn,
    root: batches.NewBatch,
    source: Iterable[Any],
    encode: Encoder,
    *,
    ratio: float | None,
    max_width: int,
    tx: CallerTransaction | None = None,
) -> Written:
    """Write (or find, or resume) the batch `root` with the children `source` yields, publishing them; with `tx`,
    in the caller's transaction, published after it commits."""
    if tx is not None:
        return _in_transaction(fanin, tx, root, source, encode, ratio, max_width)
    settings = fanin.settings
    if isinstance(source, Sequence) and not isinstance(source, (str, bytes)):
        # Everything is in memory already: validate and encode it all, then write it in one transaction.
        return _write_at_once(fanin, *_prepare_list(root, source, encode, ratio, max_width))
    layout = Layout(max_width, settings.tree_fanout, max_width)
    return _stream(fanin, replace(root, max_failures_ratio=ratio), _encoded(source, encode), layout)


def _prepare_list(
    root: batches.NewBatch, source: Sequence[Any], encode: Encoder, ratio: float | None, max_width: int
) -> tuple[batches.NewBatch, list[tuple[batches.NewChild, Signature]], int]:
    """A list of children encoded and checked whole: the batch with its digest and failure threshold, the
    children, and the number of leaves (0: flat)."""
    prepared = [encode(i, item) for i, item in enumerate(source)]
    _check_unique_ids(prepared)
    digest = EMPTY_DIGEST
    for child, _ in prepared:
        digest = digest_step(digest, child)
    threshold = math.floor(ratio * len(prepared)) if ratio is not None else root.max_failures
    leaves = math.ceil(len(prepared) / max_width) if len(prepared) > max_width else 0
    return replace(root, digest=digest, max_failures=threshold), prepared, leaves


def _encoded(source: Iterable[Any], encode: Encoder) -> Iterator[tuple[batches.NewChild, Signature]]:
    for i, item in enumerate(source):
        yield encode(i, item)


def _check_unique_ids(prepared: Sequence[tuple[batches.NewChild, Signature]]) -> None:
    if len({c.task_id for c, _ in prepared}) != len(prepared):
        raise InvalidFanIn("two children share a task_id; every child needs its own")


def _write_at_once(
    fanin: FanIn, root: batches.NewBatch, prepared: list[tuple[batches.NewChild, Signature]], leaves: int
) -> Written:
    """A list: batch, planned count and every child (in leaves, above max_width) in one transaction; then
    publish, a chunk at a time."""
    children = [c for c, _ in prepared]
    chunk = fanin.settings.chunk_size
    conn = _connect(fanin)
    with conn:
        try:
            with conn.begin():
                batches.hold_publish_lock(conn, root.id)
                outbox_id = batches.create_batch(conn, root, children, leaves=leaves, chunk=chunk)
        except batches.KeyTaken:
            _release(conn, root.id)
            return _existing(fanin, conn, root, iter(prepared), known_digest=root.digest, known_count=len(children))
        except SQLAlchemyError as exc:
            _release(conn, root.id)
            raise FanInDatabaseError(f"could not record the batch; nothing was published: {summarise(exc)}") from exc
        # Committed: the batch is durable. Whatever this process fails to publish, the relay publishes once this
        # connection (and with it the publish lock) is gone.
        chunks = _ChunkPublisher(fanin, conn, root.id)
        try:
            for start in range(0, len(prepared), chunk):
                chunks.send(start, prepared[start : start + chunk])
                if not chunks.ok:
                    break  # the broker is unreachable: the relay publishes the rest
        finally:
            try:
                chunks.close()
            finally:
                _release(conn, root.id)
    return Written(root.id, len(children), successor_outbox_id=outbox_id)


def _stream(
    fanin: FanIn,
    root: batches.NewBatch,
    items: Iterator[tuple[batches.NewChild, Signature]],
    layout: Layout,
    *,
    total_digest: bytes | None = None,
) -> Written:
    """The streaming path: an open batch with a token, one transaction and one bulk publish per chunk, then seal."""
    conn = _connect(fanin)
    with conn:
        try:
            with conn.begin():
                batches.hold_publish_lock(conn, root.id)
                inserted = batches.insert_batch(
                    conn, replace(root, digest=EMPTY_DIGEST), state=BatchState.OPEN, planned=0
                )
        except SQLAlchemyError as exc:
            _release(conn, root.id)
            raise FanInDatabaseError(f"could not record the batch; nothing was published: {summarise(exc)}") from exc
        if not inserted:
            _release(conn, root.id)
            return _existing(fanin, conn, root, items, known_digest=total_digest, layout=layout)
        try:
            created = _fill(fanin, conn, root, items, layout, start=0, digest=EMPTY_DIGEST)
        finally:
            _release(conn, root.id)
    return Written(root.id, created)


def _fill(
    fanin: FanIn,
    conn: Connection,
    root: batches.NewBatch,
    items: Iterator[tuple[batches.NewChild, Signature]],
    layout: Layout,
    *,
    start: int,
    digest: bytes,
) -> int:
    """Write and publish the rest of `items` chunk by chunk, then seal the open leaves and the root.

    If the input raises (the generator itself, or a child that cannot be encoded), the batch cannot be completed
    by this call. Without a key nothing can ever resume it, so it is cancelled at once (see `_cancel_unfinishable`)
    and the error is raised; with a key it stays open for a rerun with the same key to resume, and the relay seals
    it once its producer has been gone for `fanin_open_batch_grace`.
    """
    chunk_size = fanin.settings.chunk_size
    index = start
    chunks = _ChunkPublisher(fanin, conn, root.id)
    finished_early = False
    try:
        while True:
            try:
                part = list(itertools.islice(items, chunk_size))
            except Exception:
                chunks.close()  # what was written goes out (and is then revoked) before the batch is cancelled
                _cancel_unfinishable(fanin, conn, root, index)
                raise
            if not part:
                break
            # Duplicate task ids are caught here within a chunk, and by the primary key across chunks: a set of
            # every id would make the producer's memory grow with the batch instead of the chunk.
            seen_ids: set[str] = set()
            for child, _ in part:
                if child.task_id in seen_ids:
                    chunks.close()
                    _cancel_unfinishable(fanin, conn, root, index)
                    raise InvalidFanIn(f"child {index}: two children share the task_id {child.task_id!r}")
                seen_ids.add(child.task_id)
                digest = digest_step(digest, child)
            targets, opened, full = layout.place(len(part))
            placed = [
                (target or root.id, child, index + offset)
                for offset, ((child, _), target) in enumerate(zip(part, targets, strict=True))
            ]
            try:
                with conn.begin():
                    if not batches.write_chunk(conn, root, placed, digest, opened=opened, full=full):
                        raise _NotOpen
            except _NotOpen:
                if batches.state_of(conn, root.id) != BatchState.FAILED_THRESHOLD:
                    raise BatchClosed(
                        f"batch {root.id} was sealed or cancelled while this producer was still writing it; "
                        f"children {index}.. were not written"
                    ) from None
                finished_early = True
                break
            except SQLAlchemyError as exc:
                raise FanInDatabaseError(
                    f"could not record children {index} to {index + len(part) - 1} of batch {root.id} (it stays "
                    f"open: rerun with the same key to resume): {summarise(exc)}"
                ) from exc
            chunks.send(index, part)  # after a refused chunk, only written: the relay publishes them
            index += len(part)
    finally:
        chunks.close()
    if finished_early:
        # Its successor (or on_failure) is on its way and the relay abandons what is unfinished; the rest of the
        # input is not consumed.
        logger.warning(
            "batch_id=%s finished early (its failure threshold) while being written: stopped after %d children",
            root.id,
            index,
            extra={"batch_id": str(root.id)},
        )
        return index - start
    try:
        with conn.begin():
            for leaf_id in layout.unsealed():
                batches.seal(conn, leaf_id)
            successor_created = batches.seal(conn, root.id)
    except SQLAlchemyError as exc:
        raise FanInDatabaseError(f"could not seal batch {root.id} (rerun with the same key): {summarise(exc)}") from exc
    if successor_created:  # everything had finished before the seal: send the successor now
        _publish_successor_now(fanin, root.id)
    return index - start


class _NotOpen(Exception):
    """The open batch is no longer open: it finished early (its failure threshold) or was sealed or cancelled by
    someone else. The chunk being written is rolled back and writing stops."""


def _cancel_unfinishable(fanin: FanIn, conn: Connection, root: batches.NewBatch, index: int) -> None:
    """The input raised at child `index`: without a key, cancel the batch so it does not stay open forever.

    Cancelled rather than sealed: sealing would run the successor on part of the input as though it were all of
    it. The batch ends `cancelled` (its `on_expire`, if any, runs), the children already sent are revoked, and the
    caller's exception propagates. With a key the batch is left open for a rerun to resume. If even the cancel
    cannot be written, the batch stays open and the relay seals it after `fanin_open_batch_grace`.
    """
    if root.key is not None:
        logger.warning(
            "batch_id=%s (key %r): the input raised at child %d; the batch stays open for a rerun with "
            "the same key to resume",
            root.id,
            root.key,
            index,
            extra={"batch_id": str(root.id)},
        )
        return
    try:
        conn.rollback()
        with conn.begin():
            expiry = recovery.cancel_open_batch(conn, root.id)
    except SQLAlchemyError:
        logger.warning(
            "batch_id=%s: the input raised and the batch could not be cancelled; the relay will seal it",
            root.id,
            exc_info=True,
            extra={"batch_id": str(root.id)},
        )
        return
    if expiry is None:
        return
    logger.warning(
        "batch_id=%s cancelled: the input raised at child %d (%d unfinished children abandoned)",
        root.id,
        index,
        len(expiry.abandoned),
        extra={"batch_id": str(root.id)},
    )
    try:
        revoke_children(fanin, expiry.abandoned, root.id)
    except Exception:
        logger.warning("could not revoke the children of cancelled batch_id=%s", root.id, exc_info=True)


class _ChunkPublisher:
    """Publishes a batch's committed chunks in order and records each as published once it is on the broker.

    It stops at the first chunk that does not reach the broker: `published_upto` then stays at that chunk's start
    and the relay publishes from there once this producer's lock is gone (a later chunk must never mark an earlier,
    refused one as published). On RabbitMQ up to `CHUNKS_IN_FLIGHT` chunks stay in flight: chunk k's confirms are
    waited for once chunk k + CHUNKS_IN_FLIGHT is written (and, streaming, its rows committed), so the broker
    stores earlier chunks while the next are built; a crash republishes at most the chunks in flight (duplicates
    are counted once). The producer is held from the first chunk to `close`.
    """

    def __init__(self, fanin: FanIn, conn: Connection, root_id: uuid.UUID) -> None:
        self.fanin = fanin
        self.conn = conn
        self.root_id = root_id
        self.ok = True  # False from the first chunk that did not reach the broker
        self._stack = contextlib.ExitStack()
        self._producer: Any = None
        self._in_flight: collections.deque[tuple[int, int, publish.Unconfirmed]] = collections.deque()

    def send(self, start: int, part: Sequence[tuple[batches.NewChild, Signature]]) -> None:
        """Publish children `start`.. (already committed), then record the chunk before them as published."""
        if not self.ok:
            return
        app = self.fanin.app
        try:
            if self._producer is None:
                self._producer = self._stack.enter_context(app.producer_or_acquire())
            unconfirmed = publish.publish_children(
                app,
                self._producer,
                self.root_id,
                ((start + i, child.task_id, sig) for i, (child, sig) in enumerate(part)),
                wait=False,
            )
        except Exception:
            self._finish()  # the chunks before may still have reached the broker
            if self.ok:
                self._failed(start)
            return
        self._in_flight.append((start, start + len(part), unconfirmed))
        self._finish(keep=CHUNKS_IN_FLIGHT if unconfirmed.pending else 0)  # Redis: on the broker already

    def _finish(self, keep: int = 0) -> None:
        """Wait for the oldest chunks in flight to be confirmed, oldest first, until `keep` are left, and record
        each as published."""
        while len(self._in_flight) > keep and self.ok:
            start, end, unconfirmed = self._in_flight.popleft()
            try:
                unconfirmed.wait()
                batches.mark_published(self.conn, self.root_id, end)
                self.conn.commit()
            except Exception:
                self._failed(start)

    def _failed(self, start: int) -> None:
        self.ok = False
        self._in_flight.clear()  # later chunks' confirms are not waited for: the relay republishes from `start`
        self.conn.rollback()
        logger.warning(
            "batch_id=%s is recorded but children %d.. were not published; the relay will publish them",
            self.root_id,
            start,
            exc_info=True,
            extra={"batch_id": str(self.root_id)},
        )

    def close(self) -> bool:
        """Finish the chunks in flight and release the producer; True if every chunk reached the broker."""
        try:
            self._finish()
        finally:
            self._stack.close()
        return self.ok


def _publish_successor_now(fanin: FanIn, batch_id: uuid.UUID) -> None:
    try:
        with fanin.engine.connect() as conn:
            ids = outbox.pending_ids(conn, batch_id)
        publish_outbox(fanin, ids=ids)
    except Exception:
        logger.warning("could not publish the successor of batch_id=%s; the relay will", batch_id, exc_info=True)


def _release(conn: Connection, batch_id: uuid.UUID) -> None:
    """Release the publish lock (a rollback does not), or drop the connection and the lock with it."""
    try:
        conn.rollback()
        batches.release_publish_lock(conn, batch_id)
        conn.commit()
    except SQLAlchemyError:
        conn.invalidate()


# --- an idempotency key that is already taken ----------------------------------------------------------------------


def _existing(
    fanin: FanIn,
    conn: Connection,
    root: batches.NewBatch,
    items: Iterator[tuple[batches.NewChild, Signature]],
    *,
    known_digest: bytes | None = None,
    known_count: int | None = None,
    layout: Layout | None = None,
) -> Written:
    """The key is taken: return that batch if it is the same child list, resume it if its producer died."""
    found = batches.find_by_key(conn, root.app_name or "", root.key or "")
    conn.commit()
    if found is None:  # deleted between our insert and this read: vanishingly rare, and safe to report
        raise FanInDatabaseError(f"the batch holding key {root.key!r} disappeared; try again")
    batch_id, state, planned, digest = found
    if state == BatchState.OPEN:
        if not _wait_for_publish_lock(conn, batch_id, RESUME_LOCK_WAIT):
            logger.info("key %r: batch_id=%s is being written by another producer; returning it", root.key, batch_id)
            return Written(batch_id, 0, existing=True)
        try:
            return _resume(fanin, conn, replace(root, id=batch_id), items, planned, digest, layout)
        finally:
            _release(conn, batch_id)
    if state == BatchState.FAILED_THRESHOLD and known_count != planned:
        # It finished early on its failure threshold while being written, and holds only the first `planned`
        # children of its input: those are what must match.
        prefix = EMPTY_DIGEST
        for child, _ in itertools.islice(items, planned):
            prefix = digest_step(prefix, child)
        if prefix != digest:
            raise InvalidFanIn(f"key {root.key!r} is taken by batch {batch_id} with a different child list")
        logger.info("key %r: batch_id=%s finished early; nothing created or published", root.key, batch_id)
        return Written(batch_id, 0, existing=True)
    # Sealed: the same child list (by count and digest) returns the batch; anything else is an error.
    if known_digest is None or known_count is None:
        seen, chained = 0, EMPTY_DIGEST
        for child, _ in items:
            chained = digest_step(chained, child)
            seen += 1
        known_digest, known_count = chained, seen
    if known_count != planned or known_digest != digest:
        raise InvalidFanIn(
            f"key {root.key!r} is taken by batch {batch_id} with a different child list "
            f"({planned} children there, {known_count} given); use another key"
        )
    logger.info("key %r: batch_id=%s exists; nothing created or published", root.key, batch_id)
    return Written(batch_id, 0, existing=True)


# How long a resumer waits for an open batch's lock: the relay holds it briefly while it publishes children a dead
# producer left unpublished, and a killed producer's session takes a moment to end; a live producer holds it longer.
RESUME_LOCK_WAIT = 5.0


def _wait_for_publish_lock(conn: Connection, batch_id: uuid.UUID, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while True:
        locked = batches.try_publish_lock(conn, batch_id)
        conn.commit()
        if locked or time.monotonic() >= deadline:
            return locked
        time.sleep(0.1)


def _resume(
    fanin: FanIn,
    conn: Connection,
    root: batches.NewBatch,
    items: Iterator[tuple[batches.NewChild, Signature]],
    planned: int,
    digest: bytes | None,
    layout: Layout | None,
) -> Written:
    """Continue an open batch whose producer died: skip the children it has, checking they are the same ones."""
    chained = EMPTY_DIGEST
    for _ in range(planned):
        item = next(items, None)
        if item is None:
            raise InvalidFanIn(f"key {root.key!r}: batch {root.id} already has {planned} children, the input fewer")
        chained = digest_step(chained, item[0])
    if chained != digest:
        raise InvalidFanIn(f"key {root.key!r} is taken by batch {root.id} with a different child list")
    # Children the dead producer committed but did not publish go out first.
    publish_remaining_children(fanin, conn, root.id)
    direct = batches.direct_children(conn, root.id)
    leaves = batches.open_leaves(conn, root.id)
    conn.commit()
    base = layout or Layout(fanin.settings.max_width, fanin.settings.tree_fanout, fanin.settings.max_width)
    max_width = base.max_width
    resumed = Layout(
        max_width, base.fanout, max(0, base.direct_left - direct), [_Leaf(leaf_id, size) for leaf_id, size in leaves]
    )
    logger.warning(
        "resuming batch_id=%s (key %r) after %d children", root.id, root.key, planned, extra={"batch_id": str(root.id)}
    )
    created = _fill(fanin, conn, root, items, resumed, start=planned, digest=chained)
    return Written(root.id, created, existing=True)
