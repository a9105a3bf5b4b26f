"""`rerun`: run a batch's failed or revoked successor again once its bug is fixed (`celery -A proj fanin rerun`,
`FanInResult.rerun()`): an operator's action, run with the relay's rights as `cancel` and `seal` are.

The successor runs from its stored signature with the outcome built from the batch's rows, as its first delivery
did, under a new task id: the store moves the successor back to `pending` with that id, records the rerun (who,
when, what it replaced) and makes its outbox row due, in one transaction (`fanin_rerun_successor`). The relay then
publishes it, and its run guard admits that message once, under the next run number; a copy of an earlier
delivery, which carries the old task id, is refused. A nested batch's successor reruns without changing the
outer batch: its outer child was counted when the successor first ended.
"""

from __future__ import annotations

import getpass
import socket
import uuid
from dataclasses import asdict, dataclass
from typing import Any

from celery.utils import uuid as new_task_id
from sqlalchemy.exc import SQLAlchemyError

from ..context import FanIn
from ..exceptions import BatchNotFound, FanInDatabaseError, SuccessorNotRerunnable, summarise
from ..protocol import SuccessorState
from ..store import queries, successors

RERUNNABLE = (SuccessorState.FAILED, SuccessorState.REVOKED)


@dataclass(frozen=True)
class Rerun:
    """A rerun that was started: its number (1 for a successor's first), its new task id, and what it replaced."""

    batch_id: str
    step: str
    rerun: int
    task_id: str
    previous_task_id: str
    previous_state: str
    requested_by: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def default_requester() -> str:
    """Who asks, as the record keeps it: the operating-system user and host."""
    try:
        user = getpass.getuser()
    except Exception:  # noqa: BLE001 - no user name (a container without one): the host still says something
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


def rerun(fanin: FanIn, batch_id: uuid.UUID, step: str | None = None, requested_by: str | None = None) -> Rerun:
    """Run `batch_id`'s failed or revoked successor again (the one named `step`, if the batch has several).

    Raises `BatchNotFound`, or `SuccessorNotRerunnable` for a successor that succeeded, has not finished, or does
    not exist yet. Returns at once; the rerun's handle is the batch's (`FanInResult.restore(batch_id, app)`),
    whose `get()` waits for the rerun.
    """
    bid = batch_id
    who = (requested_by or default_requester())[:200]
    task_id = new_task_id()
    try:
        with fanin.engine.begin() as conn:
            if queries.batch(conn, bid) is None:
                raise BatchNotFound(f"no batch {bid}")
            chosen = step if step is not None else _step(bid, successors.successor_states(conn, bid))
            number, state, previous, previous_state = successors.rerun(conn, bid, chosen, task_id, who)
    except SQLAlchemyError as exc:
        raise FanInDatabaseError(f"could not rerun the successor of batch {bid}: {summarise(exc)}") from exc
    if state is None:
        raise SuccessorNotRerunnable(f"batch {bid} has no successor {chosen!r} (yet)")
    if state == "superseded":
        raise SuccessorNotRerunnable(
            f"batch {bid} was retried since (fanin retry-failed): its last round's successor is the one to rerun "
            "(its id: celery -A proj fanin status)"
        )
    if number is None or previous is None:
        raise SuccessorNotRerunnable(
            f"the successor {chosen!r} of batch {bid} is {state}: only a failed or revoked successor runs again"
            + (" (retry-failed runs the failed children again, then the successor)" if state == "succeeded" else "")
        )
    return Rerun(str(bid), chosen, number, task_id, previous, previous_state, who)


def _step(bid: uuid.UUID, found: list[tuple[str, str]]) -> str:
    if not found:
        raise SuccessorNotRerunnable(f"batch {bid} has no successor yet: it has not finished")
    candidates = [step for step, state in found if state in RERUNNABLE]
    if len(candidates) > 1:
        raise SuccessorNotRerunnable(
            f"batch {bid} has {len(candidates)} failed or revoked successors ({', '.join(candidates)}): name one "
            "with step="
        )
    return candidates[0] if candidates else found[0][0]
