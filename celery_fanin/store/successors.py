"""A successor's run, from its first delivery to a final state: the transactions of its run guard.

A successor is published at least once (the relay may publish it again, a broker may redeliver it); these
statements make its body run at most once at a time and never after a final state. A run is a lease on the
successor's row (`lease_until`, renewed by the worker's heartbeat while the body runs), numbered by `runs`:
every write a run makes names its run number, so a run whose lease lapsed and was taken over can no longer
change the row (fencing). Nothing here depends on a database session staying up.

States (migration 0010): pending -> sent -> running -> retrying | requeued | replaced -> running -> ... ->
succeeded | failed | revoked | ignored. See docs/concepts/terminal-outcomes.md for how each Celery ending maps.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import Connection, text

from .batches import Encoded, record_terminal

# A run ended for good: nothing runs the body again.
FINAL_STATES = frozenset({"succeeded", "failed", "revoked", "ignored"})
# A run ended and handed the successor on: the next delivery (Celery's retry, the redelivered message, the
# replacement task) may start a run; the relay republishes it if that delivery never comes.
HANDED_OVER_STATES = frozenset({"retrying", "requeued", "replaced"})
# What a nested batch's outer child is counted as when its successor ends in `ignored` (raise Ignore()): the
# body ended without an error and without a value.
_OUTER_CHILD_STATE = {"ignored": "succeeded"}

# Whether a running successor's run is dead: its lease lapsed more than `grace` seconds ago. Both the guard and
# the stall detector use it, so that a delivery is admitted exactly when the relay would republish.
_DEAD_RUN = "coalesce(s.lease_until, s.state_at) < now() - make_interval(secs => CAST(:grace AS double precision))"


@dataclass(frozen=True)
class Run:
    """One admitted run of a successor: the fencing token every later write of the run names."""

    batch_id: uuid.UUID
    step: str
    number: int
    # The Celery retry count the run is at (the delivery's own `retries` may be lower: a republished copy).
    attempt: int


@dataclass(frozen=True)
class Refusal:
    """Why a delivery was not admitted: the successor's state and, while it runs, who holds its run."""

    state: str | None  # None: no such successor (or not this task id)
    owner: str | None


def claim_run(
    conn: Connection,
    batch_id: uuid.UUID,
    step: str,
    task_id: str,
    retries: int,
    *,
    lease: float,
    grace: float,
    owner: str,
    dead_owner: str | None = None,
) -> Run | Refusal:
    """Admit one delivery of a successor, or say why not: one statement.

    Admitted: a successor never started, one handed over (retrying, requeued, replaced), or one whose run is dead:
    its lease lapsed over `grace` seconds ago (its worker died or lost the database for that long), or the caller
    saw that the process holding it, `dead_owner`, is gone. Refused: a successor with a live run, a final one, a
    delivery whose task id is not the successor's, or no such successor. READ COMMITTED makes two deliveries
    racing for one row wait for each other and re-check: one wins.
    """
    row = conn.execute(
        text(
            f"""
            WITH run AS (
                UPDATE fanin_successors s
                   SET state = 'running', runs = s.runs + 1, attempt = greatest(s.attempt, :retries),
                       lease_until = now() + make_interval(secs => CAST(:lease AS double precision)),
                       run_owner = :owner, started_at = coalesce(s.started_at, now()), state_at = now()
                 WHERE s.batch_id = :id AND s.step = :step AND s.task_id = :task_id
                   AND (s.state IN ('pending', 'sent', 'retrying', 'requeued', 'replaced')
                        OR (s.state = 'running' AND ({_DEAD_RUN} OR s.run_owner = :dead_owner)))
             RETURNING s.runs, s.attempt
            )
            SELECT (SELECT runs FROM run), (SELECT attempt FROM run), s.state, s.run_owner
              FROM (SELECT 1) AS one
              LEFT JOIN fanin_successors s ON s.batch_id = :id AND s.step = :step AND s.task_id = :task_id
            """
        ),
        {
            "id": batch_id,
            "step": step,
            "task_id": task_id,
            "retries": retries,
            "lease": lease,
            "grace": grace,
            "owner": owner,
            "dead_owner": dead_owner,
        },
    ).one()
    if row[0] is None:
        return Refusal(row[2], row[3] if row[2] == "running" else None)
    return Run(batch_id, step, int(row[0]), int(row[1]))


def count_duplicate(conn: Connection, batch_id: uuid.UUID, step: str) -> None:
    """Count a refused delivery (shown by `status` as the successor's duplicates)."""
    conn.execute(
        text("UPDATE fanin_successors SET duplicates = duplicates + 1 WHERE batch_id = :id AND step = :step"),
        {"id": batch_id, "step": step},
    )


def hand_over(conn: Connection, run: Run, state: str, due_at: datetime | None = None) -> bool:
    """End `run` without finishing the successor: `retrying` (due at `due_at`), `requeued` or `replaced`.

    Written before the next delivery can exist (the retry and the replacement are published after this commits),
    so that delivery finds the successor free. False if the run was fenced off (its lease was taken over).
    """
    if state not in HANDED_OVER_STATES:
        raise ValueError(f"not a hand-over state: {state!r}")
    found = conn.execute(
        text(
            """
            UPDATE fanin_successors
               SET state = :state, lease_until = :due, state_at = now(),
                   attempt = CASE :state WHEN 'retrying' THEN attempt + 1 WHEN 'replaced' THEN 0 ELSE attempt END
             WHERE batch_id = :id AND step = :step AND runs = :run AND state = 'running'
         RETURNING 1
            """
        ),
        {"id": run.batch_id, "step": run.step, "run": run.number, "state": state, "due": due_at},
    ).first()
    return found is not None


def take_back(conn: Connection, run: Run, lease: float) -> bool:
    """Undo `hand_over` when the retry or replacement was never published (Celery raised instead)."""
    found = conn.execute(
        text(
            """
            UPDATE fanin_successors
               SET state = 'running', lease_until = now() + make_interval(secs => CAST(:lease AS double precision)),
                   state_at = now(),
                   attempt = CASE state WHEN 'retrying' THEN greatest(attempt - 1, 0) ELSE attempt END
             WHERE batch_id = :id AND step = :step AND runs = :run AND state IN ('retrying', 'replaced')
         RETURNING 1
            """
        ),
        {"id": run.batch_id, "step": run.step, "run": run.number, "lease": lease},
    ).first()
    return found is not None


def renew_leases(conn: Connection, runs: Sequence[Run], lease: float) -> set[tuple[uuid.UUID, str, int]]:
    """Extend the leases of live runs, in one statement; returns the runs still held (the others were fenced)."""
    if not runs:
        return set()
    rows = conn.execute(
        text(
            """
            UPDATE fanin_successors s
               SET lease_until = now() + make_interval(secs => CAST(:lease AS double precision))
              FROM unnest(CAST(:ids AS uuid[]), CAST(:steps AS text[]), CAST(:runs AS integer[])) AS l(id, step, run)
             WHERE s.batch_id = l.id AND s.step = l.step AND s.runs = l.run AND s.state = 'running'
         RETURNING s.batch_id, s.step, s.runs
            """
        ),
        {
            "ids": [r.batch_id for r in runs],
            "steps": [r.step for r in runs],
            "runs": [r.number for r in runs],
            "lease": lease,
        },
    )
    return {(r[0], r[1], int(r[2])) for r in rows}


def record_state(
    conn: Connection,
    batch_id: uuid.UUID,
    step: str,
    state: str,
    *,
    run: int | None = None,
    result: Encoded | None = None,
    exc_type: str | None = None,
    exc_message: str | None = None,
) -> bool:
    """Move the successor to a final state; a final state is never left again. True if this call moved it.

    `run` fences the write to that run (the pool process reporting its own body's end). Without it (the worker's
    main process: a hard time limit, a lost pool process, a revoke, an undecodable or unknown message) any
    successor not yet final is moved. A nested batch (one that stands for a child of an outer batch) reports that
    child in the same transaction: its return value is the child's result, its failure the child's.
    """
    if state not in FINAL_STATES:
        raise ValueError(f"not a final successor state: {state!r}")
    row = conn.execute(
        text(
            """
            UPDATE fanin_successors s
               SET state = :state, exc_type = :exc_type, exc_message = :exc_message, state_at = now(),
                   result = :result, result_content_type = :rct, result_content_encoding = :rce,
                   finished_at = now(), lease_until = NULL
              FROM fanin_batches b
             WHERE s.batch_id = :id AND s.step = :step AND b.id = s.batch_id
               AND s.state NOT IN ('succeeded', 'failed', 'revoked', 'ignored')
               AND (CAST(:run AS integer) IS NULL OR s.runs = CAST(:run AS integer))
         RETURNING b.parent_task_id
            """
        ),
        {
            "id": batch_id,
            "step": step,
            "state": state,
            "run": run,
            "exc_type": exc_type,
            "exc_message": exc_message,
            "result": result.body if result else None,
            "rct": result.content_type if result else None,
            "rce": result.content_encoding if result else None,
        },
    ).first()
    if row is None:
        return False
    if row.parent_task_id:
        record_terminal(
            conn,
            row.parent_task_id,
            _OUTER_CHILD_STATE.get(state, state),
            result=result,
            exc_type=exc_type,
            exc_message=exc_message,
        )
    return True


def stalled(conn: Connection, timeout: float, grace: float, limit: int = 100) -> list[tuple[uuid.UUID, str]]:
    """Successors that should have run by now.

    Published (or handed over) and not started `timeout` seconds after they were due: the message was lost (a
    broker restart, an early-acked message requeued by Reject, a retry whose worker died before publishing it).
    Running with a dead run (see `claim_run`): the worker died mid-body and nothing redelivered it.
    """
    rows = conn.execute(
        text(
            f"""
            SELECT s.batch_id, s.step FROM fanin_successors s
             WHERE (s.state IN ('sent', 'retrying', 'requeued', 'replaced')
                    AND coalesce(s.lease_until, s.state_at)
                        < now() - make_interval(secs => CAST(:timeout AS double precision)))
                OR (s.state = 'running' AND {_DEAD_RUN})
             LIMIT :n
            """
        ),
        {"timeout": timeout, "grace": grace, "n": limit},
    )
    return [(r[0], r[1]) for r in rows]


def republish(conn: Connection, batch_id: uuid.UUID, step: str, timeout: float, grace: float) -> bool:
    """Put a stalled successor's outbox row back in line (same task id; the guard admits one delivery of it).

    A dead run's successor goes back to `sent`, so the copies a reaper round publishes are admitted once and a
    live run that returns (its heartbeat comes back) finds itself fenced off rather than beside a second run. The
    condition is checked again here, against the row as it is now.
    """
    row = conn.execute(
        text(
            f"""
            WITH s AS (
                UPDATE fanin_successors s
                   SET state = CASE WHEN s.state = 'running' THEN 'sent' ELSE s.state END,
                       lease_until = NULL, state_at = now()
                 WHERE s.batch_id = :id AND s.step = :step
                   AND ((s.state IN ('sent', 'retrying', 'requeued', 'replaced')
                         AND coalesce(s.lease_until, s.state_at)
                             < now() - make_interval(secs => CAST(:timeout AS double precision)))
                        OR (s.state = 'running' AND {_DEAD_RUN}))
             RETURNING s.batch_id, s.step
            )
            UPDATE fanin_outbox o SET sent_at = NULL, available_at = now(), last_error = 'republished: stalled'
              FROM s WHERE o.batch_id = s.batch_id AND o.step = s.step
         RETURNING o.id
            """
        ),
        {"id": batch_id, "step": step, "timeout": timeout, "grace": grace},
    ).first()
    if row is not None:
        conn.execute(text("SELECT pg_notify('fanin_outbox', :id)"), {"id": str(row[0])})
    return row is not None
