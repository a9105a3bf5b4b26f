"""The chaos suite's second copies of messages, and whether each was seen to take effect.

"publish children twice" and "publish successors again" count as applied only once a copy they made has done what
a second copy does: a child's second report recorded as late (`fanin_children.late_reports`), a successor's second
delivery refused by its run guard (`fanin_successors.duplicates`). Rows touched are not enough: copies sent to a
queue no worker reads, or outbox rows the relay never sent again, touch the same rows and prove nothing.

Each application records what its rows had counted when it made the copies; the effect is seen once one of them
counts more. Another fault may raise the same counter on the same row (a redelivery after a killed worker), but
on one of the few rows chosen at random among many, rarely. The copies of one application may also be lost (a
Redis restart loses every queued message): the run keeps a kind among the faults still to apply until one of its
applications was seen (`Ledger`), applying it again once the last one's copies had `patience` seconds to take
effect, and reports how many showed none.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from celery import Celery

from celery_fanin import codec
from celery_fanin.broker import publish
from celery_fanin.store.batches import Encoded

CHILDREN = "publish children twice"
SUCCESSORS = "publish successors again"
EFFECTS = {CHILDREN: "late report or refused copy", SUCCESSORS: "refused duplicate"}

# What each kind's rows count, keyed by task id (a child's, a successor's): the counter its copy must raise.
_COUNTS = {
    # A second copy's report recorded late; or, for a copy that never ran (it reached a worker past its
    # `expires`) while the other copy had started the child, its event counted in `duplicates` (issue 38, hole 3).
    CHILDREN: "SELECT task_id, late_reports + duplicates FROM fanin_children WHERE task_id = ANY(%s)",
    SUCCESSORS: "SELECT task_id, duplicates FROM fanin_successors WHERE task_id = ANY(%s)",
}


@dataclass(frozen=True)
class Copies:
    """One application of a duplicating fault: the task ids it copied, with what each had counted then."""

    fault: str
    before: Mapping[str, int]

    def seen(self, now: Mapping[str, int]) -> bool:
        """Whether a copy took effect: one of its rows counts more now than when it was copied."""
        return any(now.get(task_id, count) > count for task_id, count in self.before.items())


def unfinished_children(conn: psycopg.Connection[Any], batch_id: str) -> list[tuple[Any, ...]]:
    """`batch_id`'s unfinished children, started ones first, with what publishing them again needs, and what they
    count now (last): read before the copies go out, so a late report of theirs is the copy's.

    The fault copies children of a batch of its own, whose children run for seconds (`Chaos.duplicate_children`):
    a worker holds each started one, so its copy is a second delivery whose report comes late. The run's own
    batches are no use for this: their children take a second at most and are all finished within the first minute
    (a run of 2026-12-04 found no unfinished child in 41 draws after that); and a pending child's original may be
    lost to a kill or a restart, when the copy is its only delivery and leaves nothing to see."""
    return conn.execute(
        "SELECT batch_id, idx, task_id, message, content_type, content_encoding, late_reports + duplicates "
        "FROM fanin_children WHERE batch_id = %s AND state IN ('pending', 'started') ORDER BY state = 'started' DESC",
        (batch_id,),
    ).fetchall()


def publish_children_again(app: Celery, rows: Sequence[tuple[Any, ...]]) -> Copies:
    """Publish `rows` (from `unfinished_children`) a second time, as a broker redelivery would; the application."""
    with publish.producer(app) as prod:
        for batch_id, idx, task_id, body, ct, ce, _late in rows:
            sig = codec.decode_signature(app, Encoded(ct, ce, bytes(body)))
            publish.publish_children(app, prod, batch_id, [(idx, task_id, sig)])
    return children_copied(rows)


def children_copied(rows: Sequence[tuple[Any, ...]]) -> Copies:
    """The application that published `rows` (from `unfinished_children`) again: their late reports then."""
    return Copies(CHILDREN, {row[2]: row[-1] for row in rows})


def send_successors_again(conn: psycopg.Connection[Any], limit: int) -> Copies | None:
    """Put up to `limit` sent successors' outbox rows back in line (the relay publishes them again, running or
    finished); None if none was sent yet. Their duplicates are read by the same statement, so before the relay
    can claim the rows again."""
    rows = conn.execute(
        "WITH again AS (UPDATE fanin_outbox SET sent_at = NULL WHERE id IN (SELECT id FROM fanin_outbox"
        " WHERE sent_at IS NOT NULL ORDER BY random() LIMIT %s) RETURNING batch_id, step)"
        " SELECT s.task_id, s.duplicates FROM again JOIN fanin_successors s USING (batch_id, step)",
        (limit,),
    ).fetchall()
    return Copies(SUCCESSORS, dict(rows)) if rows else None


def counts(conn: psycopg.Connection[Any], copies: Sequence[Copies]) -> dict[str, dict[str, int]]:
    """What the copied rows count now, by fault and task id."""
    now: dict[str, dict[str, int]] = {}
    for fault, sql in _COUNTS.items():
        task_ids = sorted({t for c in copies if c.fault == fault for t in c.before})
        now[fault] = dict(conn.execute(sql, (task_ids,)).fetchall()) if task_ids else {}
    return now


def seen(copies: Sequence[Copies], now: Mapping[str, Mapping[str, int]]) -> Counter[str]:
    """How many applications of each fault had a copy take effect (every kind present, 0 if none)."""
    out = Counter(dict.fromkeys(EFFECTS, 0))
    for c in copies:
        if c.seen(now.get(c.fault, {})):
            out[c.fault] += 1
    return out


Counts = Mapping[str, Mapping[str, int]]


def read_counts(url: str, made: Sequence[Copies]) -> Counts | None:
    """`counts` on a connection of its own; None while the store cannot be reached (a fault restarting it)."""
    try:
        with psycopg.connect(url, autocommit=True, connect_timeout=5) as conn:
            return counts(conn, made)
    except psycopg.OperationalError:
        return None


class Ledger:
    """Every application of the duplicating faults, and which of them had a copy take effect so far."""

    def __init__(
        self,
        read: Callable[[Sequence[Copies]], Counts | None],
        patience: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._read = read
        self.patience = patience  # seconds a copy may take to be consumed (a queue's backlog, an outage)
        self._clock = clock
        self._made: list[tuple[float, Copies]] = []
        self._now: Counts = {}

    def add(self, copies: Copies) -> None:
        self._made.append((self._clock(), copies))

    def refresh(self) -> None:
        """Read what the copied rows count now (kept as it was if the store cannot be reached)."""
        now = self._read([c for _, c in self._made])
        if now is not None:
            self._now = now

    def applied(self) -> Counter[str]:
        return Counter(c.fault for _, c in self._made)

    def seen(self) -> Counter[str]:
        return seen([c for _, c in self._made], self._now)

    def waiting(self, fault: str) -> bool:
        """Whether copies of `fault` not seen yet are younger than `patience`: they may still take effect."""
        since = self._clock() - self.patience
        return any(c.fault == fault and at > since and not c.seen(self._now.get(fault, {})) for at, c in self._made)
