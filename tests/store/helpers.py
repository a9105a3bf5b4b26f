"""Plain helpers for the store tests: building batches, reading tables and broker messages, racing workers.

The worker functions at the bottom run in spawned processes, so they live in an importable module (not in a test
file) and take only picklable arguments.
"""

from __future__ import annotations

import base64
import json
import multiprocessing
import queue as queue_module
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
import redis
from celery import Celery, Task
from sqlalchemy import Connection, Engine, create_engine, text

from celery_fanin import codec
from celery_fanin.context import normalise_database_url
from celery_fanin.store import batches, migrate
from celery_fanin.store.reports import record_terminal
from tests.sql import Held

TABLES = ("fanin_batches", "fanin_children", "fanin_successors", "fanin_outbox")
QUEUE = "celery"  # the default queue; on the Redis transport its messages are a list under this key


@dataclass(frozen=True)
class Tasks:
    add: Task
    collect: Task


def define_tasks(app: Celery) -> Tasks:
    """Two tasks on `app`: children add, the successor collects (its first argument is the batch outcome)."""

    @app.task(name="tests.store.add", shared=False)
    def add(x: int, y: int) -> int:
        return x + y

    @app.task(name="tests.store.collect", shared=False)
    def collect(outcome: dict[str, Any], *args: Any, **kwargs: Any) -> dict[str, Any]:
        return outcome

    return Tasks(add, collect)


def collecting_batch(app: Celery, tasks: Tasks, **options: Any) -> batches.NewBatch:
    """A batch row whose successor is `tasks.collect`, encoded for `app` (its children are the caller's)."""
    return batches.NewBatch(
        id=uuid.uuid4(),
        step="merge",
        successor_task_id=f"succ-{uuid.uuid4()}",
        successor_name="tests.store.collect",
        successor_message=codec.encode_signature(app, tasks.collect.s()),
        **options,
    )


def make_engine(url: str, pool_size: int = 5) -> Engine:
    """An engine like the one `FanIn` builds: psycopg 3, READ COMMITTED (the store's transactions need it)."""
    return create_engine(
        normalise_database_url(url), pool_size=pool_size, max_overflow=0, isolation_level="READ COMMITTED"
    )


def json_encoded(value: Any) -> batches.Encoded:
    return batches.Encoded("application/json", "utf-8", json.dumps(value).encode())


def _signature_dict(task: str, *args: Any) -> dict[str, Any]:
    """What `dict(task.s(*args))` encodes to: decodable by `codec.decode_signature`, publishable by name."""
    return {"task": task, "args": list(args), "kwargs": {}, "options": {}, "subtask_type": None, "immutable": False}


def new_batch(
    n: int, *, step: str = "merge", successor_name: str = "t.collect"
) -> tuple[batches.NewBatch, list[batches.NewChild]]:
    """A batch of `n` children with unique task ids; its messages name tasks no app defines (sent by name only)."""
    batch_id = uuid.uuid4()
    prefix = f"c-{batch_id.hex[:8]}"
    batch = batches.NewBatch(
        id=batch_id,
        step=step,
        successor_task_id=f"s-{batch_id.hex}",
        successor_name=successor_name,
        successor_message=json_encoded(_signature_dict(successor_name)),
    )
    children = [
        batches.NewChild(f"{prefix}-{i}", "t.child", json_encoded(_signature_dict("t.child", i))) for i in range(n)
    ]
    return batch, children


def create(engine: Engine, n: int, **kwargs: Any) -> tuple[batches.NewBatch, list[batches.NewChild], int | None]:
    """Create a batch of `n` children in its own transaction; returns it, its children and its outbox id (if any)."""
    batch, children = new_batch(n, **kwargs)
    with engine.begin() as conn:
        outbox_id = batches.create_batch(conn, batch, children)
    return batch, children, outbox_id


def row_counts(engine: Engine) -> dict[str, int]:
    with engine.connect() as conn:
        return {t: conn.execute(text(f"SELECT count(*) FROM {t}")).scalar_one() for t in TABLES}  # constant names


def fetch_one(conn: Connection, sql: str, **params: Any) -> dict[str, Any]:
    return dict(conn.execute(text(sql), params).mappings().one())


def fetch_all(conn: Connection, sql: str, **params: Any) -> list[dict[str, Any]]:
    return [dict(r) for r in conn.execute(text(sql), params).mappings()]


def snapshot(
    engine: Engine, batch_id: uuid.UUID, ignore: frozenset[str] = frozenset()
) -> dict[str, list[dict[str, Any]]]:
    """Every row that belongs to one batch, in a stable order, without the `ignore` columns (for "nothing changed")."""
    with engine.connect() as conn:
        tables = {
            "batch": fetch_all(conn, "SELECT * FROM fanin_batches WHERE id = :id", id=batch_id),
            "children": fetch_all(conn, "SELECT * FROM fanin_children WHERE batch_id = :id ORDER BY idx", id=batch_id),
            "successors": fetch_all(conn, "SELECT * FROM fanin_successors WHERE batch_id = :id", id=batch_id),
            "outbox": fetch_all(conn, "SELECT * FROM fanin_outbox WHERE batch_id = :id", id=batch_id),
        }
    return {name: [{k: v for k, v in row.items() if k not in ignore} for row in rows] for name, rows in tables.items()}


@dataclass(frozen=True)
class BrokerMessage:
    headers: dict[str, Any]
    args: list[Any]
    kwargs: dict[str, Any]
    embed: dict[str, Any]
    envelope: dict[str, Any]


def queued_messages(client: redis.Redis, queue: str = QUEUE) -> list[BrokerMessage]:
    """The task messages waiting in a Redis-transport queue, oldest first, with their protocol-2 bodies decoded."""
    messages = []
    for raw in reversed(client.lrange(queue, 0, -1)):  # LPUSH: the newest is at the head
        envelope = json.loads(raw)
        body = envelope["body"]
        if envelope["properties"].get("body_encoding") == "base64":
            body = base64.b64decode(body)
        args, kwargs, embed = json.loads(body)
        messages.append(BrokerMessage(envelope["headers"], args, kwargs, embed, envelope))
    return messages


def wait_for(predicate: Callable[[], bool], timeout: float, what: str, interval: float = 0.02) -> None:
    """Poll `predicate` until it holds; fail with `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def notifications_until_sentinel(listener: psycopg.Connection, notify_url: str, timeout: float = 10.0) -> list[str]:
    """Payloads on `fanin_outbox` that arrived before a sentinel this call sends now.

    Notifications are delivered in commit order, so once the sentinel (committed after everything the caller did)
    has arrived, every earlier notification has too: no timing window decides the count.
    """
    sentinel = f"sentinel-{uuid.uuid4().hex}"
    with psycopg.connect(notify_url, autocommit=True) as conn:
        conn.execute("SELECT pg_notify('fanin_outbox', %s)", (sentinel,))
    payloads: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for note in listener.notifies(timeout=max(0.0, deadline - time.monotonic())):
            if note.payload == sentinel:
                return payloads
            payloads.append(note.payload)
    raise AssertionError(f"the sentinel notification did not arrive within {timeout}s (got {payloads!r})")


def report(engine: Engine, task_id: str, state: str = "succeeded", **kwargs: Any) -> batches.TerminalRecord:
    """One child's terminal report in a transaction of its own, through the worker's statement
    (`store.reports.record_terminal`; `kwargs`: its result, error, claim)."""
    with engine.begin() as conn:
        return record_terminal(Held(conn), task_id, state, **kwargs)


# --- racing reporters --------------------------------------------------------------------------------------------

Report = tuple[str, str]  # (task_id, terminal state)
Outcome = tuple[str, str, bool, int | None, bool]  # (task_id, state, counted, remaining, successor_created)


def report_all(conn: Connection, reports: Sequence[Report]) -> list[Outcome]:
    """Report each child on `conn`, one transaction per report (as the worker hooks do)."""
    out: list[Outcome] = []
    for task_id, state in reports:
        with conn.begin():
            rec = record_terminal(
                Held(conn),
                task_id,
                state,
                result=json_encoded({"task_id": task_id}) if state == "succeeded" else None,
                exc_type=None if state == "succeeded" else "RuntimeError",
                exc_message=None if state == "succeeded" else f"{task_id} ended {state}",
            )
        out.append((task_id, state, rec.counted, rec.remaining, rec.successor_created))
    return out


def deal(reports: Sequence[Report], hands: int) -> list[list[Report]]:
    """Deal reports round-robin, so that neighbouring reports (copies of one child) race in different hands."""
    return [list(reports[i::hands]) for i in range(hands)]


def race_threads(engine: Engine, hands: Sequence[Sequence[Report]], timeout: float = 30.0) -> list[Outcome]:
    """Run each hand in its own thread on its own connection, all released together by a barrier."""
    barrier = threading.Barrier(len(hands), timeout=timeout)
    results: list[list[Outcome]] = [[] for _ in hands]
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            with engine.connect() as conn:
                conn.execute(text("SELECT 1")).scalar_one()  # connected before the start line
                conn.rollback()
                barrier.wait()
                results[i] = report_all(conn, hands[i])
        except BaseException as exc:  # surfaced in the main thread
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(i,), name=f"reporter-{i}") for i in range(len(hands))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a reporter thread did not finish"
    if errors:
        raise errors[0]
    return [o for r in results for o in r]


def run_spawned(target: Callable[..., None], arg_lists: Sequence[tuple[Any, ...]], timeout: float = 60.0) -> list[Any]:
    """Start one spawned process per argument tuple (each also gets a shared barrier and result queue).

    Returns each process's result in completion order; fails fast if a process reports an error or dies without
    reporting, rather than waiting out the timeout.
    """
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(len(arg_lists))
    results = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args, barrier, results), daemon=True) for args in arg_lists]
    for p in procs:
        p.start()
    collected: list[Any] = []
    deadline = time.monotonic() + timeout
    try:
        while len(collected) < len(procs):
            try:
                kind, value = results.get(timeout=0.1)
            except queue_module.Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead and results.empty():
                    raise AssertionError(f"a spawned process died without reporting (exit codes {dead})") from None
                if time.monotonic() >= deadline:
                    raise AssertionError(f"spawned processes did not report within {timeout}s") from None
                continue
            if kind != "ok":
                raise AssertionError(f"a spawned process failed: {value}")
            collected.append(value)
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)
    return collected


def process_reporter(url: str, reports: list[Report], barrier: Any, queue: Any) -> None:
    """Spawned-process body: its own engine and connection, wait for the others, report, send the outcomes back."""
    engine = make_engine(url, pool_size=1)
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1")).scalar_one()
            conn.rollback()
            barrier.wait(30)
            queue.put(("ok", report_all(conn, reports)))
    except BaseException as exc:
        queue.put(("error", repr(exc)))
        raise
    finally:
        engine.dispose()


def process_migrator(url: str, barrier: Any, queue: Any) -> None:
    """Spawned-process body: migrate with an engine of its own once every process is at the start line."""
    engine = make_engine(url, pool_size=1)
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1")).scalar_one()
        barrier.wait(30)
        queue.put(("ok", [m.version for m in migrate.migrate(engine)]))
    except BaseException as exc:
        queue.put(("error", repr(exc)))
        raise
    finally:
        engine.dispose()
