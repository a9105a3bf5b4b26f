"""Retry rounds: the failed children of a finished batch, then its successor, run again as an ordinary batch
(docs/concepts/rounds.md).
"""

from __future__ import annotations

import uuid
from dataclasses import asdict, dataclass, replace
from typing import Any

from sqlalchemy.exc import SQLAlchemyError

from ..codec import decode_signature
from ..context import FanIn
from ..exceptions import BatchNotFinished, BatchNotFound, FanInDatabaseError, InvalidFanIn, summarise
from ..producer.group import FanInGroup
from ..producer.result import parse_batch_id
from ..protocol import BATCH_ACTIVE, BATCH_ENDED_WITHOUT_SUCCESSOR, SUCCESSOR_FINAL
from ..store import admin, batches, queries


@dataclass(frozen=True)
class RetryRound:
    """What `retry_failed` did."""

    original: str  # the batch of round 1
    retried: str  # the round whose failed children were published again
    retried_round: int
    batch_id: str | None  # the new round's batch (None: nothing to retry)
    round: int | None
    children: int  # failed children published again
    unfinished: int  # children of the retried round still pending or started (a failed_threshold batch): not retried
    existing: bool = False  # the round already existed (another retry created it first)
    nested_in: str | None = None  # a nested batch: the outer batch, which this round does not report to

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def retry_failed(fanin: FanIn, batch_id: str | uuid.UUID) -> RetryRound:
    """Start the next round of `batch_id` (any round's id, or round 1's) with the failed children of its latest
    round. Raises `BatchNotFinished` while that round, or its successor, has not finished."""
    bid = parse_batch_id(batch_id)
    app = fanin.app
    try:
        with fanin.engine.connect() as conn:
            given = admin.node(conn, bid)
            if given is None:
                raise BatchNotFound(f"no fan-in batch with id {bid}")
            if given.parent_id is not None:
                raise InvalidFanIn(f"batch {bid} is a leaf counter of batch {given.parent_id}: retry that one")
            original = given.retry_of or given.id
            latest = admin.node(conn, admin.latest_round(conn, original) or given.id)
            assert latest is not None
            _check_finished(latest)
            failed = queries.failures(conn, latest.id)
            pending, started = admin.open_children(conn, latest.id)
            row = queries.batch(conn, latest.id)
            assert row is not None
            policy = admin.recovery_policy(conn, latest.id)
            next_round = admin.highest_round(conn, original) + 1
            key = f"retry:{original}:{next_round}"
            taken = batches.find_by_key(conn, app.main or "", key)
    except SQLAlchemyError as exc:
        raise FanInDatabaseError(f"could not read batch {bid}: {summarise(exc)}") from exc
    result = RetryRound(
        original=str(original),
        retried=str(latest.id),
        retried_round=latest.round,
        batch_id=None,
        round=None,
        children=len(failed),
        unfinished=pending + started,
        nested_in=None,
    )
    if latest.parent_task_id:
        with fanin.engine.connect() as conn:
            found = admin.child_location(conn, latest.parent_task_id)
        result = replace(result, nested_in=str(found[0]) if found else latest.parent_task_id)
    if not failed:
        return result
    children = [_fresh(decode_signature(app, f.message)) for f in failed]
    then = _fresh(decode_signature(app, row.successor_message))
    group = FanInGroup(
        children,
        then=then,
        step=row.step,
        app=app,
        key=key,
        child_timeout=policy.child_timeout_seconds,
        on_lost=policy.on_lost,
        max_redrives=policy.max_redrives,
    ).evolve(round=next_round, retry_of=original)
    handle = group.apply_async()
    return replace(result, batch_id=handle.batch_id, round=next_round, existing=taken is not None)


def _check_finished(n: admin.Node) -> None:
    what = f"batch {n.id}" + (f" (round {n.round})" if n.round > 1 else "")
    if n.state in BATCH_ACTIVE:
        raise BatchNotFinished(
            f"{what} is still {n.state} ({n.remaining} of {n.planned} children unfinished): retry-failed needs a "
            f"finished batch; wait for it (`fanin watch {n.id}`)"
        )
    if n.successor_state is None and n.state not in BATCH_ENDED_WITHOUT_SUCCESSOR:
        raise BatchNotFinished(f"{what} is {n.state} but its successor was not created yet: wait for it")
    if n.successor_state is not None and n.successor_state not in SUCCESSOR_FINAL:
        raise BatchNotFinished(
            f"{what} is {n.state} but its successor is still {n.successor_state}: retry-failed runs it again, so "
            "it waits until this run has finished"
        )


def _fresh(sig: Any) -> Any:
    """The same signature under a new task id: a retried child or successor is a new task."""
    sig.options.pop("task_id", None)
    return sig
