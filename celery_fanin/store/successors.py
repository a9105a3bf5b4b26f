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
from typing import Any

from sqlalchemy import Connection

from ..protocol import SUCCESSOR_FINAL, SuccessorState
from .batches import Encoded
from .statements import Runner, q

# A run ended for good: nothing runs the body again.
FINAL_STATES = SUCCESSOR_FINAL
# A run ended and handed the successor on: the next delivery (Celery's retry, the redelivered message, the
# replacement task) may start a run; the relay republishes it if that delivery never comes.
HANDED_OVER_STATES = frozenset({"retrying", "requeued", "replaced"})


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


# A run's statements (claim, count a refused copy, hand over, take back, renew, finish, end a replacement, keep the
# traceback) are run by a `Runner`: a worker sends them on its report connection (`store.reports.ReportConnection`),
# one round trip each without a pool checkout and its pre-ping.


def claim_params(
    batch_id: uuid.UUID,
    step: str,
    task_id: str,
    retries: int,
    *,
    lease: float,
    grace: float,
    owner: str,
    owner_key: str | None = None,
    carrier: str | None = None,
    dead_owner: str | None = None,
) -> dict[str, object]:
    """The parameters of `claim_run`'s statement."""
    return {
        "id": batch_id,
        "step": step,
        "task_id": task_id,
        "retries": retries,
        "lease": lease,
        "grace": grace,
        "owner": owner,
        "owner_key": owner_key,
        "carrier": carrier,
        "dead_owner": dead_owner,
    }


def claimed(batch_id: uuid.UUID, step: str, row: Sequence[Any]) -> Run | Refusal:
    """The run `claim_run`'s statement admitted (its row: run, attempt, state, run_owner), or why it refused."""
    if row[0] is None:
        return Refusal(row[2], row[3] if row[2] == SuccessorState.RUNNING else None)
    return Run(batch_id, step, int(row[0]), int(row[1]))


def claim_run(
    runner: Runner,
    batch_id: uuid.UUID,
    step: str,
    task_id: str,
    retries: int,
    *,
    lease: float,
    grace: float,
    owner: str,
    owner_key: str | None = None,
    carrier: str | None = None,
    dead_owner: str | None = None,
) -> Run | Refusal:
    """Admit one delivery of a successor, or say why not: one statement.

    Admitted: a successor never started, one handed over (retrying, requeued, replaced), or one whose run is dead:
    its lease lapsed over `grace` seconds ago (its worker died or lost the database for that long), or the caller
    holds the key (`owner_key`) of the worker whose run it was and saw that its process, `dead_owner`, is gone.
    Once the successor was replaced, only the replacement's `carrier` is admitted. Refused: a successor with a live
    run, a final one, a copy of a replaced message, a delivery whose task id is not the successor's, or no such
    successor; the holder of a live run is named only to a caller with its worker's key. READ COMMITTED makes two
    deliveries racing for one row wait for each other and re-check: one wins.
    """
    params = claim_params(
        batch_id,
        step,
        task_id,
        retries,
        lease=lease,
        grace=grace,
        owner=owner,
        owner_key=owner_key,
        carrier=carrier,
        dead_owner=dead_owner,
    )
    return claimed(batch_id, step, runner.one(q("claim_run"), params))


def count_duplicate(runner: Runner, batch_id: uuid.UUID, step: str) -> None:
    """Count a refused delivery (shown by `status` as the successor's duplicates)."""
    runner.one(q("count_duplicate"), {"id": batch_id, "step": step})


def note_traceback(runner: Runner, batch_id: uuid.UUID, step: str, traceback: str) -> bool:
    """Keep a failed successor's traceback (`fanin_note_successor_traceback`: once, bounded)."""
    return bool(runner.one(q("note_successor_traceback"), {"id": batch_id, "step": step, "traceback": traceback})[0])


def hand_over(runner: Runner, run: Run, state: str, due_at: datetime | None = None, carrier: str | None = None) -> bool:
    """End `run` without finishing the successor: `retrying` (due at `due_at`), `requeued` or `replaced` (by the
    replacement whose `carrier` token is the only delivery admitted from then on).

    Written before the next delivery can exist (the retry and the replacement are published after this commits),
    so that delivery finds the successor free. False if the run was fenced off (its lease was taken over).
    """
    if state not in HANDED_OVER_STATES:
        raise ValueError(f"not a hand-over state: {state!r}")
    found = runner.one(
        q("hand_over"),
        {"id": run.batch_id, "step": run.step, "run": run.number, "state": state, "due": due_at, "carrier": carrier},
    )[0]
    return bool(found)


def take_back(runner: Runner, run: Run, lease: float, carrier: str | None = None) -> bool:
    """Undo `hand_over` when the retry or replacement was never published (Celery raised instead); `carrier`: the
    token the run's own delivery came with, admitted again."""
    found = runner.one(
        q("take_back"), {"id": run.batch_id, "step": run.step, "run": run.number, "lease": lease, "carrier": carrier}
    )[0]
    return bool(found)


def renew_leases(runner: Runner, runs: Sequence[Run], lease: float) -> set[tuple[uuid.UUID, str, int]]:
    """Extend the leases of live runs, in one statement; returns the runs still held (the others were fenced)."""
    if not runs:
        return set()
    rows = runner.all(
        q("renew_leases"),
        {
            "ids": [r.batch_id for r in runs],
            "steps": [r.step for r in runs],
            "runs": [r.number for r in runs],
            "lease": lease,
        },
    )
    return {(r[0], r[1], int(r[2])) for r in rows}


def record_state(
    runner: Runner,
    batch_id: uuid.UUID,
    step: str,
    state: str,
    *,
    run: int | None = None,
    task_id: str | None = None,
    result: Encoded | None = None,
    exc_type: str | None = None,
    exc_message: str | None = None,
    carrier: str | None = None,
    retries: int | None = None,
    ran_in: str | None = None,
    owner_key: str | None = None,
) -> bool:
    """Move the successor to a final state; a final state is never left again. True if this call moved it.

    `run` fences the write to that run (the pool process reporting its own body's end). Without it, the worker's
    main process speaks of one copy of the message, whose `task_id` must be the successor's
    (`fanin_finish_successor_v2`): a copy that ran in the pool process `ran_in` (``host:machine:pid:``, a hard time
    limit, a lost or terminated process) ends only that process's run, and only with its worker's `owner_key`; a
    copy that never ran (expired, revoked unstarted, unknown, undecodable) ends only a successor no run holds, that
    it could still have started (its `carrier`, its `retries`). An event that moves nothing is counted as a
    duplicate. A nested batch (one that stands for a child of an outer batch) reports that child in the same
    transaction: its return value is the child's result, its failure the child's.
    """
    if state not in FINAL_STATES:
        raise ValueError(f"not a final successor state: {state!r}")
    found = runner.one(
        q("record_state"),
        {
            "id": batch_id,
            "step": step,
            "task_id": task_id,
            "state": state,
            "run": run,
            "exc_type": exc_type,
            "exc_message": exc_message,
            "result": result.body if result else None,
            "rct": result.content_type if result else None,
            "rce": result.content_encoding if result else None,
            "carrier": carrier,
            "retries": retries,
            "ran_in": ran_in,
            "owner_key": owner_key,
        },
    )[0]
    return bool(found)


def end_replacement(
    runner: Runner,
    batch_id: uuid.UUID,
    step: str,
    task_id: str,
    carrier: str,
    state: str,
    exc_type: str | None = None,
    exc_message: str | None = None,
) -> bool:
    """A task of the successor's replacement other than its carrier (a part: a chain's earlier task, a chord's
    header task) failed or was revoked, so the carrier will not be published: end the successor with it, only while
    it is `replaced` with this `carrier` (never a run the carrier holds). True if this call ended it; a nested
    batch's outer child ends in the same transaction (`fanin_end_replacement`)."""
    found = runner.one(
        q("end_replacement"),
        {
            "id": batch_id,
            "step": step,
            "task_id": task_id,
            "carrier": carrier,
            "state": state,
            "exc_type": exc_type,
            "exc_message": exc_message,
        },
    )[0]
    return bool(found)


def stalled(conn: Connection, timeout: float, grace: float, limit: int = 100) -> list[tuple[uuid.UUID, str]]:
    """Successors that should have run by now.

    Published (or handed over) and not started `timeout` seconds after they were due: the message was lost (a
    broker restart, an early-acked message requeued by Reject, a retry whose worker died before publishing it).
    Running with a dead run (see `claim_run`): the worker died mid-body and nothing redelivered it. Never a
    replaced successor: a copy of its message would only be refused (docs/concepts/exactly-once.md).
    """
    rows = conn.execute(
        q("stalled").text,
        {"timeout": timeout, "grace": grace, "n": limit},
    )
    return [(r[0], r[1]) for r in rows]


def lost_replacements(conn: Connection, timeout: float, limit: int = 100) -> list[tuple[uuid.UUID, str]]:
    """Replaced successors (batch id, step) whose replacement's carrier never came, or whose carrier's run
    died, `timeout` seconds ago: the user's replacement canvas was lost (an early-acked message on a killed worker,
    a broker that lost its queue). A live carrier run renews its lease, so it is never among them."""
    rows = conn.execute(q("lost_replacements").text, {"timeout": timeout, "n": limit})
    return [(r[0], r[1]) for r in rows]


def fail_lost_replacement(conn: Connection, batch_id: uuid.UUID, step: str, timeout: float, message: str) -> bool:
    """Record a lost replacement's successor as failed (`ReplacementLost`), checked again against the row as it is
    now; a nested batch's outer child is counted failed with it. Its carrier, if it ever comes, is refused."""
    found = conn.execute(
        q("fail_lost_replacement").text, {"id": batch_id, "step": step, "timeout": timeout, "message": message}
    ).scalar_one()
    return bool(found)


def republish(conn: Connection, batch_id: uuid.UUID, step: str, timeout: float, grace: float) -> bool:
    """Put a stalled successor's outbox row back in line (same task id; the guard admits one delivery of it).

    A dead run's successor goes back to `sent`, so the copies a reaper round publishes are admitted once and a
    live run that returns (its heartbeat comes back) finds itself fenced off rather than beside a second run. The
    condition is checked again here, against the row as it is now.
    """
    found = conn.execute(
        q("republish").text,
        {"id": batch_id, "step": step, "timeout": timeout, "grace": grace},
    ).scalar_one()
    return bool(found)


@dataclass(frozen=True)
class Rerun:
    """One rerun of a successor: its number (1 for the first), the task id it runs under, and what it replaced."""

    rerun: int
    task_id: str
    previous_task_id: str
    previous_state: str
    previous_exc_type: str | None
    previous_exc_message: str | None
    previous_runs: int
    requested_by: str
    requested_at: datetime


def rerun(conn: Connection, batch_id: uuid.UUID, step: str, task_id: str, requested_by: str) -> tuple[Any, ...]:
    """Run a failed or revoked successor again under `task_id` (the run guard then admits only that id), recorded
    and its outbox row due again, in one statement: (rerun number, state, previous task id, previous state);
    all None for no such successor, a None rerun number for one that is not failed or revoked (its state)."""
    row = conn.execute(
        q("rerun").text, {"id": batch_id, "step": step, "task_id": task_id, "by": requested_by}
    ).one_or_none()
    if row is None:
        return None, None, None, None
    return row.rerun, row.state, row.previous_task_id, row.previous_state


def reruns(conn: Connection, batch_id: uuid.UUID, step: str) -> list[Rerun]:
    rows = conn.execute(q("reruns").text, {"id": batch_id, "step": step})
    return [Rerun(**r._mapping) for r in rows]


def successor_states(conn: Connection, batch_id: uuid.UUID) -> list[tuple[str, str]]:
    """A batch's successors as (step, state), oldest first."""
    return [(r.step, r.state) for r in conn.execute(q("successor_states").text, {"id": batch_id})]
