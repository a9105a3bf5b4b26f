"""The counting protocol as a hypothesis state machine, run against the real PostgreSQL functions (issue 26).

Every rule is one of the transactions the library runs, made of the library's own store calls
(`celery_fanin.store.*`: the SQL functions `fanin_report_terminal_v2`, `fanin_settle_v2`, `fanin_seal`, ... and the
statements in `batches`, `recovery`, `successors`, `outbox`, `admin`), in the composition its callers use
(the producer's chunk in `producer/write.py:_fill`, the relay's claim in `dispatch/successors.py:publish_outbox`, the
reaper's duties in `relay/maintenance.py`, prune's transaction in `ops/retention.py`). Nothing here re-implements
a counter in Python: the model only remembers what it created and what the calls returned, and the invariants
are read from the database after every step.

Concurrency: the rules run in `SESSIONS` database sessions; any rule may *hold* its transaction open, so that
the rules after it in other sessions wait on its locks (settled by `sessions.settle`) and re-evaluate their
conditions when it commits or rolls back (`release`). The relay's duties read their work list in one step
(`relay_scan`) and act on an entry of it in a later one (`relay_act`), as the relay does, so that anything may
happen in between.
"""

from __future__ import annotations

import functools
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta, timezone
from typing import Any, ClassVar

import psycopg
from hypothesis import strategies as st
from hypothesis.stateful import RULE_MARKER, RuleBasedStateMachine, initialize, invariant, rule
from sqlalchemy import Connection, Engine, create_engine, text

from celery_fanin.context import normalise_database_url
from celery_fanin.producer.write import EMPTY_DIGEST, Layout, digest_step
from celery_fanin.store import admin, batches, outbox, recovery, successors
from celery_fanin.store.reports import record_terminal, record_terminals, reported
from celery_fanin.store.statements import q
from tests.sql import Held
from tests.store.helpers import json_encoded

from .sessions import SETTLE_TIMEOUT, Op, Rollback, Session, Shared, is_transient, settle

SESSIONS = 4
# The key of the worker that delivers the model's successors (its digest is on each run it holds); a forger's is
# another.
WORKER_KEY = "worker-key"
HANDOFF = 3600.0  # seconds a handed-off row is left to its worker: longer than any run, so only the worker sends it
STEP = "merge"
# A run's lease and the grace after it: long, so that only `lapse` (the model's clock) makes a run dead.
LEASE = 600.0
GRACE = 600.0
WORKER_STATES = ("succeeded", "failed", "time_limit", "worker_lost", "revoked", "rejected", "unknown")
FINAL_BATCH = frozenset({"complete", "partial", "failed_threshold", "expired", "cancelled"})
FINAL_SUCCESSOR = successors.FINAL_STATES
LEAVES_MAY_BE_OPEN = ("open", "failed_threshold")
TABLES = "fanin_outbox, fanin_successors, fanin_children, fanin_batches"

_ENGINES: dict[str, Engine] = {}
# What the runs of this process did, for the test's summary: operations committed / aborted, lock waits seen.
STATS: Counter[str] = Counter()


@dataclass(frozen=True)
class Failure:
    where: str
    error: BaseException
    traceback: str


# The error of every failing example, in order: the steps run against a real database, so a replay can diverge
# from the run that failed (hypothesis then reports only that it could not replay); the tests show these instead.
FAILURES: list[Failure] = []


def engine_for(url: str) -> Engine:
    if url not in _ENGINES:
        _ENGINES[url] = create_engine(
            normalise_database_url(url), pool_size=SESSIONS + 2, max_overflow=2, isolation_level="READ COMMITTED"
        )
    return _ENGINES[url]


def dispose_engine(url: str) -> None:
    engine = _ENGINES.pop(url, None)
    if engine is not None:
        engine.dispose()


def _signature(name: str) -> batches.Encoded:
    return json_encoded(
        {"task": name, "args": [], "kwargs": {}, "options": {}, "subtask_type": None, "immutable": False}
    )


class Violation(AssertionError):
    """An invariant of the protocol does not hold."""


# --- what the model remembers ---------------------------------------------------------------------------------


@dataclass
class Child:
    task_id: str
    root: uuid.UUID
    batch: uuid.UUID  # the root, or the leaf holding it
    idx: int
    task_name: str = "t.child"


@dataclass
class Stream:
    """A streaming producer: its layout (the producer's own class), digest, next index, and whether it is done."""

    layout: Layout
    digest: bytes = EMPTY_DIGEST
    index: int = 0
    busy: bool = False  # a chunk or its seal is in flight (a producer writes one chunk at a time)
    stopped: bool = False  # a chunk was refused (the batch was no longer open): the producer gave up
    sealed: bool = False


@dataclass
class Root:
    batch: batches.NewBatch
    kind: str  # flat, tree, stream
    stream: Stream | None = None


@dataclass
class SuccessorModel:
    """What the model knows of a successor's runs, from committed claim_run / hand_over / record_state calls."""

    admitted: int = 0  # the highest run number admitted
    live: int | None = None  # the run admitted and not ended
    dead: bool = False  # its lease lapsed (`lapse`) or its process died (`holder_dies`): another may take over
    handed: int | None = None  # the run that handed the successor over last (take_back undoes that)
    carrier: str | None = None  # the token the last replacement's carrier brings: nothing else is admitted
    carried: dict[int, str | None] = field(default_factory=dict)  # run number -> the token its delivery brought
    owner: dict[int, str] = field(default_factory=dict)  # run number -> the process that holds it
    key: dict[int, str] = field(default_factory=dict)  # run number -> the key of the worker it belongs to
    task_id: str | None = None  # the task id the guard admits now: None, the batch's; after a rerun, the rerun's
    earlier_ids: list[str] = field(default_factory=list)  # the task ids reruns replaced: never admitted again


@dataclass
class Model:
    roots: dict[uuid.UUID, Root] = field(default_factory=dict)
    children: dict[str, Child] = field(default_factory=dict)
    counted: Counter[str] = field(default_factory=Counter)
    runs: dict[uuid.UUID, SuccessorModel] = field(default_factory=dict)
    final_batches: dict[uuid.UUID, str] = field(default_factory=dict)
    final_successors: dict[uuid.UUID, str] = field(default_factory=dict)
    worklist: list[tuple[str, Any]] = field(default_factory=list)
    aborted: Counter[str] = field(default_factory=Counter)
    # Trees prune has begun to delete (leaf by leaf): between its transactions, the root has lost children.
    pruning: set[uuid.UUID] = field(default_factory=set)
    # Children that stand for a nested batch (its `parent_task_id`): its successor's end reports them.
    nested: set[str] = field(default_factory=set)
    # Batches whose successor a report of a worker that publishes its successors created (`handoff` not None): the
    # only successors that may be handed to a worker (their outbox row not yet due for the relay).
    handed: set[uuid.UUID] = field(default_factory=set)


OPTIONS = st.fixed_dictionaries(
    {
        "max_failures": st.sampled_from([None, 0, 1]),
        "deadline": st.sampled_from([None, "proceed", "abandon"]),
        "child_timeout": st.booleans(),
        "on_lost": st.sampled_from(["fail", "redrive"]),
        "on_expire": st.booleans(),
        "on_failure": st.booleans(),
        "expires": st.booleans(),
    }
)
HOLD = st.sampled_from([False, False, True])


def _when(applicable: Any) -> Any:
    """A rule that does nothing unless `applicable(self)`. Not a hypothesis precondition: what is applicable
    depends on what the database did (a lock wait, a deadlock victim), and the rules hypothesis may draw from
    must not change when it replays a case."""

    def wrap(fn: Any) -> Any:
        @functools.wraps(fn)
        def rule_body(self: Any, **kwargs: Any) -> None:
            if applicable(self):
                fn(self, **kwargs)

        return rule_body

    return wrap


PICK = st.integers(min_value=0, max_value=10_000)


class ProtocolMachine(RuleBasedStateMachine):
    """Random interleavings of every operation that touches a batch, against one database (`url`)."""

    url: ClassVar[str]

    def __init__(self) -> None:
        super().__init__()
        self.engine = engine_for(self.url)
        with self.engine.begin() as conn:
            conn.execute(text(f"TRUNCATE {TABLES} RESTART IDENTITY CASCADE"))  # constant names
        self.shared = Shared()
        self.sessions = [Session(self.engine, f"s{i}", self.shared) for i in range(SESSIONS)]
        # Half the sessions are workers' report connections (`store.reports`) whose worker publishes what its reports
        # create: a batch that their reports complete gets an outbox row handed to the worker (`handoff`, the
        # argument `FanIn.report_handoff` gives a worker's reports), not due for the relay's claim.
        for session in self.sessions[: SESSIONS // 2]:
            session.conn.info["handoff"] = HANDOFF
        self.monitor = psycopg.connect(self.url, autocommit=True)
        self.checker = self.engine.connect().execution_options(isolation_level="REPEATABLE READ")
        self.m = Model()

    def teardown(self) -> None:
        try:
            for s in self.sessions:
                s.release(commit=False)
            for s in self.sessions:
                s.close()
        finally:
            self.monitor.close()
            self.checker.close()

    # --- running operations ---------------------------------------------------------------------------------

    def _idle(self, pick: int) -> Session:
        """An idle session; if every one is busy, the oldest held transaction commits first (sessions only ever
        wait on held transactions, so that frees one)."""
        deadline = time.monotonic() + SETTLE_TIMEOUT
        while True:
            idle = [s for s in self.sessions if not s.busy]
            if idle:
                return idle[pick % len(idle)]
            holders = [s for s in self.sessions if s.holding]
            if holders:
                holders[0].release(commit=True)
            elif time.monotonic() > deadline:
                rows = self.monitor.execute(
                    "SELECT pid, pg_blocking_pids(pid), wait_event_type, wait_event, left(query, 200)"
                    " FROM pg_stat_activity WHERE datname = current_database()"
                ).fetchall()
                raise AssertionError(f"every session waits on a lock and none holds one: {rows}")
            else:
                time.sleep(0.05)  # a lock that is about to be granted, or a deadlock PostgreSQL is breaking
            self._settle()

    def run(self, op: Op, pick: int = 0, hold: bool = False) -> None:
        """Run `op` in an idle session (leaving its transaction open if `hold`), then wait for all to settle."""
        self._idle(pick).submit(op, hold)
        self._settle()

    def _settle(self) -> None:
        settle(self.sessions, self.monitor)
        STATS["lock waits"] += sum(1 for s in self.sessions if s.busy and not s.holding)
        self._drain()

    def _drain(self) -> None:
        with self.shared.lock:
            done, self.shared.completions[:] = list(self.shared.completions), []
        for c in done:
            STATS[f"{c.op.label.split('(')[0]} {'committed' if c.committed else 'rolled back'}"] += 1
            if c.committed:
                c.op.on_commit(c.result)
                continue
            err = c.error
            if isinstance(err, Rollback) or (err is not None and isinstance(err, c.op.expected)):
                c.op.on_abort(err)
                continue
            if err is not None and is_transient(err):
                # A deadlock or serialization failure: the transaction rolled back; its caller would run it again.
                self.m.aborted[c.op.label] += 1
                c.op.on_abort(err)
                continue
            raise Violation(f"{c.op.label} raised {type(err).__name__}: {err}") from err

    def has_idle(self) -> bool:
        return True  # `_idle` makes one

    def _pick(self, items: list[Any], pick: int) -> Any:
        return items[pick % len(items)]

    # --- creating batches ---------------------------------------------------------------------------------------

    def _new_batch(self, opts: dict[str, Any], *, ratio: float | None = None) -> batches.NewBatch:
        batch_id = uuid.uuid4()
        past = datetime.now(timezone.utc) - timedelta(hours=1)
        return batches.NewBatch(
            id=batch_id,
            step=STEP,
            successor_task_id=f"s-{batch_id.hex}",
            successor_name="t.collect",
            successor_message=_signature("t.collect"),
            child_timeout=timedelta(0) if opts["child_timeout"] else None,
            on_lost=opts["on_lost"],
            max_redrives=1,
            deadline_at=past if opts["deadline"] else None,
            on_deadline=opts["deadline"] or "proceed",
            max_failures=None if ratio is not None else opts["max_failures"],
            max_failures_ratio=ratio,
            on_expire=_signature("t.expired") if opts["on_expire"] else None,
            on_failure=_signature("t.failed") if opts["on_failure"] else None,
            app_name="model",
        )

    def _new_children(self, batch: batches.NewBatch, start: int, n: int, expires: bool) -> list[batches.NewChild]:
        past = datetime.now(timezone.utc) - timedelta(hours=1)
        return [
            batches.NewChild(
                f"c-{batch.id.hex[:12]}-{start + i}",
                "t.child",
                _signature("t.child"),
                expires_at=past if expires else None,
            )
            for i in range(n)
        ]

    def _created(self, root: Root, placed: list[tuple[uuid.UUID, batches.NewChild, int]]) -> None:
        self.m.roots[root.batch.id] = root
        self.m.runs.setdefault(root.batch.id, SuccessorModel())
        for batch_id, child, idx in placed:
            self.m.children[child.task_id] = Child(child.task_id, root.batch.id, batch_id, idx)

    def _outer_child(self, pick: int) -> Child | None:
        """A child not counted yet that no nested batch stands for: one a nested batch may stand for. The last such
        child of its batch first, so that the nested successor's end completes the outer batch in a few steps."""
        free = [c for c in self.m.children.values() if not self.m.counted[c.task_id] and c.task_id not in self.m.nested]
        per_root = Counter(c.root for c in free)
        last = [c for c in free if per_root[c.root] == 1]
        return self._pick(last or free, pick) if free else None

    @rule(
        n=st.integers(0, 4),
        opts=OPTIONS,
        leaves=st.sampled_from([0, 0, 1, 2, 3]),
        pick=PICK,
        hold=HOLD,
        nest=st.sampled_from([False, False, True]),
    )
    @_when(has_idle)
    def create(self, n: int, opts: dict[str, Any], leaves: int, pick: int, hold: bool, nest: bool = False) -> None:
        """A list: the batch and its children in one transaction (`create_batch`), flat or as a tree; `nest`, a
        nested fan-in standing for a child of another batch, which its successor's end reports (`record_state`)."""
        batch = self._new_batch(opts)
        outer = self._outer_child(pick) if nest else None
        if outer is not None:
            batch = replace(batch, parent_task_id=outer.task_id)
            self.m.nested.add(outer.task_id)
        children = self._new_children(batch, 0, n, opts["expires"])
        leaves = min(leaves, n)
        root = Root(batch, "tree" if leaves else "flat")

        def fn(conn: Connection) -> list[tuple[uuid.UUID, batches.NewChild, int]]:
            batches.create_batch(conn, batch, children, leaves=leaves)
            rows = conn.execute(
                text("SELECT task_id, batch_id, idx FROM fanin_children c WHERE c.task_id = ANY(:ids)"),
                {"ids": [c.task_id for c in children]},
            )
            by_id = {c.task_id: c for c in children}
            return [(r.batch_id, by_id[r.task_id], r.idx) for r in rows]

        self.run(Op(f"create({n}, leaves={leaves})", fn, lambda placed: self._created(root, placed)), pick, hold)

    @rule(
        opts=OPTIONS,
        ratio=st.sampled_from([None, None, 0.5]),
        direct=st.integers(0, 2),
        pick=PICK,
        hold=HOLD,
    )
    @_when(has_idle)
    def create_stream(self, opts: dict[str, Any], ratio: float | None, direct: int, pick: int, hold: bool) -> None:
        """A generator: the batch created open with its producer's token (`insert_batch`); chunks follow."""
        batch = self._new_batch(opts, ratio=ratio)
        root = Root(batch, "stream", Stream(Layout(max_width=2, fanout=2, direct_left=direct)))

        def fn(conn: Connection) -> None:
            batches.insert_batch(conn, batch, state="open", planned=0)

        self.run(Op("create_stream", fn, lambda _: self._created(root, [])), pick, hold)

    def _streams(self, *, writable: bool = True) -> list[Root]:
        return [
            r
            for r in self.m.roots.values()
            if r.stream is not None and not r.stream.busy and not r.stream.sealed and not r.stream.stopped
        ]

    def has_stream(self) -> bool:
        return self.has_idle() and bool(self._streams())

    @rule(which=PICK, n=st.integers(1, 3), expires=st.booleans(), pick=PICK, hold=HOLD)
    @_when(has_stream)
    def stream_chunk(self, which: int, n: int, expires: bool, pick: int, hold: bool) -> None:
        """One chunk of an open batch, as the producer writes it (`write._fill` calls `batches.write_chunk`): new
        leaves, the children and the counters, full leaves sealed; rolled back if the batch is no longer open."""
        root: Root = self._pick(self._streams(), which)
        stream = root.stream
        assert stream is not None
        part = self._new_children(root.batch, stream.index, n, expires)
        digest = stream.digest
        for child in part:
            digest = digest_step(digest, child)
        targets, opened, full = stream.layout.place(n)
        placed = [(t or root.batch.id, c, stream.index + i) for i, (c, t) in enumerate(zip(part, targets, strict=True))]
        stream.busy = True

        def fn(conn: Connection) -> None:
            if not batches.write_chunk(conn, root.batch, placed, digest, opened=opened, full=full):
                raise Rollback("the batch is no longer open")

        def committed(_: Any) -> None:
            stream.busy = False
            stream.digest, stream.index = digest, stream.index + n
            self._created(root, placed)

        def aborted(_: BaseException | None) -> None:
            stream.busy, stream.stopped = False, True  # the producer stops (BatchClosed, or it finished early)

        self.run(Op(f"stream_chunk({n})", fn, committed, aborted), pick, hold)

    @rule(which=PICK, pick=PICK, hold=HOLD)
    @_when(has_stream)
    def stream_seal(self, which: int, pick: int, hold: bool) -> None:
        """The producer's input is exhausted: it seals its unsealed leaves, then the root (`batches.seal`)."""
        root: Root = self._pick(self._streams(), which)
        stream = root.stream
        assert stream is not None
        stream.busy = True
        unsealed = stream.layout.unsealed()

        def fn(conn: Connection) -> None:
            for leaf_id in unsealed:
                batches.seal(conn, leaf_id)
            batches.seal(conn, root.batch.id)

        def done(_: Any) -> None:
            stream.busy, stream.sealed = False, True

        def aborted(_: BaseException | None) -> None:
            stream.busy = False

        self.run(Op("stream_seal", fn, done, aborted), pick, hold)

    def has_root(self) -> bool:
        return self.has_idle() and bool(self.m.roots)

    @rule(which=PICK, lapsed=st.booleans(), pick=PICK, hold=HOLD, now=st.sampled_from([False, False, True]))
    @_when(has_root)
    def operator_seal(self, which: int, lapsed: bool, pick: int, hold: bool, now: bool) -> None:
        """`celery -A proj fanin seal`, or the relay sealing a batch whose producer is gone (`seal_open_batch`);
        also a producer's seal sent twice (`fanin_seal` on a batch no longer open)."""
        root: Root = self._pick(list(self.m.roots.values()), which)
        if not now and root.stream is not None and not root.stream.sealed:
            return  # mostly, the producer is left to write its batch

        def fn(conn: Connection) -> None:
            recovery.seal_open_batch(conn, root.batch.id, lapsed_grace=0.0 if lapsed else None)
            batches.seal(conn, root.batch.id)  # a duplicate seal: must change nothing

        self.run(Op("operator_seal", fn), pick, hold)

    # --- children -------------------------------------------------------------------------------------------

    def has_child(self) -> bool:
        return self.has_idle() and bool(self.m.children)

    @rule(which=PICK, pick=PICK, hold=HOLD)
    @_when(has_child)
    def start(self, which: int, pick: int, hold: bool) -> None:
        """A worker took the child (`fanin_record_starts`)."""
        child: Child = self._pick(list(self.m.children.values()), which)
        params = batches.starts_params([batches.Start(child.task_id, 0, "w1", datetime.now(timezone.utc))])
        self.run(Op("start", lambda conn: conn.exec_driver_sql(batches.RECORD_STARTS_SQL, params).all()), pick, hold)

    @rule(
        which=PICK,
        state=st.sampled_from(WORKER_STATES),
        claim=st.sampled_from(["right", "right", "right", "index", "batch", "task_name"]),
        pick=PICK,
        hold=HOLD,
    )
    @_when(has_child)
    def report(self, which: int, state: str, claim: str, pick: int, hold: bool) -> None:
        """A worker's terminal report (`fanin_report_terminal_v2`), as its message names the child; the same child
        may be reported any number of times (duplicates, redeliveries, a late report after it was abandoned)."""
        child: Child = self._pick(list(self.m.children.values()), which)
        named = batches.Claim(
            str(uuid.uuid4()) if claim == "batch" else str(child.root),
            child.idx + 1 if claim == "index" else child.idx,
            "t.other" if claim == "task_name" else child.task_name,
        )

        said: dict[str, float | None] = {}

        def fn(conn: Connection) -> batches.TerminalRecord:
            handoff = said["handoff"] = conn.info.get("handoff")  # this session's worker's (`__init__`)
            return record_terminal(Held(conn), child.task_id, state, exc_type=None, claim=named, handoff=handoff)

        def done(rec: batches.TerminalRecord) -> None:
            if rec.successor_created and said.get("handoff") is not None:
                self.m.handed.add(child.root)
            if claim != "right" and rec.counted:
                raise Violation(f"a report naming the wrong {claim} counted child {child.task_id}")
            if claim == "right" and not rec.counted and not rec.late and self._exists(child.task_id):
                # Liveness: only a child that is gone (pruned) may swallow a rightly claimed report; a row never
                # comes back, so one that exists now existed when the report ran, pending, started or terminal.
                raise Violation(f"a report with the right claim on child {child.task_id} neither counted nor was late")
            if rec.counted:
                self._count(child.task_id)

        self.run(Op(f"report({state}, {claim})", fn, done), pick, hold)

    @rule(
        which=st.lists(PICK, min_size=2, max_size=4),
        state=st.sampled_from(WORKER_STATES),
        pick=PICK,
        hold=HOLD,
    )
    @_when(has_child)
    def report_group(self, which: list[int], state: str, pick: int, hold: bool) -> None:
        """A prefork worker's group commit (`fanin_report_batching`, `reports.record_terminals`): several claimed
        reports, the same child possibly more than once, in one statement and one transaction. Each must count,
        be late or hand off exactly as it would alone; the group commits or rolls back whole."""
        kids: list[Child] = [self._pick(list(self.m.children.values()), w) for w in which]
        said: dict[str, float | None] = {}

        def fn(conn: Connection) -> list[batches.TerminalRecord]:
            handoff = said["handoff"] = conn.info.get("handoff")
            group = [
                batches.terminal_params(
                    c.task_id, state, None, None, None, None, batches.Claim(str(c.root), c.idx, c.task_name), handoff
                )
                for c in kids
            ]
            return [reported(row) for row in record_terminals(Held(conn), group, handoff)]

        def done(recs: list[batches.TerminalRecord]) -> None:
            for child, rec in zip(kids, recs, strict=True):
                if rec.successor_created and said.get("handoff") is not None:
                    self.m.handed.add(child.root)
                if not rec.counted and not rec.late and self._exists(child.task_id):
                    raise Violation(f"a grouped report on child {child.task_id} neither counted nor was late")
                if rec.counted:
                    self._count(child.task_id)

        self.run(Op(f"report_group({state}, {len(kids)})", fn, done), pick, hold)

    # Reports are most of a real batch's traffic: a second rule that sends one, so that hypothesis draws them
    # about twice as often as each other operation.
    @rule(which=PICK, state=st.sampled_from(WORKER_STATES), pick=PICK, hold=HOLD)
    @_when(has_child)
    def report_again(self, which: int, state: str, pick: int, hold: bool) -> None:
        self.report.__wrapped__(self, which=which, state=state, claim="right", pick=pick, hold=hold)  # type: ignore[attr-defined]

    def _count(self, task_id: str) -> None:
        self.m.counted[task_id] += 1
        if self.m.counted[task_id] > 1:
            raise Violation(f"child {task_id} was counted {self.m.counted[task_id]} times")

    # --- the relay's duties: scanned in one step, acted on in a later one --------------------------------------

    @rule(pick=PICK)
    @_when(has_idle)
    def relay_scan(self, pick: int) -> None:
        """What the reaper and reconciliation read before acting: overdue and expired children, due deadlines,
        batches to reconcile, stalled successors, open batches whose producer is gone."""

        def fn(conn: Connection) -> list[tuple[str, Any]]:
            found: list[tuple[str, Any]] = [("lost", c) for c in recovery.overdue_children(conn, 20)]
            found += [("expired", t[0]) for t in recovery.expired_children(conn, 0.0, 20)]
            found += [("deadline", b) for b in recovery.due_deadlines(conn, 20)]
            found += [("reconcile", b) for b in recovery.batches_to_reconcile(conn, 20)]
            found += [("stalled", s) for s in successors.stalled(conn, 0.0, GRACE, 20)]
            found += [("lapsed", b) for b in recovery.lapsed_open_batches(conn, 0.0, 20)]
            return found

        def done(found: list[tuple[str, Any]]) -> None:
            self.m.worklist = found

        self.run(Op("relay_scan", fn, done), pick)

    def has_work(self) -> bool:
        return self.has_idle() and bool(self.m.worklist)

    @rule(which=PICK, pick=PICK, hold=HOLD)
    @_when(has_work)
    def relay_act(self, which: int, pick: int, hold: bool) -> None:
        """The relay acts on one entry of its last scan, in a transaction of its own (relay/maintenance.py)."""
        kind, item = self.m.worklist.pop(which % len(self.m.worklist))

        def fn(conn: Connection) -> Any:
            if kind == "lost":
                if item.on_lost == "redrive" and item.redrives < item.max_redrives:
                    return ("redrive", recovery.claim_redrive(conn, item))
                return ("counted", item.task_id, recovery.fail_lost(conn, item))
            if kind == "expired":
                return ("counted", item, recovery.revoke_expired(conn, item, 0.0))
            if kind == "deadline":
                return ("expiry", recovery.expire_batch(conn, item))
            if kind == "reconcile":
                return ("repair", recovery.reconcile_batch(conn, item))
            if kind == "stalled":
                return ("republish", successors.republish(conn, item[0], item[1], 0.0, GRACE))
            return ("sealed", recovery.seal_open_batch(conn, item, lapsed_grace=0.0))

        def done(result: Any) -> None:
            if result[0] == "counted" and result[2]:
                self._count(result[1])
            if result[0] == "repair" and result[1] is not None:
                raise Violation(f"reconciliation had to repair batch {item}: {result[1].as_dict()}")
            if result[0] == "republish" and result[1]:
                runs = self.m.runs.get(item[0])
                if runs is not None and runs.carrier is not None:
                    raise Violation(f"the stall scan republished batch {item[0]}'s replaced successor")
                if runs is not None and runs.live is not None:
                    runs.live = None  # a dead run's successor went back to `sent`

        self.run(Op(f"relay_act({kind})", fn, done), pick, hold)

    @rule(
        which=PICK,
        reason=st.sampled_from(["deadline", "cancel"]),
        proceed=st.sampled_from([None, True, False]),
        pick=PICK,
        hold=HOLD,
    )
    @_when(has_root)
    def expire(self, which: int, reason: str, proceed: bool | None, pick: int, hold: bool) -> None:
        """A passed deadline (`on_deadline` proceed or abandon) or `fanin cancel [--proceed]` (`expire_batch`)."""
        root: Root = self._pick(list(self.m.roots.values()), which)
        self.run(
            Op(
                f"expire({reason})",
                lambda conn: recovery.expire_batch(conn, root.batch.id, reason=reason, proceed=proceed),
            ),
            pick,
            hold,
        )

    @rule(which=PICK, pick=PICK, hold=HOLD)
    @_when(has_root)
    def reconcile(self, which: int, pick: int, hold: bool) -> None:
        """`fanin reconcile` on any batch or leaf, whatever its state: it must never find anything to repair (a
        tree prune has begun to delete included: its missing leaves are accounted for by the root's totals)."""
        root: Root = self._pick(list(self.m.roots.values()), which)

        def fn(conn: Connection) -> list[recovery.Repair]:
            ids = [root.batch.id] + [
                r[0]
                for r in conn.execute(
                    text("SELECT id FROM fanin_batches WHERE parent_id = :id ORDER BY id"), {"id": root.batch.id}
                )
            ]
            repairs = [recovery.reconcile_batch(conn, i) for i in reversed(ids)]  # leaves first, as the relay
            return [r for r in repairs if r is not None]

        def done(repairs: list[recovery.Repair]) -> None:
            if repairs:
                raise Violation(f"reconciliation repaired {[r.as_dict() for r in repairs]}")

        self.run(Op("reconcile", fn, done), pick, hold)

    # --- the outbox and the successor's runs -------------------------------------------------------------------

    @rule(fail=st.sampled_from([False, False, True]), pick=PICK, hold=HOLD)
    @_when(has_idle)
    def relay_publish(self, fail: bool, pick: int, hold: bool) -> None:
        """The relay's claim-and-publish (`publish_outbox`): claim due rows, abandon a stopped batch's unfinished
        children (`abandon_after_threshold`), mark them sent; or keep a row pending with a backoff (`mark_failed`)."""

        def fn(conn: Connection) -> None:
            rows = outbox.claim(conn, 3)
            for row in rows:
                if fail:
                    outbox.mark_failed(conn, row, "broker refused", 0.0)
                elif row.batch is not None and row.batch.state == "failed_threshold":
                    recovery.abandon_after_threshold(conn, row.batch_id)
            if not fail:
                outbox.mark_sent(conn, rows)

        self.run(Op("relay_publish", fn), pick, hold)

    @rule(pick=PICK, hold=HOLD)
    @_when(has_idle)
    def worker_publish(self, pick: int, hold: bool) -> None:
        """A worker's publish of a successor handed to it (`dispatch/successors.py:publish_created_successor`): the
        batch's handed-off rows as its report returned them or its worker reads them (`fanin_handed_off`, no
        lock), then marked sent (`mark_sent_async`)."""

        def fn(conn: Connection) -> int:
            batch_id = _a_handed_off_batch(conn)
            if batch_id is None:
                return 0
            rows = outbox.handed_off_rows(conn.execute(q("handed_off").text, {"batch": batch_id}).scalar_one())
            for row in rows:
                state = row.batch.state if row.batch is not None else None
                if state != "complete":
                    raise Violation(f"a {state} batch's successor was handed to its worker: {batch_id}")
            if rows:
                conn.execute(q("mark_sent_async").text, {"ids": [r.id for r in rows]})
            return len(rows)

        def done(sent: int) -> None:
            STATS["handed-off rows sent by their worker"] += sent  # how often the rule found one to send

        self.run(Op("worker_publish", fn, done), pick, hold)

    @rule(pick=PICK, hold=HOLD)
    @_when(has_idle)
    def handoff_ends(self, pick: int, hold: bool) -> None:
        """A handed-off successor left to the relay (`fanin_wake_relay`: its worker's publish failed, its report
        came from the worker's main process, or the handoff passed): the relay's claim may take it from now on,
        beside a worker that may still be publishing it."""

        def fn(conn: Connection) -> int:
            batch_id = _a_handed_off_batch(conn)
            if batch_id is None:
                return 0
            return int(conn.execute(q("wake_relay").text, {"batch": batch_id}).scalar_one())

        def done(woken: int) -> None:
            STATS["handed-off rows left to the relay"] += woken

        self.run(Op("handoff_ends", fn, done), pick, hold)

    def _exists(self, task_id: str) -> bool:
        with self.engine.connect() as conn:
            found = conn.execute(text("SELECT 1 FROM fanin_children WHERE task_id = :t"), {"t": task_id}).first()
        return found is not None

    def _successor_roots(self) -> list[Root]:
        """Roots seen finished (those have a successor to deliver), or any root if none is."""
        finished = [r for r in self.m.roots.values() if r.batch.id in self.m.final_batches]
        return finished or list(self.m.roots.values())

    @rule(
        which=PICK,
        wrong_id=st.sampled_from([False, False, False, True]),
        dead_owner=st.sampled_from(["no", "no", "own worker", "other worker"]),
        copy=st.sampled_from(["carrier", "carrier", "original", "stale carrier"]),
        pick=PICK,
        hold=HOLD,
    )
    @_when(has_root)
    def claim_run(self, which: int, wrong_id: bool, dead_owner: str, copy: str, pick: int, hold: bool) -> None:
        """A delivery of the successor (first, duplicate, redelivered, republished, a replacement's carrier or a
        copy of the message it replaced): the run guard (`claim_run`), and a refused delivery counted
        (`count_duplicate`). `dead_owner`: the delivery's worker says the holder's process is gone: its own
        worker's (only sent once it is: the worker checks), or a forger with another worker's key, who can read the
        holder from the table."""
        root: Root = self._pick(self._successor_roots(), which)
        batch = root.batch
        owner = f"owner-{uuid.uuid4().hex[:6]}"
        runs = self.m.runs[batch.id]
        carrier = {"carrier": runs.carrier, "original": None, "stale carrier": "stale-token"}[copy]
        holder = runs.owner.get(runs.live or 0)
        if dead_owner == "own worker" and not runs.dead:
            dead_owner = "no"
        holder_key = runs.key.get(runs.live or 0, WORKER_KEY)
        key = {"no": WORKER_KEY, "own worker": holder_key, "other worker": f"{holder_key}-forged"}[dead_owner]

        # A wrong id: another task's, or (after a rerun) a late copy of an earlier delivery, under the id it replaced.
        wrong = runs.earlier_ids[-1] if runs.earlier_ids and pick % 2 else "s-wrong"
        current = runs.task_id or batch.successor_task_id

        def fn(conn: Connection) -> successors.Run | successors.Refusal:
            got = successors.claim_run(
                Held(conn),
                batch.id,
                batch.step,
                wrong if wrong_id else current,
                0,
                lease=LEASE,
                grace=GRACE,
                owner=owner,
                owner_key=key,
                carrier=carrier,
                dead_owner=None if dead_owner == "no" else holder,
            )
            if isinstance(got, successors.Refusal) and got.state is not None:
                successors.count_duplicate(Held(conn), batch.id, batch.step)
            return got

        def done(got: successors.Run | successors.Refusal) -> None:
            if not isinstance(got, successors.Run):
                return
            runs = self.m.runs[batch.id]
            if wrong_id:
                raise Violation(f"a delivery with another task id ({wrong}) was admitted for batch {batch.id}")
            if runs.live is not None and not runs.dead:
                raise Violation(f"run {got.number} of batch {batch.id} admitted while run {runs.live} is live")
            if got.number != runs.admitted + 1:
                raise Violation(f"run {got.number} admitted after run {runs.admitted}")
            if runs.carrier is not None and carrier != runs.carrier:
                raise Violation(
                    f"run {got.number} of batch {batch.id} admitted a {copy} copy after a replacement handed over to "
                    f"its carrier"
                )
            runs.admitted, runs.live, runs.dead = got.number, got.number, False
            runs.carried[got.number], runs.owner[got.number], runs.key[got.number] = carrier, owner, key
            STATS["runs admitted"] += 1

        self.run(Op("claim_run", fn, done), pick, hold)

    def _ended(self, batch_id: uuid.UUID, state: str) -> None:
        """A committed write ended the successor as `state`. Noted at its commit, not only when the invariant next
        reads the database: a transaction waiting on that write's lock (a rerun) may commit before the invariant
        runs, and the model must already know what it waited for. The invariant checks the database agrees."""
        seen = self.m.final_successors.setdefault(batch_id, state)
        if seen != state:
            raise Violation(f"the successor of batch {batch_id}, final as {seen}, was ended again as {state}")

    def _running(self) -> list[tuple[Root, SuccessorModel]]:
        return [(r, self.m.runs[r.batch.id]) for r in self.m.roots.values() if self.m.runs[r.batch.id].admitted]

    def has_run(self) -> bool:
        return self.has_idle() and bool(self._running())

    @rule(
        which=PICK,
        how=st.sampled_from(
            [
                "retrying",
                "requeued",
                "replaced",
                "take_back",
                "renew",
                "succeeded",
                "failed",
                "revoked",
                "ignored",
                "main:failed",
                "main:revoked",
                "main-ran:failed",
                "main-ran-elsewhere:failed",
            ]
        ),
        stale=st.sampled_from([False, False, False, True]),
        pick=PICK,
        hold=HOLD,
    )
    @_when(has_run)
    def end_run(self, which: int, how: str, stale: bool, pick: int, hold: bool) -> None:
        """A run's later writes, fenced by its number: a retry / requeue / replacement hands it over (`hand_over`,
        `take_back`), the heartbeat renews it (`renew_leases`), the body ends (`record_state`). The worker's main
        process ends one copy of the message without a run number: `main:` a copy that never ran (expired, revoked
        unstarted, unknown, undecodable: the original message or the current carrier), `main-ran:` the copy that
        ran in the process holding run `number` (a hard time limit, a lost process), `main-ran-elsewhere:` one
        that ran in another process of that worker. `stale`: the write of an earlier run, which must be fenced
        off."""
        root, runs = self._pick(self._running(), which)
        batch = root.batch
        number = runs.admitted - 1 if stale else (runs.handed if how == "take_back" else runs.admitted)
        if number is None or number < 1:
            return
        run = successors.Run(batch.id, batch.step, number, 0)
        token = f"carrier-{uuid.uuid4().hex[:6]}"
        copy_carrier = runs.carrier if stale else None  # an event about the carrier's copy, or the original's
        holder = runs.owner.get(number, "")
        elsewhere = how.startswith("main-ran-elsewhere:")
        ran_in = (
            (holder.rpartition("-")[0] + "-other-" if elsewhere else holder) if how.startswith("main-ran") else None
        )
        live_before = runs.live is not None and not runs.dead
        # An event about a copy of the message: the current delivery's, or (stale, after a rerun) an earlier one's.
        earlier = stale and bool(runs.earlier_ids)
        copy_id = runs.earlier_ids[-1] if earlier else (runs.task_id or batch.successor_task_id)

        def fn(conn: Connection) -> bool:
            if how in successors.HANDED_OVER_STATES:
                return successors.hand_over(Held(conn), run, how, carrier=token if how == "replaced" else None)
            if how == "take_back":
                return successors.take_back(Held(conn), run, LEASE, runs.carried.get(number))
            if how == "renew":
                return bool(successors.renew_leases(Held(conn), [run], LEASE))
            if how.startswith("main"):
                return successors.record_state(
                    Held(conn),
                    batch.id,
                    batch.step,
                    how.partition(":")[2],
                    task_id=copy_id,
                    carrier=copy_carrier,
                    ran_in=ran_in,
                    owner_key=runs.key.get(number) if ran_in is not None else None,
                )
            return successors.record_state(Held(conn), batch.id, batch.step, how, run=number)

        def done(moved: bool) -> None:
            if moved and how.startswith("main") and earlier:
                raise Violation(f"an event about a delivery a rerun replaced ({how}) moved {batch.id}'s successor")
            if moved and not how.startswith("main") and number != runs.admitted:
                raise Violation(f"run {number} of batch {batch.id} wrote ({how}) after run {runs.admitted} began")
            # Live when the event was made and still live now, at its commit: a run that ended meanwhile (the
            # event's statement waited on its lock) leaves a successor no run holds, which such an event may end.
            live_now = runs.live is not None and not runs.dead
            if moved and live_before and live_now and (how.startswith("main:") or elsewhere):
                raise Violation(
                    f"an event about a copy that did not run it ({how}) ended live run {runs.live} of batch {batch.id}"
                )
            if moved and how.startswith("main:") and runs.carrier is not None and copy_carrier != runs.carrier:
                raise Violation(
                    f"an event about a copy of a replaced message ({how}) ended batch {batch.id}'s successor"
                )
            if not moved:
                return
            if how in successors.HANDED_OVER_STATES:
                runs.live, runs.handed = None, number
                if how == "replaced":
                    runs.carrier = token
            elif how == "take_back":
                runs.live, runs.handed = number, None
                runs.carrier = runs.carried.get(number)
            elif how != "renew":
                runs.live = None
                self._ended(batch.id, how.rpartition(":")[2])

        self.run(Op(f"end_run({how}{', stale' if stale else ''})", fn, done), pick, hold)

    @rule(which=PICK, pick=PICK, hold=HOLD)
    @_when(has_root)
    def replacement_bound(self, which: int, pick: int, hold: bool) -> None:
        """The relay's bound for a replaced successor (`fanin_replaced_timeout`, here 0 s) acting on any successor, as
        on an entry of a scan read before the successor moved on (`lost_replacements`, then a transaction of its
        own): the function checks again that it was replaced and that no carrier run holds a live lease."""
        root: Root = self._pick(self._successor_roots(), which)
        batch = root.batch
        runs = self.m.runs[batch.id]
        live_before = runs.live is not None and not runs.dead

        def fn(conn: Connection) -> bool:
            return successors.fail_lost_replacement(conn, batch.id, batch.step, 0.0, "lost")

        def done(moved: bool) -> None:
            if not moved:
                return
            if runs.carrier is None:
                raise Violation(f"batch {batch.id}'s successor, never replaced, was failed as a lost replacement")
            if live_before and runs.live is not None and not runs.dead:  # live then, and still (see end_run)
                raise Violation(f"the replacement bound ended batch {batch.id}'s live carrier run {runs.live}")
            runs.live = None
            self._ended(batch.id, "failed")

        self.run(Op("replacement_bound", fn, done), pick, hold)

    @rule(
        which=PICK,
        stale=st.sampled_from([False, False, True]),
        how=st.sampled_from(["failed", "revoked"]),
        pick=PICK,
        hold=HOLD,
    )
    @_when(has_root)
    def replacement_part_ends(self, which: int, stale: bool, how: str, pick: int, hold: bool) -> None:
        """A task of a successor's replacement before its carrier (a part: a chain's earlier task, a chord's header
        task) failed or was revoked, so its carrier will not come (`fanin_end_replacement`), on any successor: the
        part brings the token of the replacement it belongs to, the current one's or (`stale`) an earlier one's. It
        may end only a successor replaced with that token that no carrier run holds."""
        root: Root = self._pick(self._successor_roots(), which)
        batch = root.batch
        runs = self.m.runs[batch.id]
        token = runs.carrier if runs.carrier is not None and not stale else "carrier-of-an-earlier-replacement"
        live_before = runs.live is not None and not runs.dead
        task_id = runs.task_id or batch.successor_task_id

        def fn(conn: Connection) -> bool:
            return successors.end_replacement(
                Held(conn), batch.id, batch.step, task_id, token, how, "ValueError", "part"
            )

        def done(moved: bool) -> None:
            if not moved:
                return
            if token != runs.carrier:
                raise Violation(f"a part of another replacement ({token}) ended batch {batch.id}'s successor")
            if live_before and runs.live is not None and not runs.dead:  # live then, and still (see end_run)
                raise Violation(f"a part's {how} ended batch {batch.id}'s live carrier run {runs.live}")
            runs.live = None
            self._ended(batch.id, how)

        self.run(Op(f"replacement_part_ends({how}{', stale' if stale else ''})", fn, done), pick, hold)

    @rule(which=PICK, pick=PICK, hold=HOLD)
    @_when(has_root)
    def operator_rerun(self, which: int, pick: int, hold: bool) -> None:
        """An operator reruns the successor (`fanin rerun`, `fanin_rerun_successor`) under a new task id, whatever
        state it is in: only a failed or revoked one may go back to pending, with the next run number to come and
        every earlier delivery's id refused from then on."""
        roots = self._successor_roots()
        # Mostly a successor seen failed or revoked (a rerun that goes ahead), sometimes any (one to refuse).
        ended = [r for r in roots if self.m.final_successors.get(r.batch.id) in ("failed", "revoked")]
        root: Root = self._pick(ended if ended and pick % 4 else roots, which)
        batch = root.batch
        runs = self.m.runs[batch.id]
        new_id = f"rerun-{uuid.uuid4().hex[:8]}"

        def fn(conn: Connection) -> tuple[Any, ...]:
            return successors.rerun(conn, batch.id, batch.step, new_id, "model")

        def done(got: tuple[Any, ...]) -> None:
            number, _state, previous, previous_state = got
            if number is None:
                return
            if previous_state not in ("failed", "revoked"):
                raise Violation(f"a rerun of batch {batch.id}'s successor reset it from {previous_state}")
            if self.m.final_successors.get(batch.id) not in ("failed", "revoked"):
                raise Violation(
                    f"a rerun of batch {batch.id}'s successor was admitted while the model saw it "
                    f"{self.m.final_successors.get(batch.id, 'not final')}"
                )
            if runs.live is not None and not runs.dead:
                raise Violation(f"a rerun of batch {batch.id}'s successor reset it under live run {runs.live}")
            if previous != (runs.task_id or batch.successor_task_id):
                raise Violation(f"a rerun of batch {batch.id} replaced task id {previous}, not the current one")
            runs.earlier_ids.append(previous)
            runs.task_id, runs.carrier, runs.live, runs.handed = new_id, None, None, None
            del self.m.final_successors[batch.id]  # pending again, by an operator's decision
            STATS["reruns"] += 1

        self.run(Op("operator_rerun", fn, done), pick, hold)

    @rule(which=PICK)
    @_when(has_run)
    def holder_dies(self, which: int) -> None:
        """The process holding a run dies (SIGKILL, OOM) and its lease still looks live: its own worker may now
        say so to the guard (`claim_run`'s `dead_owner`, which that worker checks before saying it)."""
        _, runs = self._pick(self._running(), which)
        if runs.live is not None:
            runs.dead = True

    @rule(which=PICK, pick=PICK)
    @_when(has_run)
    def lapse(self, which: int, pick: int) -> None:
        """Time passes for one run: its lease lapses past the grace (its worker died or lost the database)."""
        root, runs = self._pick(self._running(), which)

        def fn(conn: Connection) -> bool:
            moved = conn.execute(
                text(
                    "UPDATE fanin_successors SET lease_until = now() - interval '1 day' "
                    "WHERE batch_id = :id AND state = 'running'"
                ),
                {"id": root.batch.id},
            ).rowcount
            return bool(moved)

        def done(moved: bool) -> None:
            if moved:
                runs.dead = True

        self.run(Op("lapse", fn, done), pick)

    # --- retention ---------------------------------------------------------------------------------------------

    @rule(pick=PICK, hold=HOLD)
    @_when(has_idle)
    def prune(self, pick: int, hold: bool) -> None:
        """One of prune's transactions (`ops/retention.py:_one_transaction`) with age 0: finished batches whose
        successor finished; a tree's leaves first, then its root."""

        def fn(conn: Connection) -> tuple[list[uuid.UUID], uuid.UUID | None]:
            roots = admin.lock_prunable(conn, 0.0, 5)
            chosen: list[uuid.UUID] = []
            for r in roots:
                if r.leaves:
                    if chosen:
                        break
                    picked = [leaf_id for leaf_id, _ in admin.lock_leaves(conn, r.id, 5)]
                    if not picked:
                        continue
                    admin.delete_batches(conn, picked)
                    return [], r.id
                chosen.append(r.id)
            admin.delete_batches(conn, chosen)
            return chosen, None

        def done(result: tuple[list[uuid.UUID], uuid.UUID | None]) -> None:
            deleted, thinned = result
            if thinned is not None:
                self.m.pruning.add(thinned)  # its leaves went first: the root itself goes in a later transaction
            for batch_id in deleted:
                self.m.roots.pop(batch_id, None)
                for task_id in [t for t, c in self.m.children.items() if c.root == batch_id]:
                    del self.m.children[task_id]

        self.run(Op("prune", fn, done), pick, hold)

    # --- holding and releasing transactions --------------------------------------------------------------------

    def has_holder(self) -> bool:
        return any(s.holding for s in self.sessions)

    @rule(which=PICK, commit=st.sampled_from([True, True, True, False]))
    @_when(has_holder)
    def release(self, which: int, commit: bool) -> None:
        """End a held transaction (commit, or roll it back); the sessions waiting on its locks go on."""
        holders = [s for s in self.sessions if s.holding]
        self._pick(holders, which).release(commit=commit)
        self._settle()

    @initialize(n=st.integers(1, 4), opts=OPTIONS, leaves=st.sampled_from([0, 1, 2]))
    def seed(self, n: int, opts: dict[str, Any], leaves: int) -> None:
        """Every case starts with a batch to work on (and the rules can create more)."""
        self.create.__wrapped__(self, n=n, opts=opts, leaves=leaves, pick=0, hold=False)  # type: ignore[attr-defined]

    # --- invariants ---------------------------------------------------------------------------------------------

    @invariant()
    def protocol_holds(self) -> None:
        try:
            self._drain()
            check_database(self.checker, self.m)
        except BaseException:
            _record_failure("invariant protocol_holds")
            raise
        finally:
            self.checker.rollback()


class SuccessorGuardMachine(ProtocolMachine):
    """The run guard alone, on batches that finish as they are created (empty ones, whose successor is written with
    them): every rule left is a delivery of a successor's message or a copy of it, the end of a run or an event
    about a copy, a holder's death, or the relay's scan and republish. In the whole model a successor is reached only
    after its children are counted, so the states these rules need (a replaced successor, a live run and a copy's
    event) come up too rarely in a CI budget to find a breakage of them; here a few dozen steps do."""

    @initialize(
        opts=OPTIONS,
        n=st.integers(1, 2),
        start=st.sampled_from(["carried", "replaced", "sent"]),
        nested=st.sampled_from([False, False, True]),
    )
    def seed(self, opts: dict[str, Any], n: int, start: str, nested: bool = False) -> None:
        """The batches, the first one's successor already `start`: `replaced` (its first run handed over to a
        carrier) or `carried` (that carrier's run live). Those states take three steps that each draw one option of
        many, so a search of a CI budget reached them in too few examples (2026-12-04) to find breakages of them.
        `nested`: the first batch is a nested fan-in standing for the one child of an outer batch, so that its
        successor's end completes that batch (the whole model reaches that in too few examples as well)."""
        create = self.create.__wrapped__  # type: ignore[attr-defined]
        if nested:
            create(self, n=1, opts=opts, leaves=0, pick=0, hold=False)
        for i in range(n):
            create(self, n=0, opts=opts, leaves=0, pick=0, hold=False, nest=nested and i == 0)
        if start == "sent":
            return
        first = list(self.m.roots.values())[1 if nested else 0]
        claim = getattr(ProtocolMachine.claim_run, "__wrapped__")  # noqa: B009 - the rule's own function
        roots = [r.batch.id for r in self._successor_roots()]
        if first.batch.id not in roots:
            return
        which = roots.index(first.batch.id)
        claim(self, which=which, wrong_id=False, dead_owner="no", copy="carrier", pick=0, hold=False)
        running = [r.batch.id for r, _ in self._running()]
        if first.batch.id not in running:
            return
        end = getattr(ProtocolMachine.end_run, "__wrapped__")  # noqa: B009
        end(self, which=running.index(first.batch.id), how="replaced", stale=False, pick=0, hold=False)
        if start == "carried":
            claim(self, which=which, wrong_id=False, dead_owner="no", copy="carrier", pick=0, hold=False)

    @rule(opts=OPTIONS, pick=PICK, hold=HOLD)
    def create_empty(self, opts: dict[str, Any], pick: int, hold: bool) -> None:
        """Another batch, finished as it is written: a successor no run has held yet."""
        self.create.__wrapped__(self, n=0, opts=opts, leaves=0, pick=pick, hold=hold)  # type: ignore[attr-defined]

    # Drawn as often again as the other rules: a run's end is what lets the next delivery in.
    end_run_again = rule(**getattr(ProtocolMachine.end_run, RULE_MARKER).arguments)(
        getattr(ProtocolMachine.end_run, RULE_MARKER).function
    )


# Not rules of the guard's machine (an attribute without hypothesis's rule marker is not drawn).
for _name in (
    "create",
    "create_stream",
    "stream_chunk",
    "stream_seal",
    "operator_seal",
    "start",
    "report",
    "report_again",
    "expire",
    "reconcile",
    "worker_publish",
    "handoff_ends",
    "prune",
):
    setattr(SuccessorGuardMachine, _name, getattr(ProtocolMachine, _name).__wrapped__)


def _a_handed_off_batch(conn: Connection) -> uuid.UUID | None:
    """A batch whose successor is handed to a worker (unsent, not yet due for the relay), if there is one."""
    found: uuid.UUID | None = conn.execute(
        text("SELECT batch_id FROM fanin_outbox WHERE sent_at IS NULL AND available_at > now() LIMIT 1")
    ).scalar()
    return found


# One snapshot of every batch with what its children and leaves say, for the invariants.
_BATCHES = """
SELECT b.id, b.parent_id, b.state, b.planned, b.remaining, b.succeeded, b.failed, b.fail_up, b.step,
       b.on_expire_message IS NOT NULL AS has_on_expire, b.on_failure_message IS NOT NULL AS has_on_failure,
       d.created, d.open, d.succ, d.fail,
       coalesce(l.planned, 0) AS l_planned, coalesce(l.unfinished, 0) AS l_unfinished,
       coalesce(l.succ, 0) AS l_succ, coalesce(l.fail, 0) AS l_fail, coalesce(l.n, 0) AS l_n,
       coalesce(t.succ, 0) AS t_succ, coalesce(t.fail, 0) AS t_fail
  FROM fanin_batches b
  CROSS JOIN LATERAL (
        SELECT count(*) AS created, count(*) FILTER (WHERE c.state IN ('pending', 'started')) AS open,
               count(*) FILTER (WHERE c.state = 'succeeded') AS succ,
               count(*) FILTER (WHERE c.state NOT IN ('pending', 'started', 'succeeded')) AS fail
          FROM fanin_children c WHERE c.batch_id = b.id) d
  LEFT JOIN LATERAL (
        SELECT sum(x.planned) AS planned, count(*) FILTER (WHERE x.state IN ('open', 'running')) AS unfinished,
               sum(x.succeeded) FILTER (WHERE x.state NOT IN ('open', 'running')) AS succ,
               sum(x.failed) FILTER (WHERE x.state NOT IN ('open', 'running') OR x.fail_up) AS fail,
               count(*) AS n
          FROM fanin_batches x WHERE x.parent_id = b.id) l ON true
  LEFT JOIN LATERAL (
        SELECT count(*) FILTER (WHERE c.state = 'succeeded') AS succ,
               count(*) FILTER (WHERE c.state NOT IN ('pending', 'started', 'succeeded')) AS fail
          FROM fanin_children c JOIN fanin_batches x ON x.id = c.batch_id
         WHERE x.id = b.id OR x.parent_id = b.id) t ON true
"""


def check_database(conn: Connection, m: Model) -> None:
    """Every invariant of issue 26, on one consistent snapshot of the database (`conn` is REPEATABLE READ)."""
    problems: list[str] = []
    rows = [dict(r) for r in conn.execute(text(_BATCHES)).mappings()]
    succ_rows = conn.execute(
        text(
            "SELECT s.batch_id, s.step, s.state, s.kind, s.runs, "
            "(SELECT count(*) FROM fanin_outbox o WHERE o.batch_id = s.batch_id AND o.step = s.step) AS outbox "
            "FROM fanin_successors s"
        )
    ).all()
    orphan_outbox = conn.execute(
        text(
            "SELECT o.id FROM fanin_outbox o WHERE NOT EXISTS "
            "(SELECT 1 FROM fanin_successors s WHERE s.batch_id = o.batch_id AND s.step = o.step)"
        )
    ).all()
    states = {b["id"]: b["state"] for b in rows}
    by_batch: dict[uuid.UUID, list[Any]] = {}
    for s in succ_rows:
        by_batch.setdefault(s.batch_id, []).append(s)
    for b in rows:
        bid, state = b["id"], b["state"]
        if bid in m.pruning or b["parent_id"] in m.pruning:
            continue
        where = f"batch {bid} ({'leaf' if b['parent_id'] else 'root'}, {state})"
        token = 1 if state == "open" else 0
        if state == "failed_threshold" and b["remaining"] == b["open"] + b["l_unfinished"] + 1:
            token = 1  # it passed its threshold while open: the token goes when the relay stops it
        if b["remaining"] < 0:
            problems.append(f"{where}: remaining {b['remaining']} < 0")
        if b["planned"] != b["created"] + b["l_planned"]:
            problems.append(f"{where}: planned {b['planned']} but {b['created'] + b['l_planned']} children exist")
        expect = (b["open"] + b["l_unfinished"] + token, b["succ"] + b["l_succ"], b["fail"] + b["l_fail"])
        got = (b["remaining"], b["succeeded"], b["failed"])
        if got != expect:
            problems.append(
                f"{where}: counters (remaining, succeeded, failed) = {got}, its children and leaves say {expect}"
            )
        if not b["l_n"] and b["succeeded"] + b["failed"] + b["remaining"] != b["planned"] + token:
            problems.append(
                f"{where}: succeeded {b['succeeded']} + failed {b['failed']} + remaining {b['remaining']} "
                f"!= planned {b['planned']}" + (" + its producer's token" if token else "")
            )
        # (A root that passed its threshold while open keeps its open leaves until the relay stops it.)
        if b["parent_id"] is not None and state == "open" and states.get(b["parent_id"]) not in LEAVES_MAY_BE_OPEN:
            problems.append(f"{where}: left open under a {states.get(b['parent_id'])} root (it can never finish)")
        if state == "running" and b["remaining"] == 0:
            problems.append(f"{where}: running with nothing left to wait for")
        if state in ("complete", "partial", "expired", "cancelled") and b["remaining"] != 0:
            problems.append(f"{where}: finished with remaining {b['remaining']}")
        found = by_batch.get(bid, [])
        if len({s.step for s in found}) != len(found):
            problems.append(f"{where}: {len(found)} successor rows for one step")
        if b["parent_id"] is not None:
            if found:
                problems.append(f"{where}: a leaf has a successor")
        else:
            want = state in ("complete", "partial", "failed_threshold") or (
                state in ("expired", "cancelled") and b["has_on_expire"]
            )
            if want != bool(found):
                problems.append(f"{where}: {'no' if want else 'a'} successor row")
            for s in found:
                if s.outbox != 1:
                    problems.append(f"{where}: its successor has {s.outbox} outbox rows")
            node = admin.node(conn, bid)
            assert node is not None
            if (node.succeeded, node.failed) != (b["t_succ"], b["t_fail"]):
                problems.append(
                    f"{where}: status shows succeeded, failed = {(node.succeeded, node.failed)}, "
                    f"its children say {(b['t_succ'], b['t_fail'])}"
                )
        if state in FINAL_BATCH:
            seen = m.final_batches.setdefault(bid, state)
            if seen != state:
                problems.append(f"{where}: was final as {seen}, is now {state}")
        elif bid in m.final_batches:
            problems.append(f"{where}: was final as {m.final_batches[bid]}, is now {state}")
    for s in succ_rows:
        if s.state in FINAL_SUCCESSOR:
            seen = m.final_successors.setdefault(s.batch_id, s.state)
            if seen != s.state:
                problems.append(f"successor of {s.batch_id} was final as {seen}, is now {s.state}")
        elif s.batch_id in m.final_successors:
            problems.append(f"successor of {s.batch_id} was {m.final_successors[s.batch_id]}, is now {s.state}")
        runs = m.runs.get(s.batch_id)
        if runs is not None and s.runs != runs.admitted:
            problems.append(f"successor of {s.batch_id} has runs = {s.runs}, the model admitted {runs.admitted}")
    if orphan_outbox:
        problems.append(f"outbox rows without a successor: {[r[0] for r in orphan_outbox]}")
    # Handed to a worker (not yet due for the relay, never tried): only a successor that a report of a worker that
    # publishes it created. Any other (a nested successor's end completing the outer batch, a seal, reconciliation,
    # recovery) is the relay's at once, or nobody publishes it for the handoff's length.
    handed = conn.execute(
        text("SELECT batch_id FROM fanin_outbox WHERE sent_at IS NULL AND attempts = 0 AND available_at > now()")
    ).scalars()
    for bid in handed:
        if bid not in m.handed and bid not in m.pruning:
            problems.append(f"batch {bid}'s successor is handed to a worker, but no worker's report created it")
    for task_id, n in m.counted.items():
        if n > 1:
            problems.append(f"child {task_id} counted {n} times")
    if problems:
        raise Violation("; ".join(problems))


def _record_failure(where: str) -> None:
    """Keep the error being handled (with the step it came from) in FAILURES."""
    import sys
    import traceback

    error = sys.exc_info()[1]
    assert error is not None
    FAILURES.append(Failure(where, error, traceback.format_exc()))


def _recorded(fn: Any) -> Any:
    @functools.wraps(fn)
    def step(self: Any, **kwargs: Any) -> Any:
        try:
            return fn(self, **kwargs)
        except BaseException:
            _record_failure(f"rule {fn.__name__}({kwargs})")
            raise

    return step


# Every rule records its error (hypothesis's Rule objects are shared by the subclasses the tests make).
for _rule in (*ProtocolMachine.setup_state().rules, *ProtocolMachine.setup_state().initializers):
    _rule.function = _recorded(_rule.function)
