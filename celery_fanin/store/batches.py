"""The transactions that carry celery-fanin's guarantees.

Every function takes an open SQLAlchemy `Connection`; the caller owns the transaction (``engine.begin()``), so a
reviewer can see each guarantee's boundary at its call site. All of them must run at READ COMMITTED: the conditional
decrement relies on a waiting UPDATE re-checking its WHERE clause against the row version that made it wait.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import Connection, text

# Terminal states a child can end in; `succeeded` counts as a success, every other one as a failure. `lost` and
# `abandoned` are set by recovery (child_timeout, deadline), never by a worker.
CHILD_TERMINAL_STATES = frozenset(
    {"succeeded", "failed", "time_limit", "worker_lost", "revoked", "rejected", "unknown", "lost", "abandoned"}
)
# Not yet terminal: published (or about to be), or started by a worker.
CHILD_OPEN_STATES = ("pending", "started")
# Successor states after which `wait()` returns.
SUCCESSOR_FINAL_STATES = frozenset({"succeeded", "failed", "revoked"})

# The namespace of the per-batch advisory lock a producer holds while it publishes its children (two-int form,
# which does not overlap the single-bigint key space used by migrations).
_PUBLISH_LOCK_CLASS = 0x66616E69  # "fani"
# ... and of the lock a pool process holds while it runs a successor's body.
_RUN_LOCK_CLASS = 0x66616E6A


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


@dataclass(frozen=True)
class NewBatch:
    id: uuid.UUID
    step: str
    successor_task_id: str
    successor_name: str
    successor_message: Encoded
    child_timeout: timedelta | None = None
    on_lost: str = "fail"
    max_redrives: int = 3
    deadline_at: datetime | None = None
    on_deadline: str = "proceed"
    max_failures: int | None = None
    on_expire: Encoded | None = None
    on_failure: Encoded | None = None


@dataclass(frozen=True)
class TerminalRecord:
    """What `record_terminal` did: whether this report was the one that counted, and what it left."""

    counted: bool
    remaining: int | None
    successor_created: bool
    late: bool = False


def create_batch(conn: Connection, batch: NewBatch, children: Sequence[NewChild]) -> int | None:
    """Write the batch, its planned count and every child in one transaction, before anything is published.

    Invariant: `remaining = planned = len(children)` is committed together with exactly those child rows, so no
    child can finish before its counter exists and the counter never exceeds the children created. An empty batch
    is complete at once: its successor and outbox row are written in the same transaction. Returns that outbox
    row's id, or None.
    """
    planned = len(children)
    conn.execute(
        text(
            """
            INSERT INTO fanin_batches (id, step, state, planned, remaining, successor_task_id, successor_name,
                                       successor_message, successor_content_type, successor_content_encoding,
                                       completed_at, child_timeout, on_lost, max_redrives, deadline_at, on_deadline,
                                       max_failures, on_expire_message, on_expire_content_type,
                                       on_expire_content_encoding, on_failure_message, on_failure_content_type,
                                       on_failure_content_encoding)
            VALUES (:id, :step, CASE WHEN :planned = 0 THEN 'complete' ELSE 'running' END, :planned, :planned,
                    :stid, :sname, :smsg, :sct, :sce, CASE WHEN :planned = 0 THEN now() END,
                    :child_timeout, :on_lost, :max_redrives, :deadline_at, :on_deadline, :max_failures,
                    :emsg, :ect, :ece, :fmsg, :fct, :fce)
            """
        ),
        {
            "id": batch.id,
            "step": batch.step,
            "planned": planned,
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
            "emsg": batch.on_expire.body if batch.on_expire else None,
            "ect": batch.on_expire.content_type if batch.on_expire else None,
            "ece": batch.on_expire.content_encoding if batch.on_expire else None,
            "fmsg": batch.on_failure.body if batch.on_failure else None,
            "fct": batch.on_failure.content_type if batch.on_failure else None,
            "fce": batch.on_failure.content_encoding if batch.on_failure else None,
        },
    )
    if children:
        # One statement for all children: arrays unnested server-side are about twice as fast as multi-row VALUES.
        conn.execute(
            text(
                """
                INSERT INTO fanin_children (task_id, batch_id, idx, task_name, message, content_type,
                                            content_encoding)
                SELECT t.task_id, :batch_id, t.ord - 1, t.task_name, t.message, t.ct, t.ce
                  FROM unnest(CAST(:task_ids AS text[]), CAST(:names AS text[]), CAST(:messages AS bytea[]),
                              CAST(:cts AS text[]), CAST(:ces AS text[]))
                       WITH ORDINALITY AS t(task_id, task_name, message, ct, ce, ord)
                """
            ),
            {
                "batch_id": batch.id,
                "task_ids": [c.task_id for c in children],
                "names": [c.task_name for c in children],
                "messages": [c.message.body for c in children],
                "cts": [c.message.content_type for c in children],
                "ces": [c.message.content_encoding for c in children],
            },
        )
        return None
    return insert_successor(conn, batch.id, "then")


def insert_successor(conn: Connection, batch_id: uuid.UUID, kind: str) -> int | None:
    """Create the batch's one successor (`kind` says which signature it runs) and its outbox row, once.

    The unique key (batch_id, step) makes a second call a no-op; returns the new outbox row's id, or None.
    """
    row = conn.execute(
        text(
            """
            WITH succ AS (
                INSERT INTO fanin_successors (batch_id, step, task_id, kind)
                SELECT id, step, successor_task_id, :kind FROM fanin_batches WHERE id = :id
                ON CONFLICT (batch_id, step) DO NOTHING
                RETURNING batch_id, step
            ), out AS (
                INSERT INTO fanin_outbox (batch_id, step) SELECT batch_id, step FROM succ RETURNING id
            )
            SELECT id, pg_notify('fanin_outbox', id::text) FROM out
            """
        ),
        {"id": batch_id, "kind": kind},
    ).first()
    return None if row is None else int(row[0])


# The one statement a child's terminal report costs (one round trip):
#  child  - the conditional transition: only a child still pending or started moves to its terminal state;
#  late   - a report for a child already terminal is recorded on the row and counts nothing;
#  batch  - only if `child` moved: the conditional decrement, never below zero, with succeeded/failed bumped; the
#           batch finishes when remaining reaches zero (`complete`) or, earlier, when `failed` first exceeds
#           max_failures (`failed_threshold`); later reports keep counting but never finish it again;
#  succ   - the report that finished the batch inserts its one successor, unique on (batch_id, step);
#  out    - and its outbox row; only this rare case sends NOTIFY.
# RETURNING shows new values only, so "this report finished it" is derived from them: exactly one update takes
# remaining to 0, and exactly one takes failed to max_failures + 1.
_RECORD_TERMINAL = text(
    """
    WITH child AS (
        UPDATE fanin_children
           SET state = :state, finished_at = now(),
               result = :result, result_content_type = :rct, result_content_encoding = :rce,
               exc_type = :exc_type, exc_message = :exc_message
         WHERE task_id = :task_id AND state IN ('pending', 'started')
     RETURNING batch_id
    ), late AS (
        UPDATE fanin_children
           SET late_state = :state, late_at = now(), late_reports = late_reports + 1
         WHERE task_id = :task_id AND state NOT IN ('pending', 'started') AND NOT EXISTS (SELECT 1 FROM child)
     RETURNING 1
    ), batch AS (
        UPDATE fanin_batches b
           SET remaining = b.remaining - 1,
               succeeded = b.succeeded + CAST(:ok AS integer),
               failed = b.failed + 1 - CAST(:ok AS integer),
               state = CASE
                   WHEN b.state <> 'running' THEN b.state
                   WHEN b.remaining = 1 THEN 'complete'
                   WHEN b.max_failures IS NOT NULL AND b.failed + 1 - CAST(:ok AS integer) > b.max_failures
                       THEN 'failed_threshold'
                   ELSE b.state END,
               completed_at = CASE
                   WHEN b.state = 'running' AND (b.remaining = 1 OR (b.max_failures IS NOT NULL
                        AND b.failed + 1 - CAST(:ok AS integer) > b.max_failures)) THEN now()
                   ELSE b.completed_at END
          FROM child
         WHERE b.id = child.batch_id AND b.remaining > 0
     RETURNING b.id, b.step, b.successor_task_id, b.remaining, b.state, b.failed, b.max_failures,
               b.on_failure_message IS NOT NULL AS has_on_failure
    ), finished AS (
        SELECT id, step, successor_task_id,
               CASE WHEN state = 'failed_threshold' AND has_on_failure THEN 'on_failure' ELSE 'then' END AS kind
          FROM batch
         WHERE (remaining = 0 AND state = 'complete')
            OR (state = 'failed_threshold' AND NOT :ok AND failed = max_failures + 1)
    ), succ AS (
        INSERT INTO fanin_successors (batch_id, step, task_id, kind)
        SELECT id, step, successor_task_id, kind FROM finished
        ON CONFLICT (batch_id, step) DO NOTHING
     RETURNING batch_id, step
    ), out AS (
        INSERT INTO fanin_outbox (batch_id, step) SELECT batch_id, step FROM succ RETURNING id
    )
    SELECT (SELECT count(*) FROM child) AS counted,
           (SELECT count(*) FROM late) AS late,
           (SELECT remaining FROM batch) AS remaining,
           (SELECT count(pg_notify('fanin_outbox', id::text)) FROM out) AS created
    """
)


def record_terminal(
    conn: Connection,
    task_id: str,
    state: str,
    *,
    result: Encoded | None = None,
    exc_type: str | None = None,
    exc_message: str | None = None,
) -> TerminalRecord:
    """Count one child's terminal outcome, at most once however often it is reported.

    Invariant: a child row moves from pending/started to a terminal state at most once (a concurrent or repeated
    report finds it terminal, is recorded as late and changes no counter); `remaining` is decremented only by the
    report that made that move and never below zero; exactly one transaction finishes the batch, and that one
    inserts the successor.
    """
    if state not in CHILD_TERMINAL_STATES:
        raise ValueError(f"not a terminal child state: {state!r}")
    row = conn.execute(
        _RECORD_TERMINAL,
        {
            "task_id": task_id,
            "state": state,
            "ok": state == "succeeded",
            "result": result.body if result else None,
            "rct": result.content_type if result else None,
            "rce": result.content_encoding if result else None,
            "exc_type": exc_type,
            "exc_message": exc_message,
        },
    ).one()
    late = bool(row.late)
    if not row.counted and not late:
        # A duplicate that raced the report that counted: the `late` CTE read the row as pending from the
        # statement's snapshot. A new statement sees the committed terminal row (rare: costs a second round trip).
        late = conn.execute(_RECORD_LATE, {"task_id": task_id, "state": state}).first() is not None
    return TerminalRecord(
        counted=bool(row.counted), remaining=row.remaining, successor_created=bool(row.created), late=late
    )


_RECORD_LATE = text(
    """
    UPDATE fanin_children
       SET late_state = :state, late_at = now(), late_reports = late_reports + 1
     WHERE task_id = :task_id AND state NOT IN ('pending', 'started')
 RETURNING 1
    """
)


def record_start(conn: Connection, task_id: str, attempt: int, worker: str | None) -> bool:
    """Note that a worker started a child (attempt = its Celery retry number); False if it is already terminal."""
    row = conn.execute(
        text(
            """
            UPDATE fanin_children
               SET state = 'started', started_at = now(), attempt = :attempt, starts = starts + 1, worker = :worker
             WHERE task_id = :task_id AND state IN ('pending', 'started')
         RETURNING 1
            """
        ),
        {"task_id": task_id, "attempt": attempt, "worker": worker},
    ).first()
    return row is not None


def _lock_key(batch_id: uuid.UUID) -> dict[str, object]:
    return {"cls": _PUBLISH_LOCK_CLASS, "id": str(batch_id)}


def hold_publish_lock(conn: Connection, batch_id: uuid.UUID) -> None:
    """Take the session-level lock that says "this batch's children are being published by a live process".

    Taken inside the creating transaction, it outlives the commit; it is released by `release_publish_lock` or by
    the connection closing when the producer dies, which is how the relay knows the producer is gone.
    """
    conn.execute(
        text("SELECT pg_advisory_lock(:cls, hashtext(:id))"), {"cls": _PUBLISH_LOCK_CLASS, "id": str(batch_id)}
    )


def try_publish_lock(conn: Connection, batch_id: uuid.UUID) -> bool:
    return bool(
        conn.execute(text("SELECT pg_try_advisory_lock(:cls, hashtext(:id))"), _lock_key(batch_id)).scalar_one()
    )


def release_publish_lock(conn: Connection, batch_id: uuid.UUID) -> None:
    conn.execute(
        text("SELECT pg_advisory_unlock(:cls, hashtext(:id))"), {"cls": _PUBLISH_LOCK_CLASS, "id": str(batch_id)}
    )


def mark_published(conn: Connection, batch_id: uuid.UUID, upto: int) -> None:
    """Record that children with idx < upto are on the broker (monotonic: never moves back)."""
    conn.execute(
        text("UPDATE fanin_batches SET published_upto = :upto WHERE id = :id AND published_upto < :upto"),
        {"id": batch_id, "upto": upto},
    )


def unpublished_batches(conn: Connection, limit: int = 100) -> list[uuid.UUID]:
    """Batches some of whose children may never have reached the broker (their producer died or is publishing)."""
    rows = conn.execute(
        text("SELECT id FROM fanin_batches WHERE published_upto < planned ORDER BY created_at LIMIT :n"), {"n": limit}
    )
    return [r[0] for r in rows]


def unpublished_children(conn: Connection, batch_id: uuid.UUID, limit: int) -> list[tuple[int, str, Encoded]]:
    """The next children of a batch not yet known to be published, in index order, with their stored messages."""
    rows = conn.execute(
        text(
            """
            SELECT c.idx, c.task_id, c.message, c.content_type, c.content_encoding
              FROM fanin_children c JOIN fanin_batches b ON b.id = c.batch_id
             WHERE c.batch_id = :id AND c.idx >= b.published_upto
             ORDER BY c.idx LIMIT :n
            """
        ),
        {"id": batch_id, "n": limit},
    )
    return [(r.idx, r.task_id, Encoded(r.content_type, r.content_encoding, bytes(r.message))) for r in rows]


# --- the successor's own lifecycle -------------------------------------------------------------------------------


def claim_successor_run(conn: Connection, batch_id: uuid.UUID, step: str, retries: int) -> bool:
    """Let one delivery of a successor run its body; refuse (and count) every duplicate.

    The caller keeps `conn` open for as long as the body runs: the session advisory lock taken here is what says
    "a live process is running this successor". A delivery that cannot take the lock is a duplicate of a live
    run. One that can take it runs if the successor was never started, is due for this Celery retry, or was left
    `running` by a process that died (its lock died with it). Anything else (finished, or an older retry's copy)
    is refused. Returns True with the lock held, or False with it released.
    """
    locked = conn.execute(text("SELECT pg_try_advisory_lock(:cls, hashtext(:key))"), _run_lock_key(batch_id, step))
    if locked.scalar_one():
        row = conn.execute(
            text(
                """
                UPDATE fanin_successors
                   SET state = 'running', runs = runs + 1, started_at = coalesce(started_at, now()), state_at = now()
                 WHERE batch_id = :id AND step = :step
                   AND (state IN ('pending', 'sent', 'running') OR (state = 'retrying' AND runs <= :retries))
             RETURNING runs
                """
            ),
            {"id": batch_id, "step": step, "retries": retries},
        ).first()
        conn.commit()
        if row is not None:
            return True
        release_successor_run(conn, batch_id, step)
    conn.execute(
        text("UPDATE fanin_successors SET duplicates = duplicates + 1 WHERE batch_id = :id AND step = :step"),
        {"id": batch_id, "step": step},
    )
    conn.commit()
    return False


def release_successor_run(conn: Connection, batch_id: uuid.UUID, step: str) -> None:
    conn.execute(text("SELECT pg_advisory_unlock(:cls, hashtext(:key))"), _run_lock_key(batch_id, step))
    conn.commit()


def _run_lock_key(batch_id: uuid.UUID, step: str) -> dict[str, object]:
    return {"cls": _RUN_LOCK_CLASS, "key": f"{batch_id}:{step}"}


RUN_LOCK_CLASS = _RUN_LOCK_CLASS


def record_successor_state(
    conn: Connection,
    batch_id: uuid.UUID,
    step: str,
    state: str,
    *,
    exc_type: str | None = None,
    exc_message: str | None = None,
) -> None:
    """Move the successor to `retrying` or a final state; a final state is never left again."""
    conn.execute(
        text(
            """
            UPDATE fanin_successors
               SET state = :state, exc_type = :exc_type, exc_message = :exc_message, state_at = now(),
                   finished_at = CASE WHEN :state = 'retrying' THEN NULL ELSE now() END
             WHERE batch_id = :id AND step = :step AND state NOT IN ('succeeded', 'failed', 'revoked')
            """
        ),
        {"id": batch_id, "step": step, "state": state, "exc_type": exc_type, "exc_message": exc_message},
    )
