"""The transactions that finish batches no child will finish: lost children, deadlines, and reconciliation.

Each works under the batch row's lock (`SELECT ... FOR UPDATE`), the same lock every terminal report takes, so
it is serialised with live traffic: a report waits for it, then re-checks its own conditions against what it
left. Run at READ COMMITTED, a statement after the lock sees every report that committed before it.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection, text

from .batches import PUBLISH_LOCK_OF, Encoded, insert_successor, lock_membership, record_terminal

# --- lost children -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OverdueChild:
    task_id: str
    batch_id: uuid.UUID
    idx: int
    state: str
    on_lost: str
    redrives: int
    max_redrives: int
    message: Encoded


def overdue_children(conn: Connection, limit: int = 500) -> list[OverdueChild]:
    """Unfinished children of running batches whose child_timeout has passed since they last started (or were
    published or redriven)."""
    rows = conn.execute(
        text(
            """
            SELECT c.task_id, c.batch_id, c.idx, c.state, b.on_lost, c.redrives, b.max_redrives,
                   c.message, c.content_type, c.content_encoding
              FROM fanin_batches b
              JOIN fanin_children c ON c.batch_id = b.id AND c.state IN ('pending', 'started')
             WHERE b.state IN ('open', 'running') AND b.child_timeout IS NOT NULL
               AND greatest(b.created_at, c.started_at, c.redriven_at, c.eta_at) + b.child_timeout < now()
               -- a nested fan-in's child is alive for as long as its inner batch is
               AND NOT EXISTS (SELECT 1 FROM fanin_batches n
                                WHERE n.parent_task_id = c.task_id AND n.state IN ('open', 'running'))
             ORDER BY b.created_at, c.idx
             LIMIT :n
            """
        ),
        {"n": limit},
    )
    return [
        OverdueChild(r.task_id, r.batch_id, r.idx, r.state, r.on_lost, r.redrives, r.max_redrives,
                     Encoded(r.content_type, r.content_encoding, bytes(r.message)))
        for r in rows
    ]  # fmt: skip


def claim_redrive(conn: Connection, child: OverdueChild) -> bool:
    """Take the right to re-publish an overdue child once: moves it back to pending and restarts its timer.

    Conditional on the redrive count the caller saw, so two relays never redrive the same child twice.
    """
    row = conn.execute(
        text(
            """
            UPDATE fanin_children
               SET state = 'pending', started_at = NULL, redriven_at = now(), redrives = redrives + 1
             WHERE task_id = :task_id AND state IN ('pending', 'started') AND redrives = :seen
         RETURNING 1
            """
        ),
        {"task_id": child.task_id, "seen": child.redrives},
    ).first()
    return row is not None


def fail_lost(conn: Connection, child: OverdueChild) -> bool:
    """Count an overdue child as a terminal failure with state `lost`; True if this call counted it.

    The child was read in an earlier transaction: its batch may have finished and been pruned since (then there
    is nothing left to count)."""
    timeout = conn.execute(
        text("SELECT child_timeout::text FROM fanin_batches WHERE id = :id"), {"id": child.batch_id}
    ).scalar()
    if timeout is None:
        return False
    rec = record_terminal(
        conn, child.task_id, "lost", exc_type="ChildLost",
        exc_message=f"no terminal outcome within child_timeout ({timeout}); redrives: {child.redrives}",
    )  # fmt: skip
    return rec.counted


# --- children whose message expired unconsumed -----------------------------------------------------------------


def expired_children(conn: Connection, grace_seconds: float, limit: int = 500) -> list[tuple[str, uuid.UUID, int]]:
    """Children never started whose `expires` passed more than `grace_seconds` ago: (task id, batch id, index).

    Why: RabbitMQ drops an expired message unconsumed (Celery gives it a TTL), so no worker's `task_revoked`
    reports it. A worker that took the message before it expired reports it itself (revoked, or its run)."""
    rows = conn.execute(
        text(
            """
            SELECT c.task_id, c.batch_id, c.idx
              FROM fanin_children c
              JOIN fanin_batches b ON b.id = c.batch_id AND b.state IN ('open', 'running')
             WHERE c.expires_at IS NOT NULL AND c.state = 'pending'
               AND c.expires_at + make_interval(secs => :grace) < now()
             ORDER BY c.expires_at
             LIMIT :n
            """
        ),
        {"grace": grace_seconds, "n": limit},
    )
    return [(r.task_id, r.batch_id, r.idx) for r in rows]


def revoke_expired(conn: Connection, task_id: str, grace_seconds: float) -> bool:
    """Count a child as `revoked` (expired) if it is still pending and past its expiry; True if this call did.

    The child row is locked first and checked again (a start written since moves it out of `pending`), then
    counted by the same conditional transition a worker's report takes: a real report arriving later is late.
    """
    still = conn.execute(
        text(
            """
            SELECT 1 FROM fanin_children
             WHERE task_id = :task_id AND state = 'pending'
               AND expires_at + make_interval(secs => :grace) < now()
               FOR UPDATE
            """
        ),
        {"task_id": task_id, "grace": grace_seconds},
    ).first()
    if still is None:
        return False
    rec = record_terminal(conn, task_id, "revoked", exc_type=EXPIRED_EXC_TYPE, exc_message="expired")
    return rec.counted


# What a worker records for a revoked child (celery_fanin.hooks._Revoked), so both paths read the same.
EXPIRED_EXC_TYPE = "_Revoked"


# --- deadlines -------------------------------------------------------------------------------------------------


def due_deadlines(conn: Connection, limit: int = 100) -> list[uuid.UUID]:
    rows = conn.execute(
        text(
            """
            SELECT id FROM fanin_batches
             WHERE state IN ('open', 'running') AND parent_id IS NULL
               AND deadline_at IS NOT NULL AND deadline_at <= now()
             ORDER BY deadline_at LIMIT :n
            """
        ),
        {"n": limit},
    )
    return [r[0] for r in rows]


@dataclass(frozen=True)
class Expiry:
    batch_id: uuid.UUID
    on_deadline: str  # how it was applied: "proceed" or "abandon"
    abandoned: list[str]  # task ids of the children marked abandoned
    successor_created: bool
    state: str = ""  # the batch's final state: partial, expired or cancelled


# Why a batch was ended early: the exception its unfinished children are abandoned with.
_ENDINGS = {
    "deadline": ("DeadlineExceeded", "the batch deadline passed before this child finished"),
    "cancel": ("Cancelled", "the batch was cancelled before this child finished"),
}


def expire_batch(
    conn: Connection, batch_id: uuid.UUID, *, reason: str = "deadline", proceed: bool | None = None
) -> Expiry | None:
    """Apply a passed deadline (or a cancel) to a running or open batch, once.

    `proceed`: every unfinished child becomes `abandoned` (a failure), the batch is `partial`, and its successor
    runs with what arrived. `abandon`: the same children are abandoned, the batch is `expired` (`cancelled` for a
    cancel), and only its `on_expire` signature runs, if it has one. Either way the counter reaches zero here, so
    later reports from abandoned children are recorded as late and never counted, and an open batch's producer
    can add nothing more. Returns None if the batch had already finished (or, for a deadline, is not yet due).

    `reason="cancel"` ends the batch now whatever its deadline, `proceed` defaulting to False; a deadline follows
    the batch's `on_deadline` unless `proceed` says otherwise.

    Locks are taken in the order every terminal report takes them (child rows, then leaves, then the root), so
    this never deadlocks with live reports; counters are then set from the child rows, under those locks.
    """
    exc_type, exc_message = _ENDINGS[reason]
    lock_membership(conn, batch_id)  # a producer's chunk in flight commits first, or waits and then finds it ended
    head = conn.execute(
        text(
            """
            SELECT on_deadline, on_expire_message IS NOT NULL AS has_on_expire, parent_task_id FROM fanin_batches
             WHERE id = :id AND state IN ('open', 'running') AND parent_id IS NULL
               AND (CAST(:anytime AS boolean) OR deadline_at <= now())
            """
        ),
        {"id": batch_id, "anytime": reason == "cancel"},
    ).first()
    if head is None:
        return None
    if proceed is None:
        proceed = reason == "deadline" and head.on_deadline == "proceed"
    # The children are abandoned before the root is locked (the order every report takes), so a report that held
    # one of them may have finished the batch meanwhile (its last child, or past its threshold): then the batch is
    # no longer this call's to end, and the children it abandoned go back as they were (a savepoint).
    ending = conn.begin_nested()
    abandoned = [
        r[0]
        for r in conn.execute(
            text(
                """
                UPDATE fanin_children
                   SET state = 'abandoned', finished_at = now(), exc_type = :exc_type, exc_message = :exc_message
                 WHERE batch_id IN (SELECT id FROM fanin_batches WHERE id = :id OR parent_id = :id)
                   AND state IN ('pending', 'started')
             RETURNING task_id
                """
            ),
            {"id": batch_id, "exc_type": exc_type, "exc_message": exc_message},
        )
    ]
    conn.execute(
        text("SELECT id FROM fanin_batches WHERE parent_id = :id ORDER BY id FOR UPDATE"), {"id": batch_id}
    ).all()
    still = conn.execute(
        text("SELECT 1 FROM fanin_batches WHERE id = :id AND state IN ('open', 'running') FOR UPDATE"),
        {"id": batch_id},
    ).first()
    if still is None:
        ending.rollback()
        return None
    ending.commit()
    new_state = "partial" if proceed else "cancelled" if reason == "cancel" else "expired"
    conn.execute(
        text(
            """
            WITH totals AS (
                SELECT count(*) FILTER (WHERE state = 'succeeded') AS s,
                       count(*) FILTER (WHERE state NOT IN ('pending', 'started', 'succeeded')) AS f
                  FROM fanin_children
                 WHERE batch_id IN (SELECT id FROM fanin_batches WHERE id = :id OR parent_id = :id)
            ), leaves AS (
                -- each leaf counts its own children too, the abandoned ones included (a leaf's counters always
                -- agree with its child rows: status, reconciliation and the root's sums read them)
                UPDATE fanin_batches b
                   SET state = :state, remaining = 0, completed_at = now(),
                       succeeded = (SELECT count(*) FROM fanin_children c
                                     WHERE c.batch_id = b.id AND c.state = 'succeeded'),
                       failed = (SELECT count(*) FROM fanin_children c
                                  WHERE c.batch_id = b.id AND c.state NOT IN ('pending', 'started', 'succeeded'))
                 WHERE b.parent_id = :id AND b.state IN ('open', 'running')
            )
            UPDATE fanin_batches b
               SET state = :state, remaining = 0, succeeded = totals.s, failed = totals.f, completed_at = now()
              FROM totals
             WHERE b.id = :id
            """
        ),
        {"id": batch_id, "state": new_state},
    )
    created = None
    if proceed:
        created = insert_successor(conn, batch_id, "then")
    elif head.has_on_expire:
        created = insert_successor(conn, batch_id, "on_expire")
    elif head.parent_task_id:
        # A nested batch abandoned with nothing to run: the outer child it stands for fails now.
        how = "cancelled" if reason == "cancel" else "abandoned at its deadline"
        record_terminal(
            conn, head.parent_task_id, "failed", exc_type=exc_type, exc_message=f"nested batch {batch_id} was {how}"
        )
    return Expiry(batch_id, "proceed" if proceed else "abandon", abandoned, created is not None, new_state)


# --- reconciliation --------------------------------------------------------------------------------------------


@dataclass
class Repair:
    """What reconciliation found wrong with one batch and what it did about it."""

    batch_id: uuid.UUID
    problems: list[str] = field(default_factory=list)
    actions: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"batch_id": str(self.batch_id), "problems": self.problems, "actions": self.actions}


def batches_to_reconcile(conn: Connection, limit: int = 1000) -> list[uuid.UUID]:
    """Open and running batches (leaves before roots, so a leaf finished here is counted in its root's recount),
    and finished roots whose successor or its outbox row is missing."""
    rows = conn.execute(
        text(
            """
            SELECT id FROM (
                SELECT id, parent_id IS NULL AS is_root FROM fanin_batches WHERE state IN ('open', 'running')
                UNION
                SELECT b.id, true FROM fanin_batches b
                  LEFT JOIN fanin_successors s ON s.batch_id = b.id AND s.step = b.step
                  LEFT JOIN fanin_outbox o ON o.batch_id = b.id AND o.step = b.step
                 WHERE b.parent_id IS NULL AND b.state IN ('complete', 'partial', 'failed_threshold')
                   AND (s.batch_id IS NULL OR o.id IS NULL)
            ) candidates
             ORDER BY is_root
             LIMIT :n
            """
        ),
        {"n": limit},
    )
    return [r[0] for r in rows]


def reconcile_batch(conn: Connection, batch_id: uuid.UUID) -> Repair | None:
    """Recompute one batch's counters from its child rows (and leaves) and repair what disagrees; None if all
    was right.

    Locks the batch row first: a terminal report in flight has updated its child row (or its leaf) but waits for
    this lock before decrementing, and its update is not visible to the counts below (uncommitted), so the
    counters written here are exactly what that report will then decrement. A batch whose children are all
    terminal is finished through `fanin_settle`, the same path a last report takes (a leaf settles its root, a
    root gets its successor exactly once). Missing child rows (planned > created: rows deleted by hand, a
    restored backup) are reported, never guessed at.
    """
    b = conn.execute(
        text(
            """
            SELECT id, step, state, planned, remaining, succeeded, failed, parent_id,
                   on_failure_message IS NOT NULL AS has_on_failure
              FROM fanin_batches WHERE id = :id FOR UPDATE
            """
        ),
        {"id": batch_id},
    ).first()
    if b is None:
        return None
    c = conn.execute(
        text(
            """
            WITH direct AS (
                SELECT count(*) AS created,
                       count(*) FILTER (WHERE state IN ('pending', 'started')) AS open,
                       count(*) FILTER (WHERE state = 'succeeded') AS succeeded,
                       count(*) FILTER (WHERE state NOT IN ('pending', 'started', 'succeeded')) AS failed
                  FROM fanin_children WHERE batch_id = :id
            ), leaves AS (
                -- a `fail_up` leaf has handed its failures to the root as they were counted, finished or not
                SELECT coalesce(sum(planned), 0) AS created,
                       count(*) FILTER (WHERE state IN ('open', 'running')) AS open,
                       coalesce(sum(succeeded) FILTER (WHERE state NOT IN ('open', 'running')), 0) AS succeeded,
                       coalesce(sum(failed) FILTER (WHERE state NOT IN ('open', 'running') OR fail_up), 0) AS failed
                  FROM fanin_batches WHERE parent_id = :id
            )
            SELECT direct.created + leaves.created AS created, direct.open + leaves.open AS open,
                   direct.succeeded + leaves.succeeded AS succeeded, direct.failed + leaves.failed AS failed
              FROM direct, leaves
            """
        ),
        {"id": batch_id},
    ).one()
    repair = Repair(batch_id)
    if c.created != b.planned:
        repair.problems.append(f"planned {b.planned} children but {c.created} rows exist")
    # An open batch (or leaf) holds its producer's token: one unit more than its unfinished children, and it
    # never finishes here (sealing it is its producer's, the relay's grace duty's or an operator's call).
    token = 1 if b.state == "open" else 0
    if b.state in ("open", "running") and c.created == b.planned:
        if (b.remaining, b.succeeded, b.failed) != (c.open + token, c.succeeded, c.failed):
            repair.problems.append(
                f"counter says remaining={b.remaining} succeeded={b.succeeded} failed={b.failed}, children say "
                f"remaining={c.open + token} succeeded={c.succeeded} failed={c.failed}"
            )
            repair.actions.append("counters recomputed from child rows")
        finish = c.open == 0 and not token
        if finish:
            if not repair.problems:
                repair.problems.append("all children are terminal but the batch was still running")
            repair.actions.append("batch finished")
        if repair.problems:
            # Leave one unit for fanin_settle to take, so that finishing goes the way a last report's would.
            conn.execute(
                text("UPDATE fanin_batches SET remaining = :r, succeeded = :s, failed = :f WHERE id = :id"),
                {"id": batch_id, "r": c.open + token + (1 if finish else 0), "s": c.succeeded, "f": c.failed},
            )
            if finish:
                conn.execute(text("SELECT * FROM fanin_settle(:id, 0, 0)"), {"id": batch_id})
    state_now = conn.execute(text("SELECT state FROM fanin_batches WHERE id = :id"), {"id": batch_id}).scalar_one()
    if b.parent_id is None and state_now in ("complete", "partial", "failed_threshold"):
        kind = "on_failure" if state_now == "failed_threshold" and b.has_on_failure else "then"
        if insert_successor(conn, batch_id, kind) is not None:
            if not any("successor" in a for a in repair.actions):
                repair.problems.append(f"batch is {state_now} but had no successor")
            repair.actions.append("successor and outbox row inserted")
        elif _restore_outbox_row(conn, batch_id, b.step):
            repair.problems.append("successor had no outbox row")
            repair.actions.append("outbox row inserted")
    return repair if repair.problems else None


def _restore_outbox_row(conn: Connection, batch_id: uuid.UUID, step: str) -> bool:
    row = conn.execute(
        text(
            """
            INSERT INTO fanin_outbox (batch_id, step)
            SELECT s.batch_id, s.step FROM fanin_successors s
             WHERE s.batch_id = :id AND s.step = :step AND s.state = 'pending'
               AND NOT EXISTS (SELECT 1 FROM fanin_outbox o WHERE o.batch_id = s.batch_id AND o.step = s.step)
            ON CONFLICT (batch_id, step) DO NOTHING
            RETURNING id
            """
        ),
        {"id": batch_id, "step": step},
    ).first()
    return row is not None


def abandon_after_threshold(conn: Connection, batch_id: uuid.UUID) -> list[str]:
    """Stop a batch that passed its failure threshold: its unfinished children (the root's own and every leaf's)
    become `abandoned`, and its counters reach zero. Returns their task ids, for the caller to revoke.

    Once a child is abandoned, its report (the worker's `revoked` as it discards the queued message, or the
    outcome of one that was already running) finds the row terminal and is recorded as late, never counted: the
    counters set here are final. Locks are taken as `expire_batch` takes them (child rows, then leaves, then the
    root: the order of every terminal report), and the counters are then set from the child rows, which every
    report that counted has committed by then (the child UPDATE waited for any in flight). Runs again harmlessly:
    a stopped batch has nothing unfinished.
    """
    abandoned = [
        r[0]
        for r in conn.execute(
            text(
                """
                UPDATE fanin_children
                   SET state = 'abandoned', finished_at = now(), exc_type = 'FailureThresholdPassed',
                       exc_message = 'the batch passed max_failures before this child finished'
                 WHERE batch_id IN (SELECT id FROM fanin_batches WHERE id = :id OR parent_id = :id)
                   AND state IN ('pending', 'started')
                   AND EXISTS (SELECT 1 FROM fanin_batches r WHERE r.id = :id AND r.state = 'failed_threshold')
             RETURNING task_id
                """
            ),
            {"id": batch_id},
        )
    ]
    conn.execute(
        text("SELECT id FROM fanin_batches WHERE parent_id = :id ORDER BY id FOR UPDATE"), {"id": batch_id}
    ).all()
    root = conn.execute(
        text("SELECT remaining FROM fanin_batches WHERE id = :id AND state = 'failed_threshold' FOR UPDATE"),
        {"id": batch_id},
    ).first()
    if root is None or (root.remaining == 0 and not abandoned):
        return abandoned
    conn.execute(
        text(
            """
            WITH leaves AS (
                UPDATE fanin_batches b
                   SET state = 'failed_threshold', remaining = 0, completed_at = now(),
                       succeeded = (SELECT count(*) FROM fanin_children c
                                     WHERE c.batch_id = b.id AND c.state = 'succeeded'),
                       failed = (SELECT count(*) FROM fanin_children c
                                  WHERE c.batch_id = b.id AND c.state NOT IN ('pending', 'started', 'succeeded'))
                 WHERE b.parent_id = :id AND b.state IN ('open', 'running')
            ), totals AS (
                SELECT count(*) FILTER (WHERE state = 'succeeded') AS s,
                       count(*) FILTER (WHERE state NOT IN ('pending', 'started', 'succeeded')) AS f
                  FROM fanin_children
                 WHERE batch_id IN (SELECT id FROM fanin_batches WHERE id = :id OR parent_id = :id)
            )
            UPDATE fanin_batches b SET remaining = 0, succeeded = totals.s, failed = totals.f
              FROM totals
             WHERE b.id = :id
            """
        ),
        {"id": batch_id},
    )
    return abandoned


# --- open batches whose producer is gone -----------------------------------------------------------------------

# Whether a live session holds a batch's publish lock: its producer (or a resumer) is still writing it.
_PUBLISH_LOCK_HELD = f"EXISTS (SELECT 1 FROM pg_locks l WHERE l.granted AND {PUBLISH_LOCK_OF})"


def lapsed_open_batches(conn: Connection, grace_seconds: float, limit: int = 100) -> list[uuid.UUID]:
    """Open root batches whose producer has been gone for longer than the grace.

    "Gone" is the signal the relay already trusts for publishing orphaned children: nobody holds the batch's
    publish lock (a session advisory lock, released by the producer once it sealed, or by Postgres when its
    connection dies). "For longer than the grace" is measured from `producer_seen_at`: every chunk a producer
    writes renews it, and this call first renews it for every open batch whose lock is held, so the grace runs
    from (about) the moment the producer let go, not from its last chunk.
    """
    params = {"grace": grace_seconds, "n": limit}
    conn.execute(
        text(
            "UPDATE fanin_batches b SET producer_seen_at = now() "
            f"WHERE b.state = 'open' AND b.parent_id IS NULL AND {_PUBLISH_LOCK_HELD}"
        ),
        params,
    )
    rows = conn.execute(
        text(
            "SELECT b.id FROM fanin_batches b "
            "WHERE b.state = 'open' AND b.parent_id IS NULL "
            "AND b.producer_seen_at < now() - make_interval(secs => :grace) "
            f"AND NOT {_PUBLISH_LOCK_HELD} ORDER BY b.producer_seen_at LIMIT :n"
        ),
        params,
    )
    return [r[0] for r in rows]


@dataclass(frozen=True)
class Sealed:
    batch_id: uuid.UUID
    planned: int  # the children it was sealed with
    successor_created: bool  # every child had already finished: its successor was created by the seal


def seal_open_batch(conn: Connection, batch_id: uuid.UUID, *, lapsed_grace: float | None = None) -> Sealed | None:
    """Seal an open root batch and its open leaves: it takes no more children and finishes when they have.

    The same transition as a producer's own seal (`fanin_seal`, leaves first), so a batch whose children have
    all finished gets its successor here, once. With `lapsed_grace`, only if its producer was still last seen
    longer ago than that (checked under the row lock, so a resumer that wrote a chunk since is not sealed under).
    Returns None if the batch is not an open root (or has not lapsed).
    """
    lock_membership(conn, batch_id)  # after a producer's chunk in flight: its new leaves are sealed too
    leaves = [
        r[0]
        for r in conn.execute(
            text("SELECT id FROM fanin_batches WHERE parent_id = :id AND state = 'open' ORDER BY id FOR UPDATE"),
            {"id": batch_id},
        )
    ]
    head = conn.execute(
        text(
            """
            SELECT planned FROM fanin_batches
             WHERE id = :id AND state = 'open' AND parent_id IS NULL
               AND (CAST(:grace AS double precision) IS NULL
                    OR producer_seen_at < now() - make_interval(secs => CAST(:grace AS double precision)))
               FOR UPDATE
            """
        ),
        {"id": batch_id, "grace": lapsed_grace},
    ).first()
    if head is None:
        return None
    for leaf_id in leaves:
        conn.execute(text("SELECT * FROM fanin_seal(:id)"), {"id": leaf_id}).all()
    row = conn.execute(text("SELECT * FROM fanin_seal(:id)"), {"id": batch_id}).one()
    return Sealed(batch_id, head.planned, bool(row.successor_created))


def batch_state(conn: Connection, batch_id: uuid.UUID) -> tuple[str, uuid.UUID | None] | None:
    """A batch's state and its root (for a leaf), to explain why it could not be sealed or cancelled."""
    row = conn.execute(text("SELECT state, parent_id FROM fanin_batches WHERE id = :id"), {"id": batch_id}).first()
    return None if row is None else (row.state, row.parent_id)
