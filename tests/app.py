"""The Celery app that the end-to-end tests run in real `celery worker` subprocesses.

Configuration comes from the environment the tests give each subprocess. The successor task `record_run`
writes every run of its body to `e2e_successor_runs`, so "the successor ran exactly once" is what the successor
itself recorded, not something inferred from counters.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import time
from typing import Any

import psycopg
import redis
from celery import Celery, bootsteps, group
from celery.exceptions import Reject
from celery.worker.control import inspect_command

from celery_fanin import BatchOutcome, FanIn
from celery_fanin.store.reports import libpq_conninfo

BROKER_URL = os.environ.get("FANIN_TEST_BROKER", "redis://127.0.0.1:6379/15")

app = Celery("tests.app", broker=BROKER_URL)
app.conf.update(
    fanin_database_url=os.environ.get("FANIN_DATABASE_URL"),
    fanin_relay_poll_interval=0.2,
    fanin_reaper_interval=float(os.environ.get("FANIN_TEST_REAPER_INTERVAL", "1")),
    fanin_reconcile_interval=float(os.environ.get("FANIN_TEST_RECONCILE_INTERVAL", "300")),
    fanin_successor_timeout=float(os.environ.get("FANIN_TEST_SUCCESSOR_TIMEOUT", "600")),
    fanin_successor_lease=float(os.environ.get("FANIN_TEST_SUCCESSOR_LEASE", "60")),
    fanin_successor_lease_grace=float(os.environ.get("FANIN_TEST_SUCCESSOR_LEASE_GRACE", "60")),
    fanin_expires_grace=float(os.environ.get("FANIN_TEST_EXPIRES_GRACE", "30")),
    fanin_report_timeout=float(os.environ.get("FANIN_TEST_REPORT_TIMEOUT", "300")),
    fanin_track_started=os.environ.get("FANIN_TEST_TRACK_STARTED", "1") == "1",
    fanin_open_batch_grace=float(os.environ.get("FANIN_TEST_OPEN_BATCH_GRACE", "300")),
    task_default_queue=os.environ.get("FANIN_TEST_QUEUE", "celery"),
    fanin_max_depth=int(os.environ.get("FANIN_TEST_MAX_DEPTH", "8")),
    fanin_chord_max_bytes=int(os.environ.get("FANIN_TEST_CHORD_MAX_BYTES", str(16 * 1024 * 1024))),
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    task_acks_late=os.environ.get("FANIN_TEST_ACKS_LATE") == "1",
    task_reject_on_worker_lost=os.environ.get("FANIN_TEST_ACKS_LATE") == "1",
    worker_hijack_root_logger=False,
    # Chords need a result backend (tests/e2e/test_canvas.py, tests/e2e/test_result_backend.py); every other test
    # runs without one.
    result_backend=os.environ.get("FANIN_TEST_RESULT_BACKEND") or None,
    fanin_store_child_results_in_backend=os.environ.get("FANIN_TEST_STORE_CHILD_RESULTS") == "1",
    fanin_report_batching=os.environ.get("FANIN_TEST_REPORT_BATCHING") == "1",
    fanin_successor_inline=os.environ.get("FANIN_TEST_SUCCESSOR_INLINE", "1") == "1",
)


class _WakeOften(bootsteps.StartStopStep):
    """Test workers only: the event loop wakes every quarter second. With no timer due, Celery's hub sleeps in
    epoll for up to 10 s, and a SIGTERM only sets a flag that the loop reads when it wakes: on RabbitMQ (no
    polling timer, unlike Redis) each warm shutdown took ~4 s more, a test's teardown 5 s in all."""

    requires = ("celery.worker.components:Hub",)

    def start(self, worker: Any) -> None:
        if getattr(worker, "hub", None) is not None:  # prefork and solo; gevent and eventlet have no hub
            worker.hub.call_repeatedly(0.25, lambda: None)


app.steps["worker"].add(_WakeOften)

if os.environ.get("FANIN_TEST_LOG_FORMAT"):  # what `app.log.setup` formats with (tests/e2e/test_relay_app.py)
    app.conf.worker_log_format = os.environ["FANIN_TEST_LOG_FORMAT"]
if os.environ.get("FANIN_TEST_AUTODISCOVER"):  # found as a worker finds a Django app's tasks.py
    app.autodiscover_tasks(["tests.routed"])
if os.environ.get("FANIN_TEST_SIGNING_DIR"):  # message signing (tests/e2e/test_signing.py)
    from tests.signing import configure_signing

    configure_signing(app, os.environ["FANIN_TEST_SIGNING_DIR"])
if os.environ.get("FANIN_TEST_WORKER_PUBLISHES"):  # "0": successors only through the relay (test_successor_publish)
    app.conf.fanin_worker_publishes_successors = os.environ["FANIN_TEST_WORKER_PUBLISHES"] == "1"
if os.environ.get("FANIN_TEST_REPLACED_TIMEOUT"):
    app.conf.fanin_replaced_timeout = float(os.environ["FANIN_TEST_REPLACED_TIMEOUT"])
if os.environ.get("FANIN_TEST_SUCCESSOR_HANDOFF"):
    app.conf.fanin_successor_handoff = float(os.environ["FANIN_TEST_SUCCESSOR_HANDOFF"])
FanIn(app)
if os.environ.get("FANIN_TEST_DIE_BEFORE_SUCCESSOR_PUBLISH"):
    # A pool process killed (SIGKILL) after the commit of the report that created a successor and before it
    # publishes it: the hook the wiring set is where the worker would publish (tests/e2e/test_successor_publish.py).
    from celery_fanin.worker import runtime as worker_runtime

    def _die_before_publishing(*_: Any) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    worker_runtime.current.reporter.publish_successor = _die_before_publishing

if os.environ.get("FANIN_TEST_SLOW_SUCCESSOR_PUBLISH"):
    # A worker stopped between reading the successor handed to it and publishing it, for this many seconds (longer
    # than its handoff, so the relay publishes it too: tests/e2e/test_successor_publish.py).
    from celery_fanin.dispatch import successors as successor_dispatch

    _publish_handed_off = successor_dispatch._publish_handed_off

    def _slow_publish(*args: Any) -> int:
        time.sleep(float(os.environ["FANIN_TEST_SLOW_SUCCESSOR_PUBLISH"]))
        return _publish_handed_off(*args)

    successor_dispatch._publish_handed_off = _slow_publish

RUNS_TABLE_DDL = """
CREATE TABLE IF NOT EXISTS e2e_successor_runs (
    id serial PRIMARY KEY,
    batch_id text NOT NULL,
    label text NOT NULL,
    outcome jsonb NOT NULL,
    values jsonb,
    ran_at timestamptz NOT NULL DEFAULT now()
)
"""


def _db(wait: float = 120.0) -> psycopg.Connection:
    """The test's own connection for what a task records. A connection refused (a restart or an outage the chaos
    suite makes, even between a successor's admission and its body's first line) is tried again for up to `wait`
    seconds: what a task records is the test's evidence, not the code under test, which must not fail for it."""
    # FANIN_TEST_RUNS_URL: the database without the fault proxy a test may put in front of FANIN_DATABASE_URL.
    url = os.environ.get("FANIN_TEST_RUNS_URL") or os.environ["FANIN_DATABASE_URL"]
    deadline = time.monotonic() + wait
    while True:
        try:
            return psycopg.connect(libpq_conninfo(url), autocommit=True)  # several hosts too (tests/ha)
        except psycopg.OperationalError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.2)  # a retry's pause, bounded by `wait`: no condition to wait on but the server itself


def _redis() -> redis.Redis:
    return redis.Redis.from_url(BROKER_URL)


@app.task
def ok(i: int) -> int:
    return i * 10


@app.task
def fail(i: int) -> None:
    raise ValueError(f"child {i} failed on purpose")


@app.task(bind=True, autoretry_for=(ConnectionError,), max_retries=3, default_retry_delay=0.1, retry_jitter=False)
def flaky(self: Any, i: int, fail_times: int) -> int:
    """Fails `fail_times` attempts with a retryable error, then succeeds (or fails for good past max_retries)."""
    attempts = _redis().incr(f"e2e:flaky:{self.request.id}")
    if attempts <= fail_times:
        raise ConnectionError(f"transient failure {attempts} of child {i}")
    return i


@app.task(bind=True, max_retries=2)
def always_retry(self: Any, i: int) -> None:
    raise self.retry(countdown=0.1)


@app.task
def sleepy(seconds: float) -> float:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.05)
    return seconds


@app.task
def die(i: int) -> None:
    """Kill the pool process running this task, as the OOM killer would."""
    os.kill(os.getpid(), signal.SIGKILL)


@app.task
def die_once(i: int) -> int:
    """SIGKILL the pool process on the first delivery only; a redelivered message succeeds."""
    if _redis().incr(f"e2e:die_once:{i}") == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return i


@app.task
def sleepy_once(key: str, first: float, later: float) -> str:
    """Sleeps `first` seconds on its first run and `later` on any other (a run a crash interrupted)."""
    seconds = first if _redis().incr(f"e2e:sleepy_once:{key}") == 1 else later
    sleepy(seconds)
    return key


@app.task
def reject(i: int) -> None:
    raise Reject(f"child {i} rejected", requeue=False)


NOTES_TABLE_DDL = "CREATE TABLE IF NOT EXISTS e2e_notes (id serial PRIMARY KEY, label text NOT NULL, value jsonb)"


@app.task
def note(value: Any, label: str) -> None:
    """A link or link_error callback: records that it ran, with what it was given (in `e2e_notes`)."""
    with _db() as conn:
        conn.execute("INSERT INTO e2e_notes (label, value) VALUES (%s, %s)", (label, json.dumps(value)))


@app.task
def record_run(outcome: dict[str, Any], label: str, with_values: bool = False) -> dict[str, Any]:
    """The successor: records that its body ran, with the outcome it received."""
    values = list(BatchOutcome.from_message(outcome, app=app).values()) if with_values else None
    with _db() as conn:
        conn.execute(
            "INSERT INTO e2e_successor_runs (batch_id, label, outcome, values) VALUES (%s, %s, %s, %s)",
            (outcome["batch_id"], label, json.dumps(outcome), json.dumps(values)),
        )
    return {"label": label, "succeeded": outcome["succeeded"], "failed": outcome["failed"]}


@app.task
def successor_dies_once(outcome: dict[str, Any], label: str) -> None:
    """A successor whose first run loses its pool process (as an OOM kill would), then runs to the end."""
    if _redis().incr(f"e2e:successor_dies_once:{outcome['batch_id']}") == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    record_run(outcome, label)


@app.task
def pid_of(i: int) -> int:
    """A child that returns the process it ran in."""
    return os.getpid()


@app.task
def pid_successor(outcome: dict[str, Any], label: str) -> int:
    """A successor that records its run as `label@pid`, with its children's results (their processes' pids)."""
    record_run(outcome, f"{label}@{os.getpid()}", with_values=True)
    return os.getpid()


@app.task(acks_late=True)
def pid_successor_acks_late(outcome: dict[str, Any], label: str) -> int:
    """`pid_successor`, acknowledged late."""
    record_run(outcome, f"{label}@{os.getpid()}", with_values=True)
    return os.getpid()


@app.task(rate_limit="600/m")
def pid_successor_rate_limited(outcome: dict[str, Any], label: str) -> int:
    """`pid_successor`, with a rate limit (the worker's main process throttles its messages)."""
    record_run(outcome, f"{label}@{os.getpid()}", with_values=True)
    return os.getpid()


@app.task
def slow_successor(outcome: dict[str, Any], label: str, seconds: float) -> None:
    sleepy(seconds)
    record_run(outcome, label)


@app.task
def slow_once_successor(outcome: dict[str, Any], label: str, seconds: float) -> None:
    """Sleeps `seconds` on its first run only (a run its worker's death interrupts), then records its run."""
    if _successor_attempt("slow_once_successor", outcome) == 1:
        sleepy(seconds)
    record_run(outcome, label)


@app.task
def failing_successor(outcome: dict[str, Any], label: str) -> None:
    with _db() as conn:
        conn.execute(
            "INSERT INTO e2e_successor_runs (batch_id, label, outcome) VALUES (%s, %s, %s)",
            (outcome["batch_id"], label, json.dumps(outcome)),
        )
    raise RuntimeError("the successor failed on purpose")


# --- a successor's lifecycle (tests/e2e/test_successor_lifecycle.py, test_pools.py) ------------------------------


def _successor_attempt(kind: str, outcome: dict[str, Any]) -> int:
    """Counts the executions of a successor's body, per batch (the guard must admit each retry)."""
    return int(_redis().incr(f"e2e:{kind}:{outcome['batch_id']}"))


@app.task(bind=True, max_retries=5)
def retrying_successor(self: Any, outcome: dict[str, Any], label: str, retries: int) -> int:
    """Retries itself `retries` times with no delay (the retry can arrive before this attempt's postrun)."""
    if _successor_attempt("retrying_successor", outcome) <= retries:
        raise self.retry(countdown=0)
    record_run(outcome, label)
    return int(self.request.retries)


@app.task(bind=True, autoretry_for=(ConnectionError,), retry_backoff=0.1, retry_jitter=False, max_retries=3)
def autoretry_successor(self: Any, outcome: dict[str, Any], label: str, failures: int) -> int:
    """Fails `failures` times with a retryable error (autoretry_for, retry_backoff); past max_retries for good."""
    if _successor_attempt("autoretry_successor", outcome) <= failures:
        raise ConnectionError(f"{label}: transient failure")
    record_run(outcome, label)
    return int(self.request.retries)


@app.task
def ignoring_successor(outcome: dict[str, Any], label: str) -> None:
    """Ends its body with Ignore (Celery stores nothing): a final state, never run again."""
    from celery.exceptions import Ignore

    record_run(outcome, label)
    raise Ignore()


@app.task(bind=True)
def replacing_successor(self: Any, outcome: dict[str, Any], label: str, as_chain: bool = False) -> Any:
    """Replaces itself with `record_run` (or a chain ending in it): the replacement's end is the successor's."""
    _successor_attempt("replacing_successor", outcome)
    replacement = record_run.si(outcome, f"{label}-replacement")
    if as_chain:
        replacement = ok.si(1) | replacement
    raise self.replace(replacement)


@app.task(bind=True)
def replacing_child(self: Any, i: int) -> Any:
    """A child that replaces itself with `ok(i)`: counted when the replacement ends, with its value."""
    raise self.replace(ok.s(i))


@app.task(bind=True)
def replacing_child_frozen(self: Any, i: int) -> Any:
    """A child that replaces itself with a chain whose last task was given a task id of its own (Celery keeps it):
    that task reports for the child all the same."""
    last = ok.si(i).set(task_id=f"frozen-{self.request.id}")
    raise self.replace(ok.si(0) | last)


@app.task(bind=True)
def replacing_child_with_group(self: Any, i: int) -> Any:
    """A child that replaces itself with a group, which Celery upgrades to a chord: counted when the chord's body
    (the carrier) ends, which needs its header tasks' results in the result backend."""
    raise self.replace(group(ok.si(i), ok.si(i + 10)))


@app.task(bind=True)
def replacing_child_failing(self: Any, i: int, as_group: bool = False) -> Any:
    """A child that replaces itself with a chain (or a group) whose second task fails: the child is counted
    failed by that task, though the replacement's carrier never runs."""
    if as_group:
        raise self.replace(group(ok.si(i), fail.si(i)))
    raise self.replace(ok.si(i) | fail.si(i) | ok.si(i))


@app.task(bind=True, acks_late=True)
def requeueing_successor(self: Any, outcome: dict[str, Any], label: str) -> None:
    """Rejects its first delivery with requeue=True (acks_late, so the broker redelivers it), then runs."""
    if _successor_attempt("requeueing_successor", outcome) == 1:
        raise Reject("not now", requeue=True)
    record_run(outcome, label)


@app.task(bind=True, autoretry_for=(ConnectionError,), max_retries=5, default_retry_delay=0.2, retry_jitter=False)
def chaos_child(self: Any, batch: int, i: int, mode: str) -> int:
    """A child for the chaos suite: `ok`, `fail` (for good), `flaky` (one retryable error, then ok), `slow`."""
    if mode == "fail":
        raise ValueError(f"chaos child {batch}/{i} fails for good")
    if mode == "flaky" and self.request.retries == 0:
        raise ConnectionError(f"chaos child {batch}/{i}: transient")
    if mode == "slow":
        sleepy(0.3 + (i % 5) * 0.2)
    return i


@app.task(bind=True, max_retries=3)
def chaos_successor(self: Any, outcome: dict[str, Any], batch: int) -> None:
    """Retries itself once at once (the retry may arrive before this attempt ends), then records its completed
    run; the chaos suite asserts exactly one record per batch. A copy the relay republishes resumes the retry
    count, so it does not retry again."""
    if self.request.retries == 0:
        raise self.retry(countdown=0)
    record_run(outcome, f"chaos-{batch}")


@app.task
def chaos_slow_step(outcome: dict[str, Any], batch: int) -> dict[str, Any]:
    """The first task of a chaos successor's replacement, `then=chain(chaos_slow_step, record_run)`: slow enough that
    the faults (a killed worker, a restart) meet the replacement mid-way; passes the outcome on to the carrier."""
    sleepy(2.0)
    return outcome


@app.task
def sum_values(outcome: dict[str, Any]) -> int:
    """A successor that returns the sum of its children's values (a nested batch's result)."""
    return sum(BatchOutcome.from_message(outcome, app=app).values())


@app.task
def recurse(level: int) -> None:
    """Starts a fan-in of one child like itself, one level deeper each time, until the depth bound stops it."""
    from celery_fanin import fan_in_group

    fan_in_group([recurse.s(level + 1)], then=record_run.s(f"level-{level}")).apply_async()


@app.task
def fail_first_time(key: str) -> str:
    """Fails the first time it runs for `key` (a first round), succeeds on every later run (a retry round)."""
    if _redis().incr(f"e2e:fail_first_time:{key}") == 1:
        raise ValueError(f"{key} fails on its first run")
    return key


# --- sagas (tests/e2e/test_sagas.py) ------------------------------------------------------------------------------
# Every step and compensation records each call in e2e_saga_calls and its effect once in e2e_saga_effects, keyed by
# the original's identity: a step's own task id, and for a compensation `request.fanin_undo_of` (the task id of the
# work it undoes). "Compensated exactly once" is then what the effects table says, however often a task ran.

from celery_fanin import builtin_tasks  # noqa: E402

builtin_tasks.register(app)  # until FanIn(app) does it

SAGA_TABLES_DDL = """
CREATE TABLE IF NOT EXISTS e2e_saga_calls (
    id serial PRIMARY KEY, action text NOT NULL, key text, label text NOT NULL,
    at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE TABLE IF NOT EXISTS e2e_saga_effects (
    id serial PRIMARY KEY, action text NOT NULL, key text NOT NULL, label text NOT NULL,
    at timestamptz NOT NULL DEFAULT clock_timestamp(),
    UNIQUE (action, key)
);
"""


def _saga_effect(action: str, key: str | None, label: str, effect: bool = True) -> None:
    with _db() as conn:
        conn.execute("INSERT INTO e2e_saga_calls (action, key, label) VALUES (%s, %s, %s)", (action, key, label))
        if effect:
            if not key:
                raise RuntimeError(f"{action} {label}: no idempotency key")
            conn.execute(
                "INSERT INTO e2e_saga_effects (action, key, label) VALUES (%s, %s, %s) ON CONFLICT DO NOTHING",
                (action, key, label),
            )


@app.task(bind=True)
def saga_do(self: Any, action: str, label: str) -> str:
    """A step's work (reserve, charge, notify): its effect is recorded once, under its own task id."""
    _saga_effect(action, self.request.id, label)
    return f"{action}:{label}"


@app.task(bind=True, autoretry_for=(ConnectionError,), max_retries=2, default_retry_delay=0.1, retry_jitter=False)
def saga_ship_fails(self: Any, label: str) -> None:
    """A step that fails for good after its retries (three calls)."""
    _saga_effect("ship", self.request.id, label, effect=False)
    raise ConnectionError(f"the carrier is down (order {label})")


@app.task(bind=True)
def saga_undo(self: Any, action: str, label: str, hang_first: float = 0, needs_flag: bool = False) -> str:
    """A compensation: records `undo:<action>` once, keyed by the original's task id.

    `hang_first`: the first call sleeps that long after recording its effect (a worker killed there leaves a
    compensation that did its work but never reported). `needs_flag`: fails for good unless the Redis key
    `e2e:saga:fixed:<label>` is set (an operator fixing the cause before `saga resume`).
    """
    original = getattr(self.request, "fanin_undo_of", None)
    if needs_flag and not _redis().get(f"e2e:saga:fixed:{label}"):
        _saga_effect(f"undo:{action}", original, label, effect=False)
        raise RuntimeError(f"the refund service is down (order {label})")
    _saga_effect(f"undo:{action}", original, label)
    if hang_first and _redis().incr(f"e2e:saga:hang:{original}") == 1:
        sleepy(hang_first)
    return f"undo:{action}:{label}"


@app.task(bind=True)
def saga_piece(self: Any, i: int, fail: bool = False) -> int:
    """A child of a fan-in step: fails for good when told to, else records its effect."""
    if fail:
        _saga_effect("piece", self.request.id, str(i), effect=False)
        raise ValueError(f"piece {i} failed on purpose")
    _saga_effect("piece", self.request.id, str(i))
    return i


@app.task
def saga_merge(outcome: dict[str, Any]) -> dict[str, Any]:
    """A fan-in step's successor that refuses a partial result: it rolls back the pieces that succeeded."""
    result = BatchOutcome.from_message(outcome, app=app)
    if not result.ok:
        handle = result.compensate()
        return {"rejected": True, "compensation_batch": handle.batch_id}
    return {"rejected": False, "values": list(result.values())}


@inspect_command()
def fanin_received_markers(state: Any) -> dict[str, int]:
    """How many received fan-in messages the worker's main process still keeps a marker for (asked by the tests)."""
    from celery_fanin.worker import runtime

    gc.collect()  # a request released in a reference cycle goes with the next collection
    return {"markers": len(runtime.current.received)}


# --- outcome rows (tests/e2e/test_outcome_rows.py) ------------------------------------------------------------------
# Attempts and starts are counted in Postgres (e2e_attempts), not Redis: these tasks also run on RabbitMQ, where
# FANIN_TEST_BROKER is no Redis URL.

from celery.exceptions import Ignore  # noqa: E402

ATTEMPTS_DDL = """
CREATE TABLE IF NOT EXISTS e2e_attempts (
    key text PRIMARY KEY, n integer NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp()
)
"""


def _attempt(key: str) -> int:
    """Count one more run of the body for `key` (written when the body begins) and return how many there were."""
    with _db() as conn:
        row = conn.execute(
            "INSERT INTO e2e_attempts (key, n) VALUES (%s, 1) ON CONFLICT (key) DO UPDATE "
            "SET n = e2e_attempts.n + 1, at = clock_timestamp() RETURNING n",
            (key,),
        ).fetchone()
    assert row is not None
    return int(row[0])


@app.task
def ignore_child(key: str) -> None:
    """Ends every run with `Ignore`: Celery takes the message off the queue and never reports an end."""
    _attempt(key)
    raise Ignore()


@app.task
def reject_requeue(key: str) -> None:
    """Ends every run with `Reject(requeue=True)` (without acks_late the message is already acked: nothing requeues)."""
    _attempt(key)
    raise Reject(f"{key} requeued", requeue=True)


@app.task
def reject_requeue_once(key: str) -> str:
    """`Reject(requeue=True)` on the first run; the redelivered message (acks_late) then succeeds."""
    if _attempt(key) == 1:
        raise Reject(f"{key} requeued", requeue=True)
    return key


@app.task
def mark_then_sleep(key: str, seconds: float) -> float:
    """Records that its body began, then sleeps: a test can act on a child it knows is running."""
    _attempt(key)
    return sleepy(seconds)


@app.task
def gated(key: str, limit: float = 60) -> str:
    """Records that its body began, then holds its pool process until the test opens the gate (`<key>:open`)."""
    _attempt(key)
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        with _db() as conn:
            if conn.execute("SELECT 1 FROM e2e_attempts WHERE key = %s", (f"{key}:open",)).fetchone():
                return key
        time.sleep(0.05)
    raise TimeoutError(f"the gate {key} was never opened")


@app.task
def gated_fail(key: str, limit: float = 60) -> None:
    """`gated`, then fails for good: a failure that happens when the test opens the gate (`<key>:open`)."""
    gated(key, limit)
    raise ValueError(f"{key} failed on purpose")


@app.task
def counted_run(key: str) -> str:
    """Counts each run of its body in `e2e_attempts` (in Postgres, so on any broker): a duplicate runs it again."""
    _attempt(key)
    return key


@app.task
def die_once_pg(key: str) -> str:
    """SIGKILL the pool process on the first run only (counted in Postgres, so on any broker); later runs succeed."""
    if _attempt(key) == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return key


# --- composing like a chord (tests/e2e/test_canvas.py) --------------------------------------------------------------


@app.task
def add(x: Any, y: Any) -> Any:
    return x + y


@app.task
def identity(x: Any) -> Any:
    return x


@app.task
def tsum(numbers: list[int], extra: int = 0) -> int:
    """A child of a fan-in that is a chord's body: it gets the header's results first, as the body would."""
    return sum(numbers) + extra


@app.task
def values(outcome: dict[str, Any]) -> list[Any]:
    """A successor that returns its children's values in child order (what a chord's body receives)."""
    return list(BatchOutcome.from_message(outcome, app=app).values())


@app.task
def raise_value_error(outcome: dict[str, Any]) -> None:
    """A successor that fails: `handle.get()` raises its error, and its `link_error` runs."""
    raise ValueError(f"the successor of batch {outcome['batch_id']} failed on purpose")


# --- celery beat (tests/e2e/test_beat.py) ---------------------------------------------------------------------------

if os.environ.get("FANIN_TEST_BEAT_EVERY"):
    from celery_fanin import fan_in_group, fan_in_schedule

    app.conf.beat_schedule = {
        "fan-in-every": fan_in_schedule(
            "fan-in-every",
            fan_in_group([ok.s(1), ok.s(2)], then=record_run.s("beat"), app=app),
            float(os.environ["FANIN_TEST_BEAT_EVERY"]),
        )
    }


# --- copies of a message (tests/e2e/test_message_copies.py) ----------------------------------------------------


@app.task
def slow_step(outcome: dict[str, Any], key: str, seconds: float) -> dict[str, Any]:
    """A chain's first task after a successor: counts its run under `key`, sleeps, passes the outcome on."""
    _attempt(key)
    sleepy(seconds)
    return outcome


@app.task
def gated_step(outcome: dict[str, Any], key: str) -> dict[str, Any]:
    """A chain's first task after a successor: holds until the test opens the gate (`gated`), passes the outcome on."""
    gated(key)
    return outcome


@app.task
def buggy_successor(outcome: dict[str, Any], key: str) -> dict[str, Any]:
    """A successor with a bug until the test fixes it (`e2e:fixed:<key>` set in Redis): fails, then, rerun
    (`fanin rerun`), records its run and returns its batch's counts."""
    if not _redis().exists(f"e2e:fixed:{key}"):
        raise RuntimeError(f"the bug of {key} is not fixed yet")
    record_run(outcome, f"fixed:{key}")
    return {"succeeded": outcome["succeeded"], "failed": outcome["failed"]}


@app.task
def gated_successor(outcome: dict[str, Any], label: str, key: str) -> dict[str, Any]:
    """A successor that holds its pool process until the test opens the gate (`gated`), then records its run."""
    gated(key)
    return record_run(outcome, label)


from tests import chord_tasks as _chord_tasks  # noqa: E402,F401  (Celery's chord cases: registered in every worker)
