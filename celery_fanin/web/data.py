"""What the dashboard's pages show, read in one connection per page.

The store's own reads are used where they fit (`store.admin` for a batch's leaves, descendants, rounds and open
children, `store.queries` for its successor, `store.sagas` for a saga's rows, `outcome.failure_entry` for a failed
child's arguments); the rest are the named statements of `store/sql/dashboard.sql`. Nothing here writes.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, is_dataclass
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from typing import Any

from sqlalchemy import Connection, Engine, text

from ..outcome import failure_entry
from ..protocol import BATCH_ACTIVE, BATCH_ENDED_WITHOUT_SUCCESSOR, BatchState, SagaState
from ..store import admin, queries, successors
from ..store import sagas as saga_store
from ..store.batches import Encoded
from .sql import sql

BATCH_STATES = tuple(s.value for s in BatchState)
SAGA_STATES = tuple(s.value for s in SagaState)
FINAL_SAGA_STATES = frozenset({SagaState.SUCCEEDED.value, SagaState.COMPENSATED.value})
FAILURES_SHOWN = 50
LEAVES_SHOWN = 100
DESCENDANTS_SHOWN = 50
# The starts chart reads a sample of at most SAMPLE of a batch's children, each by one look-up in the unique
# index on (batch_id, idx): spread over the root's own children and each leaf's, in proportion to their sizes.
SAMPLE = 1000
# Above this many unfinished children the page does not tell pending from started: counting them reads every
# unfinished child's row. The counters still give how many are unfinished.
OPEN_COUNT_LIMIT = 20_000
CHART_BUCKETS = 40
_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


def _q(name: str) -> Any:
    return text(sql("dashboard", name))


# --- filters and cursors --------------------------------------------------------------------------------------


class BadRequest(ValueError):
    """A filter or cursor in the URL that the dashboard cannot use (shown as a 400 page)."""


@dataclass(frozen=True)
class Cursor:
    """A keyset position: the page holds the rows older than (created_at, id), newest first."""

    created_at: datetime
    id: uuid.UUID

    def encode(self) -> str:
        return f"{(self.created_at - _EPOCH) // timedelta(microseconds=1)}_{self.id.hex}"

    @classmethod
    def decode(cls, value: str | None) -> Cursor | None:
        if not value:
            return None
        micros, sep, hex_id = value.partition("_")
        try:
            if not sep:
                raise ValueError(value)
            return cls(_EPOCH + timedelta(microseconds=int(micros)), uuid.UUID(hex=hex_id))
        except (ValueError, OverflowError):
            raise BadRequest(f"{value!r} is not a page cursor") from None


def _text_filter(params: Mapping[str, str], name: str) -> str | None:
    value = params.get(name, "").strip()
    if len(value) > 500:
        raise BadRequest(f"the {name} filter is longer than 500 characters")
    return value or None


def _prefix_end(prefix: str) -> str | None:
    """The smallest string above every string that starts with `prefix`, in code point order (the "C"
    collation): the prefix with its last character raised by one. None if no string is above them all."""
    chars = list(prefix)
    while chars:
        last = ord(chars.pop()) + 1
        if 0xD800 <= last <= 0xDFFF:  # surrogates are not characters PostgreSQL stores
            last = 0xE000
        if last <= 0x10FFFF:
            return "".join(chars) + chr(last)
    return None


@dataclass(frozen=True)
class BatchFilters:
    state: str | None = None
    step: str | None = None
    app: str | None = None
    key: str | None = None  # a prefix of the batch's idempotency key

    @classmethod
    def from_query(cls, params: Mapping[str, str]) -> BatchFilters:
        state = _text_filter(params, "state")
        if state is not None and state not in BATCH_STATES:
            raise BadRequest(f"unknown batch state {state!r} (one of {', '.join(BATCH_STATES)})")
        return cls(state, _text_filter(params, "step"), _text_filter(params, "app"), _text_filter(params, "key"))

    def query(self) -> dict[str, str]:
        """The filters as URL query parameters (the unset ones left out)."""
        pairs = {"state": self.state, "step": self.step, "app": self.app, "key": self.key}
        return {k: v for k, v in pairs.items() if v is not None}

    def params(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "step": self.step,
            "app": self.app,
            "key_from": self.key,
            "key_to": _prefix_end(self.key) if self.key else None,
        }


def _cursor_params(before: Cursor | None) -> dict[str, Any]:
    return {"before_at": before.created_at if before else None, "before_id": before.id if before else None}


# --- the batches page -----------------------------------------------------------------------------------------


def throughput(done: int, created_at: datetime, until: datetime) -> float | None:
    """Children finished per second since the batch was created (until it completed, or now)."""
    seconds = (until - created_at).total_seconds()
    return done / seconds if done and seconds > 0.001 else None


@dataclass(frozen=True)
class ListedBatch:
    id: uuid.UUID
    app: str | None
    key: str | None
    step: str
    state: str
    planned: int
    succeeded: int
    failed: int
    round: int
    created_at: datetime
    completed_at: datetime | None
    successor_state: str | None
    age_s: float
    rate: float | None

    @property
    def done(self) -> int:
        return self.succeeded + self.failed


@dataclass(frozen=True)
class BatchesPage:
    rows: list[ListedBatch]
    next: Cursor | None  # the cursor of the page after this one, if there is one
    active: dict[str, int]  # open and running root batches, whatever the filters
    now: datetime


def batches_page(conn: Connection, filters: BatchFilters, before: Cursor | None, limit: int) -> BatchesPage:
    rows = conn.execute(_q("batches_page"), {**filters.params(), **_cursor_params(before), "n": limit + 1}).all()
    active = {r.state: int(r.n) for r in conn.execute(_q("active_counts"))}
    now = rows[0].now if rows else admin.db_now(conn)
    listed = [
        ListedBatch(
            r.id,
            r.app_name,
            r.key,
            r.step,
            r.state,
            int(r.planned),
            int(r.succeeded),
            int(r.failed),
            int(r.round),
            r.created_at,
            r.completed_at,
            r.successor_state,
            (now - r.created_at).total_seconds(),
            throughput(int(r.succeeded) + int(r.failed), r.created_at, r.completed_at or now),
        )
        for r in rows[:limit]
    ]
    more = len(rows) > limit
    return BatchesPage(listed, Cursor(listed[-1].created_at, listed[-1].id) if more else None, active, now)


# --- the relay and the outbox ---------------------------------------------------------------------------------

# Unsent successors due for longer than this mean the relays (and the workers that publish their own) are behind.
OUTBOX_BEHIND_S = 60.0


@dataclass(frozen=True)
class RelayPanel:
    """What the relay panel shows: the relays connected now (their LISTEN connections), the outbox's unsent rows
    (how many, how many due, how many failed to publish, the oldest's age) and the oldest unsent successor."""

    relays: list[str]
    unsent: int
    due: int
    failing: int
    oldest_s: float | None
    oldest: Any  # the oldest_unsent row, or None

    @property
    def warnings(self) -> list[str]:
        found = []
        if not self.relays:
            found.append(
                "no relay is connected to this database: a successor whose worker died, a producer's unsent "
                "children, lost children, deadlines and reconciliation wait for one (celery -A proj fanin relay)"
            )
        if self.due and self.oldest_s is not None and self.oldest_s > OUTBOX_BEHIND_S:
            found.append(f"{self.due} successors are due and the oldest has waited {self.oldest_s:.0f} s")
        if self.failing:
            found.append(f"{self.failing} successors failed to publish and are retried with a backoff")
        return found


def relay_panel(conn: Connection) -> RelayPanel:
    relays = [r.name for r in conn.execute(_q("relays_connected"))]
    row = conn.execute(_q("outbox_panel")).one()
    oldest = conn.execute(_q("oldest_unsent")).first() if row.unsent else None
    return RelayPanel(
        relays,
        int(row.unsent),
        int(row.due),
        int(row.failing),
        float(row.oldest_s) if row.oldest_s is not None else None,
        oldest,
    )


def relay_json(panel: RelayPanel) -> dict[str, Any]:
    return {
        "relays": panel.relays,
        "unsent": panel.unsent,
        "due": panel.due,
        "failing": panel.failing,
        "oldest_unsent_seconds": panel.oldest_s,
        "oldest_unsent": jsonable(panel.oldest) if panel.oldest is not None else None,
        "warnings": panel.warnings,
    }


# --- one batch ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Bar:
    x: float
    height: float  # 0..1 of the chart's height
    count: int


@dataclass(frozen=True)
class StartsChart:
    """Children started per time bucket, from the batch's creation to its last start (or now)."""

    bars: list[Bar]
    start: datetime
    end: datetime
    bucket_s: float
    sampled: int  # children read for it
    total: int  # children in the batch
    started: int  # how many have started (estimated from the sample when it is one)
    peak: int  # the tallest bar's count (likewise)

    @property
    def is_sample(self) -> bool:
        return self.sampled < self.total


def sample_counts(sizes: Sequence[int]) -> list[int]:
    """How many children to read from each batch of a tree (the root's own children first, then each leaf's):
    about SAMPLE in all (each share rounded up), in proportion to each one's size; all of them when the whole is
    smaller."""
    total = sum(sizes)
    if total <= SAMPLE:
        return list(sizes)
    return [min(size, max(1, math.ceil(SAMPLE * size / total))) if size > 0 else 0 for size in sizes]


def starts_chart(
    samples: Sequence[tuple[datetime | None, float]], total: int, created_at: datetime, until: datetime
) -> StartsChart | None:
    """The chart from sampled (start time or None, children it stands for) pairs."""
    if not samples:
        return None
    started = sorted((t, w) for t, w in samples if t is not None)
    # To now for a batch still running (a pause in its starts shows), to its completion otherwise.
    end = max(started[-1][0], until) if started else until
    start = min(created_at, started[0][0]) if started else created_at
    span = max((end - start).total_seconds(), 0.001)
    bucket = span / CHART_BUCKETS
    counts = [0.0] * CHART_BUCKETS
    for t, w in started:
        counts[min(CHART_BUCKETS - 1, int((t - start).total_seconds() / bucket))] += w
    peak = max(counts)
    bars = [Bar(i / CHART_BUCKETS, c / peak if peak else 0.0, round(c)) for i, c in enumerate(counts)]
    return StartsChart(bars, start, end, bucket, len(samples), total, round(sum(w for _, w in started)), round(peak))


def _chart(conn: Connection, row: Any, leaves: Sequence[Any], now: datetime) -> StartsChart | None:
    planned = int(row.planned)
    if not planned:
        return None
    ids = [row.id, *(leaf.id for leaf in leaves)]
    sizes = [max(0, planned - sum(int(leaf.planned) for leaf in leaves)), *(int(leaf.planned) for leaf in leaves)]
    counts = sample_counts(sizes)
    found: dict[tuple[uuid.UUID, int], datetime | None] = {}
    for r in conn.execute(_q("start_sample"), {"ids": ids, "counts": counts}):
        found[(r.batch_id, r.idx)] = r.started_at  # a small leaf may yield one child twice
    per_batch: dict[uuid.UUID, int] = {}
    for batch_id, _ in found:
        per_batch[batch_id] = per_batch.get(batch_id, 0) + 1
    size_of = dict(zip(ids, sizes, strict=True))
    samples = [(t, size_of[b] / per_batch[b]) for (b, _), t in found.items()]
    return starts_chart(samples, planned, row.created_at, row.completed_at or now)


@dataclass(frozen=True)
class Failure:
    entry: dict[str, Any]  # outcome.failure_entry: index, task, state, exception, arguments
    worker: str | None
    finished_at: datetime | None


@dataclass
class BatchPage:
    id: uuid.UUID
    row: Any  # the batch_detail row
    # Children by state, in the order the page shows them; a batch with more than OPEN_COUNT_LIMIT unfinished
    # children has one `unfinished` entry instead of `started` and `pending`.
    counts: list[tuple[str, int]]
    successor: queries.SuccessorRow | None
    reruns: list[successors.Rerun]  # an operator's reruns of the successor (`fanin rerun`), oldest first
    actions_log: list[Any]  # what operators did to it from the dashboard (`--allow-actions`), newest first
    failures: list[Failure]
    failures_total: int
    failures_after: int  # the index the failures shown start after (-1: from the first)
    failures_next: int | None  # the `after` of the next page of failures
    leaves: list[admin.Node]
    leaves_total: int
    descendants: list[admin.Node]
    rounds: list[admin.Node]
    nested_in: tuple[uuid.UUID, int] | None
    chart: StartsChart | None
    now: datetime
    age_s: float
    rate: float | None
    final: bool  # nothing on the page will change any more
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def remaining(self) -> int:
        return max(0, int(self.row.planned) - int(self.row.succeeded) - int(self.row.failed))


def _failure(r: Any) -> Failure:
    row = queries.FailureRow(
        index=r.idx,
        task_id=r.task_id,
        task_name=r.task_name,
        state=r.state,
        exc_type=r.exc_type,
        exc_message=r.exc_message,
        attempts=r.starts,
        late_state=r.late_state,
        message=Encoded(r.content_type, r.content_encoding, bytes(r.message)),
        traceback=r.traceback,
    )
    return Failure(failure_entry(row, with_traceback=True), r.worker, r.finished_at)


def _is_final(state: str, successor: queries.SuccessorRow | None, is_leaf: bool) -> bool:
    if state in BATCH_ACTIVE:
        return False
    if is_leaf:
        return True
    if successor is None:
        return state in BATCH_ENDED_WITHOUT_SUCCESSOR
    return successor.state in successors.FINAL_STATES


def batch_page(conn: Connection, batch_id: uuid.UUID, failures_after: int = -1) -> BatchPage | None:
    row = conn.execute(_q("batch_detail"), {"id": batch_id}).first()
    if row is None:
        return None
    now = row.now
    successor = queries.successor(conn, batch_id, row.step) if row.parent_id is None else None
    unfinished = max(0, int(row.planned) - int(row.succeeded) - int(row.failed))
    failed_by_state = sorted(
        ((r.state, int(r.n)) for r in conn.execute(_q("failure_counts"), {"id": batch_id})),
        key=lambda p: (-p[1], p[0]),
    )
    succeeded = int(row.succeeded)
    if unfinished <= OPEN_COUNT_LIMIT:
        pending, started = admin.open_children(conn, batch_id)
        open_counts = [("started", started), ("pending", pending)]
    else:
        open_counts = [("unfinished", unfinished)]
    counts = [("succeeded", succeeded), *failed_by_state, *open_counts]
    failure_rows = conn.execute(
        _q("failures_page"), {"id": batch_id, "after": failures_after, "n": FAILURES_SHOWN + 1}
    ).all()
    failures = [_failure(r) for r in failure_rows[:FAILURES_SHOWN]]
    more = len(failure_rows) > FAILURES_SHOWN
    leaf_sizes = conn.execute(_q("leaf_sizes"), {"id": batch_id}).all()
    leaves = admin.leaves(conn, batch_id, LEAVES_SHOWN) if leaf_sizes else []
    descendants = admin.descendants(conn, batch_id, DESCENDANTS_SHOWN)
    original = row.retry_of or row.id
    rounds = admin.rounds(conn, original)
    if len(rounds) < 2 and row.retry_of is None:
        rounds = []
    nested_in = admin.child_location(conn, row.parent_task_id) if row.parent_task_id else None
    chart = _chart(conn, row, leaf_sizes, now)
    done = int(row.succeeded) + int(row.failed)
    return BatchPage(
        id=row.id,
        row=row,
        counts=counts,
        successor=successor,
        reruns=successors.reruns(conn, batch_id, row.step) if successor is not None else [],
        actions_log=list(conn.execute(_q("operator_actions"), {"id": batch_id})),
        failures=failures,
        failures_total=sum(n for _, n in failed_by_state),
        failures_after=failures_after,
        failures_next=failures[-1].entry["index"] if more else None,
        leaves=leaves,
        leaves_total=len(leaf_sizes),
        descendants=descendants,
        rounds=rounds,
        nested_in=nested_in,
        chart=chart,
        now=now,
        age_s=(now - row.created_at).total_seconds(),
        rate=throughput(done, row.created_at, row.completed_at or now),
        final=_is_final(row.state, successor, row.parent_id is not None),
    )


# --- sagas ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SagasPage:
    rows: list[Any]
    next: Cursor | None
    now: datetime


def sagas_page(conn: Connection, state: str | None, before: Cursor | None, limit: int) -> SagasPage:
    if state is not None and state not in SAGA_STATES:
        raise BadRequest(f"unknown saga state {state!r} (one of {', '.join(SAGA_STATES)})")
    rows = conn.execute(_q("sagas_page"), {"state": state, **_cursor_params(before), "n": limit + 1}).all()
    now = rows[0].now if rows else admin.db_now(conn)
    more = len(rows) > limit
    shown = list(rows[:limit])
    return SagasPage(shown, Cursor(shown[-1].created_at, shown[-1].id) if more else None, now)


@dataclass(frozen=True)
class SagaPage:
    saga: saga_store.SagaRow
    steps: list[saga_store.StepRow]
    compensations: list[saga_store.CompensationRow]
    batches: dict[uuid.UUID, Any]  # the steps' and compensations' batches: state and counts
    to_ack: list[saga_store.CompensationRow]  # manual actions an operator must do, then acknowledge
    now: datetime

    @property
    def final(self) -> bool:
        return self.saga.state in FINAL_SAGA_STATES


def saga_page(conn: Connection, saga_id: uuid.UUID) -> SagaPage | None:
    row = saga_store.get_saga(conn, saga_id)
    if row is None:
        return None
    steps = saga_store.get_steps(conn, saga_id)
    comps = saga_store.get_compensations(conn, saga_id)
    ids = [b for b in {*(s.batch_id for s in steps), *(c.batch_id for c in comps)} if b is not None]
    found = {r.id: r for r in conn.execute(_q("batch_briefs"), {"ids": ids})} if ids else {}
    to_ack = [c for c in comps if c.kind == "manual" and c.state == "manual_action_required"]
    return SagaPage(row, steps, comps, found, to_ack, admin.db_now(conn))


def read(engine: Engine) -> Connection:
    """A connection for one page's reads (one REPEATABLE READ snapshot: the counts on a page agree)."""
    return engine.connect().execution_options(isolation_level="REPEATABLE READ")


# --- the JSON API and the lookup ------------------------------------------------------------------------------


def jsonable(value: Any) -> Any:
    """`value` as JSON types: dataclasses and rows as objects, datetimes in ISO 8601, UUIDs as strings."""
    if isinstance(value, admin.Node):
        return value.as_dict()
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: jsonable(getattr(value, f.name)) for f in fields(value)}
    if hasattr(value, "_mapping"):  # a SQLAlchemy row
        return {key: jsonable(v) for key, v in value._mapping.items()}
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, (bytes, memoryview)):
        return None  # a stored message or result: not the API's to decode
    if isinstance(value, Decimal):
        return float(value)
    return value


def batches_json(page: BatchesPage) -> dict[str, Any]:
    return {
        "batches": [{**jsonable(b), "id": str(b.id)} for b in page.rows],
        "next": page.next.encode() if page.next else None,
        "active": page.active,
        "now": page.now.isoformat(),
    }


def batch_json(page: BatchPage) -> dict[str, Any]:
    row = jsonable(page.row)
    row.pop("message", None)
    return {
        "batch": row,
        "remaining": page.remaining,
        "counts": dict(page.counts),
        "successor": jsonable(page.successor),
        "reruns": [jsonable(r) for r in page.reruns],
        "operator_actions": [jsonable(r) for r in page.actions_log],
        "failures": [{**f.entry, "worker": f.worker, "finished_at": jsonable(f.finished_at)} for f in page.failures],
        "failures_total": page.failures_total,
        "failures_next": page.failures_next,
        "leaves_total": page.leaves_total,
        "rounds": [n.as_dict() for n in page.rounds],
        "nested_in": (
            {"batch_id": str(page.nested_in[0]), "index": page.nested_in[1]} if page.nested_in is not None else None
        ),
        "final": page.final,
        "now": page.now.isoformat(),
    }


def lookup(conn: Connection, value: str) -> uuid.UUID | None:
    """The root batch `value` names: a batch id, a child's task id, or a successor's task id (None: none)."""
    value = value.strip()
    try:
        as_batch = uuid.UUID(value)
    except ValueError:
        as_batch = None
    node = admin.node(conn, as_batch) if as_batch is not None else None
    if node is not None:
        return node.parent_id or node.id
    child = admin.child_location(conn, value)
    if child is not None:
        return child[0]
    found = conn.execute(_q("successor_by_task_id"), {"t": value}).first()
    return None if found is None else found.batch_id
