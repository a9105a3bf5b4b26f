"""The transactions that carry celery-fanin's guarantees.

Every function takes an open SQLAlchemy `Connection`; the caller owns the transaction (``engine.begin()``), so a
reviewer can see each guarantee's boundary at its call site. All of them must run at READ COMMITTED: the conditional
decrement relies on a waiting UPDATE re-checking its WHERE clause against the row version that made it wait.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any

import psycopg
from sqlalchemy import Connection
from sqlalchemy.exc import DBAPIError

from ..protocol import CHILD_OPEN, BatchState, ChildState, OnDeadline, OnLost, SuccessorKind
from .statements import q

# Terminal states a child can end in; `succeeded` counts as a success, every other one as a failure.
CHILD_TERMINAL_STATES = frozenset(ChildState) - CHILD_OPEN

# The per-batch advisory lock a producer holds while it publishes its children is keyed by the batch id's first
# 64 bits, in the two-int form (which does not overlap the single-bigint key space used by migrations): two batches
# share a lock only if their random ids share 64 bits. The relay matches a batch to its lock in pg_locks the same
# way (`lapsed_open_batches` in sql/queries.sql, `fanin_renew_open_batches` in sql/schema.sql).


@dataclass(frozen=True)
class Encoded:
    """A value encoded with one of kombu's serializers, as stored in a bytea column."""

    content_type: str
    content_encoding: str
    body: bytes


@dataclass(frozen=True)
class NewChild:
    task_id: str
    task_name: str
    message: Encoded
    expires_at: datetime | None = None  # its message's `expires`, absolute (see recovery.expired_children)
    eta_at: datetime | None = None  # its `countdown` or `eta`: not overdue before it may run


@dataclass(frozen=True)
class NewBatch:
    id: uuid.UUID
    step: str
    successor_task_id: str
    successor_name: str
    successor_message: Encoded
    child_timeout: timedelta | None = None
    on_lost: str = OnLost.FAIL
    max_redrives: int = 3
    deadline_at: datetime | None = None
    on_deadline: str = OnDeadline.PROCEED
    max_failures: int | None = None
    on_expire: Encoded | None = None
    on_failure: Encoded | None = None
    # A ratio of failures, for a batch whose size is unknown until it is sealed.
    max_failures_ratio: float | None = None
    app_name: str | None = None
    key: str | None = None
    digest: bytes | None = None
    depth: int = 0
    lineage: uuid.UUID | None = None
    parent_task_id: str | None = None
    # A retry round (celery_fanin.ops.rounds): its number, and the batch of round 1 it retries.
    round: int = 1
    retry_of: uuid.UUID | None = None
    # A leaf of a root with a failure threshold: adds each failure to its root as it is counted (migration 0012).
    fail_up: bool = False


class KeyTaken(Exception):
    """Another batch of the same app holds this idempotency key."""


@dataclass(frozen=True)
class TerminalRecord:
    """What `reports.record_terminal` did: whether this report was the one that counted, and what it left."""

    counted: bool
    remaining: int | None
    successor_created: bool
    late: bool = False
    # The report named a child by its task id but its batch, index or task name differ (migration 0014).
    refused: bool = False
    # The successor this report created and handed to its session to publish, with its batch's and successor's
    # rows (`outbox.OutboxRow`s, which import this module: the report connection's reports only, migration 0025);
    # None where the statement does not say.
    handed_off: list[Any] | None = field(default=None, compare=False, repr=False)


def create_batch(
    conn: Connection, batch: NewBatch, children: Sequence[NewChild], *, leaves: int = 0, chunk: int = 1000
) -> int | None:
    """Write the batch, its planned count and every child in one transaction, before anything is published.

    Invariant: `remaining = planned = len(children)` is committed together with exactly those child rows, so no
    child can finish before its counter exists and the counter never exceeds the children created. With
    `leaves`, the batch is the root of a tree: child i goes to leaf i % leaves (round robin, so that concurrent
    reports spread over the leaves' counter rows), each leaf counts its own children, and the root counts its
    leaves. An empty batch is complete at once: its successor and outbox row are written in the same
    transaction, and that outbox row's id is returned (else None). Raises `KeyTaken`, having written nothing, if
    the batch's key is already taken.
    """
    n = len(children)
    if leaves <= 0:
        if not insert_batch(conn, batch, state=BatchState.COMPLETE if n == 0 else BatchState.RUNNING, planned=n):
            raise KeyTaken(batch.key or "")
        for start in range(0, n, chunk):
            insert_children(conn, batch.id, children[start : start + chunk], start)
        return None if n else insert_successor(conn, batch.id, SuccessorKind.THEN)
    if not insert_batch(conn, batch, state=BatchState.RUNNING, planned=n, remaining=leaves):
        raise KeyTaken(batch.key or "")
    leaf_ids = [uuid.uuid4() for _ in range(leaves)]
    insert_leaves(conn, batch, [(leaf_id, len(range(k, n, leaves))) for k, leaf_id in enumerate(leaf_ids)])
    for start in range(0, n, chunk):
        insert_placed(conn, [(leaf_ids[i % leaves], children[i], i) for i in range(start, min(n, start + chunk))])
    return None


def leaf_of(root: NewBatch, leaf_id: uuid.UUID) -> NewBatch:
    """A leaf inherits what recovery needs per child (timeouts); deadline, threshold and successor stay on the
    root. Under a root with a threshold the leaf hands each failure up at once, so one leaf's failures can
    finish the whole tree early."""
    leaf = NewBatch(
        id=leaf_id,
        step=root.step,
        successor_task_id="",
        successor_name="",
        successor_message=root.successor_message,
        child_timeout=root.child_timeout,
        on_lost=root.on_lost,
        max_redrives=root.max_redrives,
        app_name=root.app_name,
        depth=root.depth,
        lineage=root.lineage,
    )
    return replace(leaf, fail_up=root.max_failures is not None or root.max_failures_ratio is not None)


def insert_batch(
    conn: Connection,
    batch: NewBatch,
    *,
    state: BatchState,
    planned: int,
    parent_id: uuid.UUID | None = None,
    remaining: int | None = None,
) -> bool:
    """Insert one batch row: `running` with its children's count, or `open` holding the producer's token
    (remaining = 1, planned = 0: `add_children` raises both as chunks are written, `seal` releases the token).

    A batch with a key that is already taken is not inserted (the unique index makes racing callers wait for the
    first one's commit); returns False then.
    """
    if remaining is None:
        remaining = 1 if state == BatchState.OPEN else planned
    row = conn.execute(q("insert_batch").text, _batch_params(batch, state, planned, parent_id, remaining)).first()
    return row is not None


def insert_leaves(conn: Connection, root: NewBatch, leaves: Sequence[tuple[uuid.UUID, int]]) -> None:
    """A tree's leaf rows (`leaf_of` the root; each `(id, planned)`), in one executemany: psycopg pipelines it,
    so a wide tree's leaves cost about one round trip rather than one each."""
    conn.execute(
        q("insert_batch").text,
        [
            _batch_params(leaf_of(root, leaf_id), BatchState.RUNNING, planned, root.id, planned)
            for leaf_id, planned in leaves
        ],
    )


def _batch_params(
    batch: NewBatch, state: BatchState, planned: int, parent_id: uuid.UUID | None, remaining: int
) -> dict[str, Any]:
    return {
        "id": batch.id,
        "step": batch.step,
        "state": state,
        "planned": planned,
        "remaining": remaining,
        "stid": batch.successor_task_id,
        "sname": batch.successor_name,
        "smsg": batch.successor_message.body,
        "sct": batch.successor_message.content_type,
        "sce": batch.successor_message.content_encoding,
        "child_timeout": batch.child_timeout,
        "on_lost": batch.on_lost,
        "max_redrives": batch.max_redrives,
        "deadline_at": batch.deadline_at,
        "on_deadline": batch.on_deadline,
        "max_failures": batch.max_failures,
        "ratio": batch.max_failures_ratio,
        "emsg": batch.on_expire.body if batch.on_expire else None,
        "ect": batch.on_expire.content_type if batch.on_expire else None,
        "ece": batch.on_expire.content_encoding if batch.on_expire else None,
        "fmsg": batch.on_failure.body if batch.on_failure else None,
        "fct": batch.on_failure.content_type if batch.on_failure else None,
        "fce": batch.on_failure.content_encoding if batch.on_failure else None,
        "app_name": batch.app_name,
        "key": batch.key,
        "digest": batch.digest,
        "parent_id": parent_id,
        "depth": batch.depth,
        "lineage": batch.lineage,
        "parent_task_id": batch.parent_task_id,
        "round": batch.round,
        "retry_of": batch.retry_of,
        "fail_up": batch.fail_up,
    }


def insert_children(conn: Connection, batch_id: uuid.UUID, children: Sequence[NewChild], start: int) -> None:
    """All children of a one-transaction batch, with indexes from `start`, in one statement."""
    insert_placed(conn, [(batch_id, child, start + i) for i, child in enumerate(children)])


# COPY has no ON CONFLICT; children never need one (their task ids are new, and a taken one must fail the chunk).
_COPY_CHILDREN = q("copy_children").sql
_COPY_TYPES = ("text", "uuid", "int4", "text", "bytea", "text", "text", "timestamptz", "timestamptz")


def insert_placed(conn: Connection, placed: Sequence[tuple[uuid.UUID, NewChild, int]]) -> None:
    """A chunk of children, each with its batch (the root or a leaf) and global index, in the caller's transaction.

    With psycopg's binary COPY: about half the time per child of ``INSERT ... SELECT FROM unnest(arrays)``
    (measured here: 27 against 58 µs), the largest cost of creating a batch. Its errors are raised as SQLAlchemy's,
    as an ``execute`` would raise them (a taken task id is an ``IntegrityError``).
    """
    driver: psycopg.Connection[Any] = conn.connection.driver_connection  # type: ignore[assignment]
    try:
        with driver.cursor() as cursor, cursor.copy(_COPY_CHILDREN) as copy:
            copy.set_types(list(_COPY_TYPES))
            write = copy.write_row
            for batch_id, child, idx in placed:
                message = child.message
                write(
                    (
                        child.task_id,
                        batch_id,
                        idx,
                        child.task_name,
                        message.body,
                        message.content_type,
                        message.content_encoding,
                        child.expires_at,
                        child.eta_at,
                    )
                )
    except psycopg.Error as exc:
        raise DBAPIError.instance(_COPY_CHILDREN, None, exc, psycopg.Error) from exc


def add_children(
    conn: Connection,
    root_id: uuid.UUID,
    placed: Sequence[tuple[uuid.UUID, NewChild, int]],
    digest: bytes,
    *,
    opened: int = 0,
) -> bool:
    """Write one chunk of an open batch's children and raise the counters that wait for them, in one transaction.

    Each child is placed in the root itself or one of its open leaves, with its global index. A leaf's own
    counter waits for its children; the root's `planned` counts every child (its `remaining` counts its direct
    children and its leaves, `opened` of them new in this chunk: see `add_leaf`). `digest` is the chain over
    every child written so far, for resuming and for telling a different child list from the same one under a
    key. Each chunk also renews the producer's lease (`producer_seen_at`). Returns False if the root is no longer
    open (it passed its failure threshold, or was sealed or cancelled by an operator, the relay or its deadline):
    the caller must roll this chunk back and stop.

    The leaves' rows are locked before the root's, the order every terminal report takes them in.
    """
    insert_placed(conn, placed)
    per_leaf: dict[uuid.UUID, int] = {}
    for batch_id, _, _ in placed:
        if batch_id != root_id:
            per_leaf[batch_id] = per_leaf.get(batch_id, 0) + 1
    # One statement (fanin_add_children, sql/schema.sql): leaves locked in id order, then the root.
    return bool(
        conn.execute(
            q("add_children").text,
            {
                "root": root_id,
                "ids": list(per_leaf),
                "ns": list(per_leaf.values()),
                "total": len(placed),
                "direct": len(placed) - sum(per_leaf.values()) + opened,
                "digest": digest,
            },
        ).scalar_one()
    )


def lock_membership(conn: Connection, batch_id: uuid.UUID) -> None:
    """Take the transaction-level lock that serialises what an open batch holds: a producer's chunk (its new
    leaves and children) against the transactions that end or seal the batch (`recovery.expire_batch`,
    `recovery.seal_open_batch`).

    Without it, a cancel, a deadline or a seal that read the batch's children (or leaves) before a chunk committed
    went on once it could lock the root, finishing the batch with the chunk's children pending and uncounted (or
    sealing the root and leaving the chunk's new leaves open for ever). Taken first by both sides, before any row
    lock (a child's insert takes a key-share lock on its batch row); terminal reports never take it, so it adds
    no lock to their path and cannot deadlock with them. Keyed by the batch id's second 64 bits, so it is not the
    publish lock (`hold_publish_lock`, the first 64), which a live producer holds for as long as it writes.
    """
    key = batch_id.bytes
    conn.execute(
        q("lock_membership").text,
        {"k1": int.from_bytes(key[8:12], "big", signed=True), "k2": int.from_bytes(key[12:16], "big", signed=True)},
    )


def write_chunk(
    conn: Connection,
    root: NewBatch,
    placed: Sequence[tuple[uuid.UUID, NewChild, int]],
    digest: bytes,
    *,
    opened: Sequence[uuid.UUID] = (),
    full: Sequence[uuid.UUID] = (),
) -> bool:
    """One chunk of an open batch, in the caller's transaction: the leaves it opens, its children and counters
    (`add_children`), and the leaves it fills, sealed. Returns False if the batch is no longer open: the caller
    must roll the chunk back and stop."""
    lock_membership(conn, root.id)
    # Read under that lock: once the root was cancelled or sealed (and perhaps pruned since), a new leaf's row
    # would fail on its foreign key instead of the chunk being refused (found by the protocol model).
    if not conn.execute(q("takes_children").text, {"id": root.id}).scalar():
        return False
    for leaf_id in opened:
        add_leaf(conn, root, leaf_id)
    if not add_children(conn, root.id, placed, digest, opened=len(opened)):
        return False
    for leaf_id in full:
        seal(conn, leaf_id)
    return True


def state_of(conn: Connection, batch_id: uuid.UUID) -> str | None:
    """A batch's state now (None if there is no such batch)."""
    state = conn.execute(q("state_of").text, {"id": batch_id}).scalar()
    conn.rollback()
    return None if state is None else str(state)


def add_leaf(conn: Connection, root: NewBatch, leaf_id: uuid.UUID) -> None:
    """Open a leaf under an open root. The root's wait for it (one unit of its `remaining`) is added by the
    chunk's `add_children(opened=...)`, after the leaves' rows: taking the root's lock here, before the leaves',
    could deadlock with a report that holds a leaf and pushes a failure up to the root."""
    insert_batch(conn, leaf_of(root, leaf_id), state=BatchState.OPEN, planned=0, parent_id=root.id)


def seal(conn: Connection, batch_id: uuid.UUID) -> bool:
    """Release an open batch's token: it takes no more children and can finish. True if that created the
    successor (everything had already finished)."""
    row = conn.execute(q("seal").text, {"id": batch_id}).one()
    return bool(row.successor_created)


def find_by_key(conn: Connection, app_name: str, key: str) -> tuple[uuid.UUID, str, int, bytes | None] | None:
    """The batch holding an idempotency key: (id, state, planned, digest)."""
    row = conn.execute(
        q("find_by_key").text,
        {"a": app_name, "k": key},
    ).first()
    return None if row is None else (row.id, row.state, row.planned, bytes(row.digest) if row.digest else None)


def successor_task_id(conn: Connection, batch_id: uuid.UUID) -> str | None:
    row = conn.execute(q("successor_task_id").text, {"id": batch_id}).first()
    return None if row is None else str(row[0])


def direct_children(conn: Connection, batch_id: uuid.UUID) -> int:
    """Children written to the batch row itself (not to its leaves)."""
    return int(conn.execute(q("direct_children").text, {"id": batch_id}).scalar_one())


def open_leaves(conn: Connection, root_id: uuid.UUID) -> list[tuple[uuid.UUID, int]]:
    """An open root's open leaves and how many children each holds (to resume a producer)."""
    rows = conn.execute(
        q("open_leaves").text,
        {"id": root_id},
    )
    return [(r.id, r.planned) for r in rows]


def insert_successor(conn: Connection, batch_id: uuid.UUID, kind: str) -> int | None:
    """Create the batch's one successor (`kind` says which signature it runs) and its outbox row, once.

    `fanin_ensure_successor` (sql/schema.sql) does it from the batch's own row, only for a finished root; a second
    call is a no-op. Returns the new outbox row's id, or None.
    """
    row = conn.execute(q("insert_successor").text, {"id": batch_id, "kind": kind}).scalar()
    return None if row is None else int(row)


# The statements a worker sends, each a whole transaction in autocommit (one round trip), in psycopg's
# placeholders because the worker hooks send them over a psycopg connection of their own (`store.reports`, which
# holds the function that sends each).
# A worker's report names the child's batch, index and task name as its message carries them, and counts only
# if the child row agrees (`fanin_report_terminal_v2`, from migration 0014). The recovery paths, which read the
# child from the store rather than from a message, send RECOVERY_TERMINAL_SQL (`fanin_record_terminal_v2`, by
# task id).
RECORD_TERMINAL = q("report_terminal")
RECOVERY_TERMINAL = q("record_terminal")
# The same from a worker's main process about a copy that never ran: counted only while no copy started the child.
REPORT_UNRUN = q("report_unrun")
# Many claimed reports in one statement and one commit (`reports.record_terminals`).
RECORD_TERMINAL_MANY = q("report_terminal_many")
RECORD_TERMINAL_SQL, RECOVERY_TERMINAL_SQL = RECORD_TERMINAL.psycopg, RECOVERY_TERMINAL.psycopg
# Many children's starts in one statement (the worker's main process writes them; see `celery_fanin.starts`).
RECORD_STARTS = q("record_starts")
RECORD_STARTS_SQL = RECORD_STARTS.psycopg
# The relay woken by hand, for a successor such a connection created that its worker leaves to the relay.
WAKE_RELAY = q("wake_relay")
NOTE_TRACEBACK = q("note_traceback")


@dataclass(frozen=True)
class Claim:
    """What a report's message says the child is: its batch, index and (when known) the task it was published
    as. The store counts the report only if the child row agrees."""

    batch_id: str
    index: int | None
    task_name: str | None


@dataclass(frozen=True)
class Start:
    """A worker took a child: its task id, Celery retry number, worker name, and when."""

    task_id: str
    attempt: int
    worker: str | None
    started_at: datetime


def terminal_params(
    task_id: str,
    state: str,
    result: Encoded | None,
    exc_type: str | None,
    exc_message: str | None,
    start: Start | None = None,
    claim: Claim | None = None,
    handoff: float | None = None,
) -> dict[str, object]:
    """The parameters of RECORD_TERMINAL_SQL (with `claim`) or RECOVERY_TERMINAL_SQL; refuses a state that is not
    terminal before anything is sent.

    `start`: the child's start, when it was not written yet (see `celery_fanin.starts`): recorded with the outcome.
    `handoff`: who publishes a successor the report creates (`fanin_create_successor_v2`): None, the relay; seconds
    (0 or more), the reporting worker, which the relay leaves a completed batch's successor to for that long.
    """
    if state not in CHILD_TERMINAL_STATES:
        raise ValueError(f"not a terminal child state: {state!r}")
    checked: dict[str, object] = {}
    if claim is not None:
        checked = {"batch_id": claim.batch_id, "index": claim.index, "task_name": claim.task_name}
    return {
        **checked,
        "started_at": start.started_at if start else None,
        "attempt": start.attempt if start else None,
        "worker": start.worker if start else None,
        "task_id": task_id,
        "state": state,
        "result": result.body if result else None,
        "rct": result.content_type if result else None,
        "rce": result.content_encoding if result else None,
        "exc_type": exc_type,
        "exc_message": exc_message,
        "handoff": None if handoff is None else max(0.0, float(handoff)),
    }


def starts_params(starts: Sequence[Start]) -> dict[str, object]:
    return {
        "task_ids": [s.task_id for s in starts],
        "attempts": [s.attempt for s in starts],
        "workers": [s.worker for s in starts],
        "started_at": [s.started_at for s in starts],
    }


def terminal_record(row: Sequence[Any]) -> TerminalRecord:
    """The row RECORD_TERMINAL_SQL returns: (counted, late, remaining, successor_created, refused, handed_off), or
    RECOVERY_TERMINAL_SQL's (the first four). `handed_off` is read by `reports.record_terminal`."""
    counted, late, remaining, successor_created = row[:4]
    refused = bool(row[4]) if len(row) > 4 else False
    return TerminalRecord(bool(counted), remaining, bool(successor_created), bool(late), refused)


def _lock_key(batch_id: uuid.UUID) -> dict[str, object]:
    key = batch_id.bytes
    return {"k1": int.from_bytes(key[0:4], "big", signed=True), "k2": int.from_bytes(key[4:8], "big", signed=True)}


def hold_publish_lock(conn: Connection, batch_id: uuid.UUID) -> None:
    """Take the session-level lock that says "this batch's children are being published by a live process".

    Taken inside the creating transaction, it outlives the commit; it is released by `release_publish_lock` or by
    the connection closing when the producer dies, which is how the relay knows the producer is gone.
    """
    conn.execute(q("hold_publish_lock").text, _lock_key(batch_id))


def try_publish_lock(conn: Connection, batch_id: uuid.UUID) -> bool:
    return bool(conn.execute(q("try_publish_lock").text, _lock_key(batch_id)).scalar_one())


def release_publish_lock(conn: Connection, batch_id: uuid.UUID) -> None:
    conn.execute(q("release_publish_lock").text, _lock_key(batch_id))


def mark_published(conn: Connection, batch_id: uuid.UUID, upto: int | None) -> None:
    """Record that children with idx < upto are on the broker or need not be (monotonic: never moves back);
    `None`: all the batch's children so far."""
    conn.execute(q("mark_published").text, {"id": batch_id, "upto": upto})


def unpublished_batches(conn: Connection, limit: int = 100) -> list[uuid.UUID]:
    """Batches some of whose children may never have reached the broker (their producer died or is publishing)."""
    rows = conn.execute(
        q("unpublished_batches").text,
        {"n": limit},
    )
    return [r[0] for r in rows]


def unpublished_children(conn: Connection, batch_id: uuid.UUID, limit: int) -> list[tuple[int, str, str, Encoded]]:
    """The next children of a batch not yet known to be published and still waited for, in index order, with
    their task names and stored messages.

    Only `pending` ones: a child that started was delivered, and one that is terminal (counted, or abandoned or
    lost by recovery) must not run again for nothing. When fewer than `limit` come back, every child past the
    last one needs no publishing: `mark_published(conn, batch_id, None)` says so.
    """
    rows = conn.execute(
        q("unpublished_children").text,
        {"id": batch_id, "n": limit},
    )
    return [
        (r.idx, r.task_id, r.task_name, Encoded(r.content_type, r.content_encoding, bytes(r.message))) for r in rows
    ]
