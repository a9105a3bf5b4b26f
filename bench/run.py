"""The benchmark: Celery's `group` (the floor) and `chord` against `fan_in_group`, side by side in one run.

It creates its own Postgres database, claims a Redis database (as the test suite does), starts one
`celery worker -P prefork -c 2` and one relay, and measures, alternating the contenders:

- dispatch: the call to `apply_async` (signatures built beforehand), in a fresh process per dispatch, whose peak RSS
  is also recorded;
- end to end: dispatch start to the successor's first line (for the plain groups, one keeping results and one
  fire-and-forget: to the last child finishing), after one untimed warm-up run of each contender;
- successor latency over many small batches: the last child's terminal commit (`fanin_batches.completed_at`; for
  chord the newest `date_done` of its header results) to the successor's first line;
- statements and round trips per child terminal event, counted by the workers' psycopg driver (pg_stat_statements
  is used too when the server has it loaded);
- terminal-event throughput on one batch with 16 concurrent reporters (its default layout, one flat counter, 16
  leaves), beside a raw single-row UPDATE's.

Every ratio between contenders is paired: taken within one repeat (the contenders of a repeat run back to back, in
an order that rotates), and reported as the median of the repeats' ratios with their range.

Prints a table, writes JSON (and a PNG plot of end-to-end time against N) under `--out`.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import multiprocessing
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import psycopg
import redis

ROOT = Path(__file__).resolve().parent.parent
CONTENDERS = ("group", "group_ff", "chord", "fanin")
# The plain groups' end is their last child's; the others', their successor's first line.
GROUPS = ("group", "group_ff")
ADMIN_URL = os.environ.get("BENCH_ADMIN_URL", "postgresql://root@127.0.0.1:5432/postgres")
REDIS_SERVER = os.environ.get("BENCH_REDIS_SERVER", "redis://127.0.0.1:6379")
RABBITMQ_URL = os.environ.get("BENCH_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672//")
REDIS_CLAIM_KEY = "fanin-test-session"  # the test suite's claim: a bench run and a test run never share a database

FIGURE_KEYS = ("dispatch_s", "e2e_s", "rss_peak_mb")


# --- environment ----------------------------------------------------------------------------------------------


@contextmanager
def database() -> Iterator[str]:
    name = f"fanin_bench_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(ADMIN_URL, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')  # a generated identifier
    try:
        yield f"{ADMIN_URL.rsplit('/', 1)[0]}/{name}"
    finally:
        with psycopg.connect(ADMIN_URL, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@contextmanager
def redis_database() -> Iterator[str]:
    token = uuid.uuid4().hex
    for db in range(15, 0, -1):
        client = redis.Redis.from_url(f"{REDIS_SERVER}/{db}")
        if client.set(REDIS_CLAIM_KEY, token, nx=True, ex=6 * 3600):
            break
    else:
        raise SystemExit("every Redis database from 1 to 15 is claimed (by test sessions or other bench runs)")
    try:
        client.flushdb()
        client.set(REDIS_CLAIM_KEY, token, ex=6 * 3600)
        yield f"{REDIS_SERVER}/{db}"
    finally:
        if client.get(REDIS_CLAIM_KEY) == token.encode():
            client.flushdb()


def harness_env(db_url: str, redis_url: str, broker: str, queue: str) -> dict[str, str]:
    """The environment `bench.tasks` is configured from, for this process and the workers and relays it starts."""
    path = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(ROOT)) if p)
    settings = {
        "FANIN_DATABASE_URL": db_url,
        "BENCH_BROKER": broker,
        "BENCH_BACKEND": redis_url,
        "BENCH_REDIS": redis_url,
        "BENCH_QUEUE": queue,
    }
    os.environ.update(settings)
    return {**os.environ, "PYTHONPATH": path, **settings}


class Proc:
    """A celery subprocess (worker or relay) of the harness, in its own process group, logging to a file."""

    def __init__(self, args: list[str], env: dict[str, str], log: Path) -> None:
        self.log = log
        self._file = log.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "bench.tasks", *args],
            cwd=ROOT,
            env=env,
            stdout=self._file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_for(self, marker: str, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.log.name} exited: {self.log.read_text()[-3000:]}")
            if marker in self.log.read_text(errors="replace"):
                return True
            time.sleep(0.1)
        return False

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait(10)
        self._file.close()


def purge_queue(broker: str, queue: str, delete: bool = False) -> None:
    from kombu import Connection

    with Connection(broker) as conn:
        channel = conn.channel()
        try:
            if delete:
                channel.queue_delete(queue)
            else:
                channel.queue_purge(queue)
        except Exception:  # noqa: BLE001 - a queue that was never declared has nothing to purge
            pass
        channel.close()


# --- the measurements -----------------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def summary(values: Sequence[float]) -> dict[str, Any]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": list(values)}


class Bench:
    def __init__(self, args: argparse.Namespace, env: dict[str, str], marks: redis.Redis, log_dir: Path) -> None:
        self.args = args
        self.env = env
        self.marks = marks
        self.log_dir = log_dir
        self.errors: list[str] = []

    def wait_mark(self, key: str, timeout: float) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:  # short blocking pops: redis-py's client times out a socket after 5 s
            got = self.marks.blpop([key], timeout=2)
            if got is not None:
                return float(got[1])
        raise TimeoutError(f"no {key} within {timeout:.0f}s")

    def run_one(self, contender: str, n: int, rep: int) -> dict[str, float]:
        """Dispatch one batch of `n` in a fresh process and wait for its end mark."""
        run = f"{contender}-{n}-{rep}-{uuid.uuid4().hex[:6]}"
        timeout = 120 + n / 50
        out = subprocess.run(
            [sys.executable, "-m", "bench.dispatch", contender, str(n), run],
            cwd=ROOT,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if out.returncode != 0:
            raise RuntimeError(f"dispatch of {contender} failed:\n{out.stderr[-3000:]}")
        result = json.loads(out.stdout.strip().splitlines()[-1])
        key = f"bench:end:{run}" if contender in GROUPS else f"bench:start:{run}"
        finished = self.wait_mark(key, timeout)
        self.marks.delete(f"bench:done:{run}")
        return {
            "dispatch_s": result["dispatch_s"],
            "e2e_s": finished - result["start"],
            "rss_peak_mb": result["rss_peak_mb"],
        }

    def contenders(self, progress: Callable[[str], None]) -> dict[str, dict[str, dict[str, Any]]]:
        figures: dict[str, dict[str, dict[str, Any]]] = {c: {} for c in CONTENDERS}
        errors = self.errors
        # One untimed run of each first: the worker's pool processes, the broker's queue and the database's caches
        # warm for every contender alike, so that the first timed run is not the only cold one.
        warm = min(self.args.n)
        for contender in CONTENDERS:
            try:
                r = self.run_one(contender, warm, -1)
            except Exception as exc:  # noqa: BLE001 - a warm-up that fails is reported like a timed run
                progress(f"warm-up N={warm} {contender}: FAILED {exc!r}")
                errors.append(f"warm-up N={warm} {contender}: {exc!r}"[:2000])
                continue
            progress(f"warm-up N={warm} {contender}: e2e {r['e2e_s']:.3f}s (not counted)")
        for n in self.args.n:
            runs: dict[str, list[dict[str, float]]] = {c: [] for c in CONTENDERS}
            reps: dict[str, list[int]] = {c: [] for c in CONTENDERS}
            for rep in range(self.args.repeats):
                k = rep % len(CONTENDERS)
                order = CONTENDERS[k:] + CONTENDERS[:k]  # alternate who goes first
                for contender in order:
                    try:
                        r = self.run_one(contender, n, rep)
                    except Exception as exc:  # noqa: BLE001 - keep the other figures; the error is reported
                        progress(f"N={n} rep={rep} {contender}: FAILED {exc!r}")
                        errors.append(f"N={n} rep={rep} {contender}: {exc!r}"[:2000])
                        continue
                    runs[contender].append(r)
                    reps[contender].append(rep)
                    progress(
                        f"N={n} rep={rep} {contender}: dispatch {r['dispatch_s']:.3f}s e2e {r['e2e_s']:.3f}s "
                        f"rss {r['rss_peak_mb']:.0f}MB"
                    )
            for contender in CONTENDERS:
                if runs[contender]:
                    figures[contender][str(n)] = {
                        **{k: summary([r[k] for r in runs[contender]]) for k in FIGURE_KEYS},
                        "reps": reps[contender],  # which repeat each run was: ratios pair runs of one repeat
                    }
        return figures

    def latency(self, progress: Callable[[str], None]) -> dict[str, Any]:
        """Successor latency over many small batches, chord and fan-in alternately, one batch at a time."""
        from celery import chord

        from bench.tasks import app, child, mark
        from celery_fanin import fan_in_group

        size = self.args.latency_size
        lat: dict[str, list[float]] = {"chord": [], "fanin": []}
        with psycopg.connect(self.env["FANIN_DATABASE_URL"], autocommit=True) as db:
            for k in range(self.args.latency_batches):
                for contender in ("chord", "fanin") if k % 2 == 0 else ("fanin", "chord"):
                    run = f"lat-{contender}-{k}-{uuid.uuid4().hex[:6]}"
                    if contender == "chord":
                        result: Any = chord([child.s(i, run, size) for i in range(size)], mark.s(run)).apply_async()
                        started = self.wait_mark(f"bench:start:{run}", 60)
                        done = [r.date_done for r in result.parent.results]
                        last = max(_epoch(d) for d in done)
                        # The chord's GroupResult registered its children as pending results, and without a
                        # drainer nothing releases them until `__del__` runs at interpreter exit, when redis-py can
                        # no longer reconnect to unsubscribe. Forgetting releases them now (and their keys).
                        result.forget()
                    else:
                        sigs = [child.s(i, run, size) for i in range(size)]
                        handle = fan_in_group(sigs, then=mark.s(run), app=app).apply_async()
                        started = self.wait_mark(f"bench:start:{run}", 60)
                        row = db.execute(
                            "SELECT extract(epoch FROM completed_at) FROM fanin_batches WHERE id = %s",
                            (handle.batch_id,),
                        ).fetchone()
                        assert row is not None and row[0] is not None
                        last = float(row[0])
                    lat[contender].append((started - last) * 1000)
                    self.marks.delete(f"bench:done:{run}")
            progress(f"latency: {len(lat['fanin'])} batches of {size} each")
        return {
            c: {
                "p50_ms": percentile(v, 0.5),
                "p99_ms": percentile(v, 0.99),
                "max_ms": max(v),
                "batches": len(v),
                "batch_size": size,
            }
            for c, v in lat.items()
        }

    def db_counts(self, progress: Callable[[str], None]) -> dict[str, Any]:
        """Statements and round trips per child event, counted in the workers (see bench/tasks.py)."""
        from bench.tasks import app, child, mark
        from celery_fanin import fan_in_group

        n = self.args.count_children
        stat = PgStatStatements(self.env["FANIN_DATABASE_URL"])
        self.marks.delete("bench:sql")
        stat.reset()
        run = f"count-{uuid.uuid4().hex[:6]}"
        fan_in_group([child.s(i, run, n) for i in range(n)], then=mark.s(run), app=app).apply_async()
        self.wait_mark(f"bench:start:{run}", 120)
        time.sleep(1.0)  # the successor's own state update, flushed after its postrun
        raw = {k.decode(): int(v) for k, v in self.marks.hgetall("bench:sql").items()}
        progress(f"db counts: {raw}")

        def per(phase: str, what: str) -> float | None:
            events = raw.get(f"{phase}.events", 0)
            return raw.get(f"{phase}.{what}", 0) / events if events else None

        result: dict[str, Any] = {
            "children": n,
            "method": "psycopg driver counters in the worker pool processes (bench/tasks.py)",
            "terminal_events": raw.get("terminal.events", 0),
            "terminal_statements_per_event": per("terminal", "statements"),
            "terminal_roundtrips_per_event": per("terminal", "roundtrips"),
            "start_statements_per_child": per("start", "statements"),
            "start_roundtrips_per_child": per("start", "roundtrips"),
            "all_statements_per_child": sum(v for k, v in raw.items() if k.endswith(".statements")) / n,
            "all_roundtrips_per_child": sum(v for k, v in raw.items() if k.endswith(".roundtrips")) / n,
            "raw": raw,
        }
        result["pg_stat_statements"] = stat.read(n)
        return result

    def throughput(self, progress: Callable[[str], None]) -> dict[str, Any]:
        """Terminal events on one flat batch from `reporters` processes, and a raw hot-row UPDATE, same run."""
        from bench.tasks import app, child, mark
        from celery_fanin import fan_in_group

        n, reporters = self.args.throughput_children, self.args.reporters
        parked = f"{self.env['BENCH_QUEUE']}-parked"  # no worker consumes it: the children are reported by hand
        run = f"tput-{uuid.uuid4().hex[:6]}"
        url = self.env["FANIN_DATABASE_URL"]

        def parked_batch(**options: Any) -> tuple[str, list[list[str]]]:
            """A batch of n children nobody consumes, and its task ids dealt out to the reporters."""
            sigs = [child.s(i, run, n).set(queue=parked) for i in range(n)]
            handle = fan_in_group(sigs, then=mark.s(run), app=app, **options).apply_async()
            purge_queue(self.env["BENCH_BROKER"], parked, delete=True)
            with psycopg.connect(url, autocommit=True) as db:
                ids = [
                    r[0]
                    for r in db.execute(
                        "SELECT task_id FROM fanin_children WHERE batch_id IN (SELECT id FROM fanin_batches "
                        "WHERE id = %s OR parent_id = %s) ORDER BY idx",
                        (handle.batch_id, handle.batch_id),
                    )
                ]
            return handle.batch_id, [ids[i::reporters] for i in range(reporters)]

        with psycopg.connect(url, autocommit=True) as db:
            db.execute("CREATE TABLE IF NOT EXISTS bench_hot (id int PRIMARY KEY, n bigint NOT NULL)")
            db.execute("INSERT INTO bench_hot VALUES (1, 1000000000) ON CONFLICT (id) DO NOTHING")
        rounds: list[dict[str, float]] = []
        for rnd in range(self.args.throughput_rounds):
            # Fresh batches each round; the order of the five rotates, so that none is always measured right after
            # the same neighbour (the server's background work and the page cache carry over between phases).
            # Flat whatever the default width (max_width=n): the one counter row every report of it updates.
            flat, slices = parked_batch(max_width=n)
            bare, bare_slices = parked_batch(max_width=n)
            # The same children as a tree: max_width n/16 gives 16 leaf counters, filled round robin.
            tree, tree_slices = parked_batch(max_width=max(1, n // 16))
            # And as a user gets them, with no layout option: the default fanin_max_width's leaves.
            default, default_slices = parked_batch()
            phases = [
                ("fanin_default_events_per_s", "fanin", default, default_slices),
                ("fanin_events_per_s", "fanin", flat, slices),
                # The same server-side function called bare from psycopg: what the database alone allows.
                ("fanin_sql_events_per_s", "fanin_sql", bare, bare_slices),
                ("fanin_tree_events_per_s", "fanin", tree, tree_slices),
                ("raw_update_per_s", "raw", flat, [[""] * len(s) for s in slices]),
                ("raw_update_engine_per_s", "raw_engine", flat, [[""] * len(s) for s in slices]),
            ]
            shift = rnd % len(phases)
            figures: dict[str, float] = {}
            for label, kind, batch_id, work in phases[shift:] + phases[:shift]:
                figures[label] = _concurrent(url, batch_id, kind, work)
                progress(f"throughput round {rnd + 1} {label}: {figures[label]:.0f}/s")
            rounds.append(figures)
        result: dict[str, Any] = {"reporters": reporters, "events": n, "rounds": rounds}
        for label in rounds[0]:
            result[label] = statistics.median(r[label] for r in rounds)
        # Each ratio is taken within a round (both figures under the same background load), then the median.
        for key, label in (
            ("default_ratio", "fanin_default_events_per_s"),
            ("ratio", "fanin_events_per_s"),
            ("tree_ratio", "fanin_tree_events_per_s"),
            ("sql_ratio", "fanin_sql_events_per_s"),
            ("engine_ratio", "raw_update_engine_per_s"),
        ):
            per_round = [r[label] / r["raw_update_per_s"] for r in rounds]
            result[key] = statistics.median(per_round)
            result[f"{key}_min"], result[f"{key}_max"] = min(per_round), max(per_round)
        return result


def _epoch(value: Any) -> float:
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    if value.tzinfo is None:
        value = value.replace(tzinfo=timezone.utc)
    return float(value.timestamp())


class PgStatStatements:
    """pg_stat_statements, when the server preloads it (it needs shared_preload_libraries and a restart)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.error: str | None = None
        try:
            with psycopg.connect(url, autocommit=True) as conn:
                conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
                conn.execute("SELECT count(*) FROM pg_stat_statements")
        except psycopg.Error as exc:
            self.error = str(exc).strip().splitlines()[0]

    def reset(self) -> None:
        if self.error is None:
            with psycopg.connect(self.url, autocommit=True) as conn:
                conn.execute("SELECT pg_stat_statements_reset()")

    def read(self, children: int) -> dict[str, Any]:
        if self.error is not None:
            return {"available": False, "why": self.error}
        with psycopg.connect(self.url, autocommit=True) as conn:
            rows = conn.execute(
                "SELECT query, calls FROM pg_stat_statements WHERE dbid = (SELECT oid FROM pg_database "
                "WHERE datname = current_database()) AND query NOT ILIKE '%pg_stat_statements%' ORDER BY calls DESC"
            ).fetchall()
        return {
            "available": True,
            "statements_per_child": sum(r[1] for r in rows) / children,
            "top": [{"calls": r[1], "query": r[0][:160]} for r in rows[:10]],
        }


def _reporter(url: str, batch_id: str, kind: str, ids: list[str], ready: Any, go: Any, out: Any) -> None:
    """One concurrent reporter process: the worker's own terminal path, or a raw UPDATE, once per id."""
    from celery import Celery

    from celery_fanin import FanIn
    from celery_fanin.protocol import Marker
    from celery_fanin.store.batches import Claim
    from celery_fanin.store.reports import record_starts
    from celery_fanin.worker import runtime

    claims: dict[str, Claim] = {}
    if kind in ("fanin", "fanin_one_conn", "fanin_batched", "fanin_sql"):  # what each child's message says, read first
        with psycopg.connect(url, autocommit=True) as db:
            rows = db.execute(
                "SELECT task_id, batch_id::text, idx, task_name FROM fanin_children WHERE task_id = ANY(%s)", (ids,)
            )
            claims = {r[0]: Claim(r[1], r[2], r[3]) for r in rows}
    if kind in ("fanin", "fanin_one_conn", "fanin_batched"):
        # fanin_batched: forked from a process running a worker's report batcher (bench.scaling), so that its reports
        # go through it, as a prefork pool process's do with `fanin_report_batching`.
        app = Celery("bench-reporter", set_as_current=False)
        app.conf.fanin_database_url = url
        fanin = FanIn(app)
        markers = [Marker(c.batch_id, c.index, None, task_name=c.task_name) for c in map(claims.get, ids) if c]
        with fanin.engine.connect():  # connect before the clock starts (the engine, and the report connection)
            pass
        record_starts(fanin.reports, [])
        if kind == "fanin_batched":
            from celery_fanin.worker import batching

            if not batching.active():
                raise RuntimeError("fanin_batched: this reporter was not forked from a process running a batcher")
        if kind in ("fanin_one_conn", "fanin_batched"):
            # The report path uses the report connection only: closing the engine's keeps one connection per
            # reporter, as a pool process reporting holds, so that 64 reporters fit a server's max_connections.
            fanin.engine.dispose()
        ready.release()
        go.wait()
        start, cpu = time.time(), time.process_time()
        for i, (task_id, marker) in enumerate(zip(ids, markers, strict=True)):
            runtime.current.reporter.record_child(fanin, task_id, marker, "succeeded", value=i, has_value=True)
    elif kind == "raw_engine":
        from sqlalchemy import create_engine, text

        engine = create_engine(
            url.replace("postgresql://", "postgresql+psycopg://"), pool_pre_ping=True, isolation_level="READ COMMITTED"
        )
        stmt = text("UPDATE bench_hot SET n = n - 1 WHERE id = 1 AND n > 0 RETURNING n")
        with engine.connect():
            pass
        ready.release()
        go.wait()
        start, cpu = time.time(), time.process_time()
        for _ in ids:
            with engine.begin() as conn:
                conn.execute(stmt).one()
    elif kind == "fanin_sql":
        from celery_fanin.store.batches import RECORD_TERMINAL_SQL, terminal_params

        conn = psycopg.connect(url, autocommit=True)
        ready.release()
        go.wait()
        start, cpu = time.time(), time.process_time()
        for task_id in ids:
            params = terminal_params(task_id, "succeeded", None, None, None, claim=claims[task_id])
            conn.execute(RECORD_TERMINAL_SQL, params).fetchone()
        conn.close()
    else:
        conn = psycopg.connect(url, autocommit=True)
        ready.release()
        go.wait()
        start, cpu = time.time(), time.process_time()
        for _ in ids:
            conn.execute("UPDATE bench_hot SET n = n - 1 WHERE id = 1 AND n > 0 RETURNING n").fetchone()
        conn.close()
    out.put((start, time.time(), len(ids), time.process_time() - cpu))


# What every reporter imports, loaded once into the fork server (see `_concurrent`).
_REPORTER_PRELOAD = ["bench.run", "celery", "celery_fanin", "celery_fanin.worker.hooks", "sqlalchemy", "psycopg"]


def _concurrent(
    url: str,
    batch_id: str,
    kind: str,
    work: list[list[str]],
    start_method: str = "forkserver",
    cpu: dict[str, float] | None = None,
) -> float:
    """Events/s of `len(work)` reporter processes started together, each reporting its list once.

    The clock starts once every reporter is connected, so how they start changes no figure, only the run's length.
    The default forks them from a server process started once per run with their imports done (a spawned
    interpreter took ~0.5 s of both cores per reporter, for every phase); the harness itself is not forked, as it
    holds broker connections and their threads. `start_method="fork"` forks the caller (bench.scaling starts up to
    64 per phase); the caller must then hold no connection that a reporter would use (each opens its own).

    `cpu`, if given, is filled with the CPU seconds spent from the start to the last reporter's end: "reporters"
    (their loops), "postgres" (the whole server, `postgres_cpu`)."""
    ctx: Any = multiprocessing.get_context(start_method)  # a str names no context type mypy can tell
    if start_method == "forkserver":
        ctx.set_forkserver_preload(_REPORTER_PRELOAD)  # no effect once the server runs: it is started once
    ready, go, out = ctx.Semaphore(0), ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_reporter, args=(url, batch_id, kind, ids, ready, go, out)) for ids in work]
    rate = timed_phase(url, procs, len(work), ready, go, out, cpu)
    for p in procs:
        p.join(30)
    return rate


def timed_phase(
    url: str, procs: list[Any], reporters: int, ready: Any, go: Any, out: Any, cpu: dict[str, float] | None
) -> float:
    """Start `procs`, wait until `reporters` `_reporter`s (theirs, or their children) are connected, start them
    together and collect their results: events/s, from the first one's start to the last one's end. `cpu` as
    `_concurrent` says. The caller joins `procs`."""
    for p in procs:
        p.start()
    for _ in range(reporters):
        if not ready.acquire(timeout=120):
            raise RuntimeError("a reporter process did not start")
    try:
        pg = postgres_cpu(url) if cpu is not None else 0.0
    finally:
        go.set()  # whatever happened, no reporter is left waiting (the process would wait for it at its exit)
    results = [out.get(timeout=600) for _ in range(reporters)]
    if cpu is not None:
        cpu["postgres"] = postgres_cpu(url) - pg
        cpu["reporters"] = sum(r[3] for r in results)
    start = min(r[0] for r in results)
    end = max(r[1] for r in results)
    return sum(r[2] for r in results) / (end - start)


@functools.cache
def _postmaster(url: str) -> int:
    """The local server's postmaster: the parent of a backend."""
    with psycopg.connect(url, autocommit=True) as db:  # read while the backend lives: it exits with the connection
        row = db.execute("SELECT pg_backend_pid()").fetchone()
        assert row is not None
        return int(Path(f"/proc/{row[0]}/stat").read_text().rsplit(")", 1)[1].split()[1])


def postgres_cpu(url: str) -> float:
    """CPU seconds the whole local PostgreSQL server has used so far: its postmaster's own and its exited children's
    (which it reaps), and each running child's (backends, WAL writer, ...), from /proc. Read at two points, the
    difference counts a backend that exited between them once."""
    postmaster = _postmaster(url)
    fields = Path(f"/proc/{postmaster}/stat").read_text().rsplit(")", 1)[1].split()
    total = sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")  # utime, stime, cutime, cstime
    for child in Path(f"/proc/{postmaster}/task/{postmaster}/children").read_text().split():
        with contextlib.suppress(OSError):
            stat = Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")
    return total


# --- report ---------------------------------------------------------------------------------------------------


def machine() -> dict[str, Any]:
    import celery
    import kombu

    mem = next(
        (line.split()[1] for line in Path("/proc/meminfo").read_text().splitlines() if line.startswith("MemTotal")), "0"
    )
    versions = {
        "python": platform.python_version(),
        "celery": celery.__version__,
        "kombu": kombu.__version__,
        "psycopg": psycopg.__version__,
    }
    with psycopg.connect(ADMIN_URL, autocommit=True) as conn:
        versions["postgresql"] = str(conn.execute("SHOW server_version").fetchone()[0])  # type: ignore[index]
    versions["redis"] = str(redis.Redis.from_url(REDIS_SERVER).info("server")["redis_version"])
    try:
        from kombu import Connection

        with Connection(RABBITMQ_URL, connect_timeout=3) as conn:
            conn.connect()
            props = conn.connection.server_properties
            versions["rabbitmq"] = props.get("version", "?")
    except Exception:  # noqa: BLE001 - not needed on a Redis run
        versions["rabbitmq"] = "unreachable"
    return {
        "nproc": os.cpu_count(),
        "memory_gib": round(int(mem) / 1024 / 1024, 1),
        "platform": platform.platform(),
        "versions": versions,
    }


def paired(contenders: dict[str, Any], n: str, num: str, den: str, key: str = "e2e_s") -> dict[str, Any] | None:
    """`num`'s figure over `den`'s at N = `n`, taken within each repeat that measured both (the two ran back to
    back, under the same load), summarised over those repeats: median, min, max and the ratios. None when no
    repeat measured both (a contender this run did not have, or failed runs)."""
    a, b = contenders.get(num, {}).get(n), contenders.get(den, {}).get(n)
    if a is None or b is None:
        return None

    def by_repeat(f: dict[str, Any]) -> dict[int, float]:
        values = f[key]["runs"]
        # Reports before 2026-12-05 did not record which repeat a run was; their runs are in repeat order when
        # every contender ran in every repeat (no run failed), and are not paired otherwise.
        reps = f.get("reps", list(range(len(values))))
        return dict(zip(reps, values, strict=True))

    x, y = by_repeat(a), by_repeat(b)
    if ("reps" not in a or "reps" not in b) and len(x) != len(y):
        return None
    ratios = [x[r] / y[r] for r in sorted(x.keys() & y.keys())]
    return summary(ratios) if ratios else None


def _paired_target(ratio: dict[str, Any] | None, want: str, met: Callable[[float], bool]) -> dict[str, Any]:
    if ratio is None:
        return {"value": None, "target": want, "met": False}
    value = float(ratio["median"])
    return {
        "value": value,
        "min": ratio["min"],
        "max": ratio["max"],
        "repeats": len(ratio["runs"]),
        "target": want,
        "met": met(value),
    }


def evaluate(report: dict[str, Any]) -> dict[str, Any]:
    """The issue's targets, judged on this run's own figures (None: not measured in this run). Every ratio of two
    contenders is paired within a repeat (`paired`)."""
    c = report["contenders"]
    common = set(c["group"]) & set(c["chord"]) & set(c["fanin"])
    n = "10000" if "10000" in common else str(max(int(x) for x in common))
    lat, chord_lat = report["latency"]["fanin"], report["latency"]["chord"]
    db = report["db"]
    tput = report["throughput"]
    rt = db["terminal_roundtrips_per_event"]
    return {
        "at_n": int(n),
        "dispatch_speedup_vs_group": _paired_target(
            paired(c, n, "group", "fanin", "dispatch_s"), ">= 5", lambda v: v >= 5
        ),
        "e2e_ratio_vs_group_ff": _paired_target(paired(c, n, "fanin", "group_ff"), "<= 1.0", lambda v: v <= 1.0),
        "e2e_ratio_vs_group": _paired_target(paired(c, n, "fanin", "group"), "<= 1.0", lambda v: v <= 1.0),
        "e2e_ratio_vs_chord": _paired_target(paired(c, n, "fanin", "chord"), "<= 0.8", lambda v: v <= 0.8),
        # Issue 23: the successor no later than chord's body, in the same run.
        "successor_p50_ms": {
            "value": lat["p50_ms"],
            "target": f"<= chord's {chord_lat['p50_ms']:.1f}",
            "met": lat["p50_ms"] <= chord_lat["p50_ms"],
        },
        "successor_p99_ms": {
            "value": lat["p99_ms"],
            "target": f"<= chord's {chord_lat['p99_ms']:.1f}",
            "met": lat["p99_ms"] <= chord_lat["p99_ms"],
        },
        "roundtrips_per_terminal_event": {"value": rt, "target": "== 1", "met": rt is not None and rt <= 1.0},
        # Issue 23: a wide batch with default settings at least as fast as the raw one-row UPDATE.
        "throughput_ratio_vs_raw_update": {
            "value": tput["default_ratio"],
            "target": ">= 1.0",
            "met": tput["default_ratio"] >= 1.0,
        },
    }


def table(report: dict[str, Any]) -> str:
    lines = []
    c = report["contenders"]
    lines.append(
        f"{'N':>7} {'contender':<8} {'dispatch s (min-max)':>26} {'end to end s (min-max)':>28} {'peak RSS MB':>12}"
    )
    measured = [x for x in CONTENDERS if x in c]
    for n in sorted(set().union(*(c[x] for x in measured)), key=int):
        for contender in measured:
            if n not in c[contender]:
                lines.append(f"{int(n):>7} {contender:<8} (failed: see errors)")
                continue
            f = c[contender][n]
            d, e, r = f["dispatch_s"], f["e2e_s"], f["rss_peak_mb"]
            lines.append(
                f"{int(n):>7} {contender:<8} {d['median']:>9.3f} ({d['min']:.3f}-{d['max']:.3f})"
                f"{'':>3}{e['median']:>10.3f} ({e['min']:.3f}-{e['max']:.3f}){'':>3}{r['median']:>10.0f}"
            )
    lat = report["latency"]
    for contender, v in lat.items():
        lines.append(
            f"successor latency {contender}: p50 {v['p50_ms']:.1f} ms, p99 {v['p99_ms']:.1f} ms, "
            f"max {v['max_ms']:.1f} ms over {v['batches']} batches of {v['batch_size']}"
        )
    db = report["db"]
    lines.append(
        f"per terminal event: {db['terminal_statements_per_event']} statements, "
        f"{db['terminal_roundtrips_per_event']} round trips; per child, all fan-in work (start + terminal): "
        f"{db['all_statements_per_child']:.2f} statements, "
        f"{db['all_roundtrips_per_child']:.2f} round trips"
    )
    t = report["throughput"]
    lines.append(
        f"terminal events, one batch with the default layout, {t['reporters']} reporters, medians of "
        f"{len(t['rounds'])} rounds: {t['fanin_default_events_per_s']:.0f}/s; raw single-row UPDATE "
        f"{t['raw_update_per_s']:.0f}/s (ratio {_ratio(t, 'default_ratio')}); same UPDATE through SQLAlchemy "
        f"engine.begin() {t['raw_update_engine_per_s']:.0f}/s"
    )
    lines.append(
        f"the same {t['events']} events on one flat counter (max_width={t['events']}): "
        f"{t['fanin_events_per_s']:.0f}/s (ratio {_ratio(t, 'ratio')})"
    )
    lines.append(
        f"the same function called bare from psycopg (no worker hook): {t['fanin_sql_events_per_s']:.0f}/s "
        f"(ratio {_ratio(t, 'sql_ratio')})"
    )
    lines.append(
        f"the same {t['events']} events on a tree of 16 leaf counters: {t['fanin_tree_events_per_s']:.0f}/s "
        f"(ratio {_ratio(t, 'tree_ratio')} of the raw single-row UPDATE)"
    )
    for name, target in report["targets"].items():
        if isinstance(target, dict):
            lines.append(f"target {name}: {_met(target)} (want {target['target']})")
    return "\n".join(lines)


def _ratio(t: dict[str, Any], key: str) -> str:
    """A throughput ratio: the median of the rounds' ratios, and their range when there was more than one round."""
    if t[f"{key}_min"] == t[f"{key}_max"]:
        return f"{t[key]:.2f}"
    return f"{t[key]:.2f} ({t[f'{key}_min']:.2f}–{t[f'{key}_max']:.2f})"


NAMES = {"group": "group", "group_ff": "group, fire and forget", "chord": "chord", "fanin": "fan_in_group"}


def markdown(report: dict[str, Any], command: str) -> str:
    """The run's results as the Markdown block BENCHMARKS.md carries for its broker (see `update_markdown`): where
    and when it ran, and one table of dispatch, end to end and producer memory per N and contender. The other
    figures go in the targets block (`targets_markdown`), beside the other broker's."""
    c, m = report["contenders"], report["machine"]
    v = m["versions"]
    out = [
        f"Command: `{command}`, run at {report['started_at'][:16].replace('T', ' ')} UTC, "
        f"{report['duration_s']:.0f} s. "
        f"Machine: {m['nproc']} cores, {m['memory_gib']} GiB, {m['platform']}; Python {v['python']}, Celery "
        f"{v['celery']}, kombu {v['kombu']}, psycopg {v['psycopg']}, PostgreSQL {v['postgresql']}, Redis "
        f"{v['redis']}, RabbitMQ {v['rabbitmq']}. Worker: `celery worker -P {report['settings']['pool']}`.",
        "",
        "| N | contender | dispatch s, median (min–max) | end to end s, median (min–max) | producer peak RSS MB |",
        "|---:|---|---:|---:|---:|",
    ]
    measured = [x for x in CONTENDERS if x in c]  # a report before 2026-12-05 has no fire-and-forget group
    for n in sorted(set().union(*(c[x] for x in measured)), key=int):
        for contender in measured:
            f = c[contender].get(n)
            if f is None:
                out.append(f"| {int(n):,} | {NAMES[contender]} | failed (see the JSON's errors) | | |")
                continue
            d, e, r = f["dispatch_s"], f["e2e_s"], f["rss_peak_mb"]
            out.append(
                f"| {int(n):,} | {NAMES[contender]} | {d['median']:.3f} ({d['min']:.3f}–{d['max']:.3f}) | "
                f"{e['median']:.3f} ({e['min']:.3f}–{e['max']:.3f}) | {r['median']:.0f} |"
            )
    return "\n".join(out)


def _met(target: dict[str, Any], digits: int = 2) -> str:
    """A target's value (a paired ratio with its range over the repeats) and whether it was met."""
    value = target["value"]
    if value is None:
        return "not measured in this run"
    shown = f"{value:.{digits}f}" if isinstance(value, float) else str(value)
    if "min" in target and target["min"] != target["max"]:
        shown += f" ({target['min']:.{digits}f}–{target['max']:.{digits}f})"
    return f"{shown} {'met' if target['met'] else '**missed**'}"


def _target_cells(r: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(figure, target, this run's value) for one report: the targets, and the per-event figures sizing needs."""
    t, db, chord, tg = r["throughput"], r["db"], r["latency"]["chord"], r["targets"]
    return [
        ("dispatch speedup vs `group` (`apply_async` wall time)", ">= 5", _met(tg["dispatch_speedup_vs_group"])),
        ("end to end vs a fire-and-forget `group`", "<= 1.0", _met(tg["e2e_ratio_vs_group_ff"])),
        ("end to end vs `group` keeping its results", "<= 1.0", _met(tg["e2e_ratio_vs_group"])),
        ("end to end vs `chord`", "<= 0.8", _met(tg["e2e_ratio_vs_chord"])),
        (
            "successor latency p50, ms (last child's commit → successor's first line)",
            "<= chord's p50",
            _met(tg["successor_p50_ms"], 1),
        ),
        ("successor latency p99, ms", "<= chord's p99", _met(tg["successor_p99_ms"], 1)),
        ("`chord`'s own successor latency p50 / p99, ms", "", f"{chord['p50_ms']:.1f} / {chord['p99_ms']:.1f}"),
        (
            "round trips per terminal event (counted at the worker's driver)",
            "== 1",
            _met(tg["roundtrips_per_terminal_event"]),
        ),
        (
            "all fan-in statements / round trips per child",
            "",
            f"{db['all_statements_per_child']:.2f} / {db['all_roundtrips_per_child']:.2f}",
        ),
        (
            "one batch, default layout (`fanin_max_width`): terminal events/s, and its ratio to a raw one-row `UPDATE`",
            ">= 1.0",
            f"{t['fanin_default_events_per_s']:.0f}/s, {_met(tg['throughput_ratio_vs_raw_update'])}",
        ),
        (
            "the same batch on one flat counter: terminal events/s, and its ratio to the raw `UPDATE`",
            "",
            f"{t['fanin_events_per_s']:.0f}/s, {t['ratio']:.2f}",
        ),
        (
            "a tree of 16 leaf counters: terminal events/s, and its ratio to the raw `UPDATE`",
            "",
            f"{t['fanin_tree_events_per_s']:.0f}/s, {t['tree_ratio']:.2f}",
        ),
        ("the raw one-row `UPDATE` (one round trip, autocommit)", "", f"{t['raw_update_per_s']:.0f}/s"),
    ]


def targets_markdown(reports: dict[str, dict[str, Any]]) -> str:
    """One table of the targets, and of the per-event figures sizing needs, for every broker that has a report
    (`reports`: broker -> the run's report), as the targets block of BENCHMARKS.md."""
    brokers = [b for b in ("redis", "rabbitmq") if b in reports]
    names = {"redis": "Redis", "rabbitmq": "RabbitMQ"}
    at_n = {reports[b]["targets"]["at_n"] for b in brokers}
    where = f"N = {next(iter(at_n)):,}" if len(at_n) == 1 else "the largest N of each run"
    runs = ", ".join(f"{names[b]} {reports[b]['started_at'][:16].replace('T', ' ')} UTC" for b in brokers)
    cells = [_target_cells(reports[b]) for b in brokers]
    rows = [
        f"Runs: {runs}; the ratios to `group` and `chord` at {where}, each taken within one repeat (the contenders "
        "of a repeat ran back to back): the median of the repeats' ratios, and their range.",
        "",
        "| figure | target | " + " | ".join(names[b] for b in brokers) + " |",
        "|---|---|" + "---:|" * len(brokers),
    ]
    for i, (label, target, _) in enumerate(cells[0]):
        rows.append(f"| {label} | {target} | " + " | ".join(c[i][2] for c in cells) + " |")
    t = reports[brokers[0]]["throughput"]
    rows += [
        "",
        f"Throughput: {t['events']:,} terminal events on one batch from {t['reporters']} processes, medians of "
        f"{len(t['rounds'])} rounds (each ratio taken within its round).",
    ]
    return "\n".join(rows)


def has_block(path: Path, name: str) -> bool:
    text = path.read_text()
    return f"<!-- bench:{name}:start -->" in text and f"<!-- bench:{name}:end -->" in text


def update_markdown(path: Path, broker: str, block: str) -> None:
    """Replace the text between the markers of block `broker` (a broker, or `targets`) in `path` (BENCHMARKS.md)."""
    start, end = f"<!-- bench:{broker}:start -->", f"<!-- bench:{broker}:end -->"
    text = path.read_text()
    if not has_block(path, broker):
        raise SystemExit(f"{path} has no {start} ... {end} block to rewrite")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    path.write_text(f"{head}{start}\n{block}\n{end}{tail}")


def plot(report: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for contender in [x for x in CONTENDERS if x in report["contenders"]]:
        figs = report["contenders"][contender]
        ns = sorted(figs, key=int)
        med = [figs[n]["e2e_s"]["median"] for n in ns]
        err = [
            [m - figs[n]["e2e_s"]["min"] for n, m in zip(ns, med, strict=True)],
            [figs[n]["e2e_s"]["max"] - m for n, m in zip(ns, med, strict=True)],
        ]
        ax.errorbar([int(n) for n in ns], med, yerr=err, marker="o", capsize=3, label=contender)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("children (N)")
    ax.set_ylabel("end to end, s (median, min-max)")
    ax.set_title(f"dispatch start to successor start ({report['broker']}, prefork -c 2)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# --- entry point ------------------------------------------------------------------------------------------------


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--broker", choices=("redis", "rabbitmq"), default="redis")
    p.add_argument(
        "--n",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[1000, 10000, 100000],
        help="comma-separated batch sizes (default 1000,10000,100000)",
    )
    p.add_argument("--repeats", type=int, default=3, help="runs per contender and N (default 3)")
    p.add_argument("--latency-batches", type=int, default=200)
    p.add_argument("--latency-size", type=int, default=10)
    p.add_argument("--count-children", type=int, default=200)
    p.add_argument("--throughput-children", type=int, default=10000)
    p.add_argument("--reporters", type=int, default=16)
    p.add_argument(
        "--throughput-rounds",
        type=int,
        default=3,
        help="rounds of the throughput phase, each on fresh batches (default 3)",
    )
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    p.add_argument("--smoke", action="store_true", help="tiny N, one repeat: checks the harness, measures nothing")
    p.add_argument(
        "--markdown",
        type=Path,
        default=None,
        help="rewrite this broker's block of this file (BENCHMARKS.md) with the run's figures",
    )
    args = p.parse_args(argv)
    if args.smoke:
        args.n, args.repeats, args.latency_batches, args.latency_size = [20], 1, 4, 3
        # Four reporter processes, not sixteen: each is a spawned interpreter, and the phase's code is the same.
        args.count_children, args.reporters, args.throughput_children, args.throughput_rounds = 10, 4, 4 * 5, 1
    return args


def start_run(out: Path) -> tuple[Path, float, Callable[[str], None]]:
    """A run's log folder under `out` (both created), its start time, and its progress printer."""
    # A background job ignores SIGINT: let SIGTERM unwind too, so the workers stop and the database is dropped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    out.mkdir(parents=True, exist_ok=True)
    log_dir = out / "logs"
    log_dir.mkdir(exist_ok=True)
    started = time.time()

    def progress(msg: str) -> None:
        print(f"[{time.time() - started:7.1f}s] {msg}", flush=True)

    return log_dir, started, progress


def worker_argv(queue: str, name: str, concurrency: int = 2) -> list[str]:
    """The `celery worker` arguments every harness starts its one worker with (prefork, quiet, no gossip)."""
    return [
        "worker",
        "-P",
        "prefork",
        "-c",
        str(concurrency),
        "-l",
        "WARNING",
        "-Q",
        queue,
        "--without-gossip",
        "--without-mingle",
        "--without-heartbeat",
        "-n",
        name,
    ]


@contextmanager
def services(broker_name: str, prefix: str) -> Iterator[tuple[str, str, str, str, dict[str, str]]]:
    """A scratch database (migrated) and Redis database, a fresh queue name, the broker's URL and the environment
    of the harness's processes: (database URL, Redis URL, queue, broker URL, environment)."""
    with database() as db_url, redis_database() as redis_url:
        queue = f"{prefix}-{uuid.uuid4().hex[:8]}"
        broker = redis_url if broker_name == "redis" else RABBITMQ_URL
        env = harness_env(db_url, redis_url, broker, queue)
        from bench.tasks import app
        from celery_fanin import FanIn

        FanIn(app).migrate()
        yield db_url, redis_url, queue, broker, env


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    log_dir, started, progress = start_run(args.out)
    with services(args.broker, "bench") as (_, redis_url, queue, broker, env):
        from bench.tasks import app, child
        from celery_fanin import FanIn

        marks = redis.Redis.from_url(redis_url)
        worker_args = worker_argv(queue, f"bench-{os.getpid()}@%h")
        # The timed runs use a worker without the statement counters (they cost a Redis write per fan-in child);
        # the counting phase swaps in one that has them.
        worker = Proc(worker_args, env, log_dir / "worker.log")
        relay = Proc(["fanin", "relay"], env, log_dir / "relay.log")
        try:
            bench = Bench(args, env, marks, log_dir)
            child.delay(0, "probe", 1)
            try:
                bench.wait_mark("bench:end:probe", 90)
            except TimeoutError:
                log = (log_dir / "worker.log").read_text()[-3000:]
                raise RuntimeError(f"the worker did not start: {log}") from None
            relay.wait_for("relay started", 30)
            progress(f"worker and relay up (broker {args.broker}, queue {queue})")
            report: dict[str, Any] = {
                "command": " ".join(["python -m bench", *(argv if argv is not None else sys.argv[1:])]),
                "broker": args.broker,
                "started_at": datetime.now(timezone.utc).isoformat(),
                "machine": machine(),
                "settings": {"n": args.n, "repeats": args.repeats, "pool": "prefork -c 2", "smoke": args.smoke},
            }
            report["contenders"] = bench.contenders(progress)
            report["latency"] = bench.latency(progress)
            worker.stop()
            worker = Proc(worker_args, {**env, "BENCH_COUNT_SQL": "1"}, log_dir / "worker-counting.log")
            child.delay(0, "probe-counting", 1)
            bench.wait_mark("bench:end:probe-counting", 90)
            report["db"] = bench.db_counts(progress)
            report["throughput"] = bench.throughput(progress)
            report["errors"] = bench.errors
            report["targets"] = evaluate(report)
        finally:
            relay.stop()
            worker.stop()
            purge_queue(broker, queue, delete=args.broker == "rabbitmq")
            FanIn(app).dispose()
    report["duration_s"] = time.time() - started
    name = f"bench-{args.broker}{'-smoke' if args.smoke else ''}"
    (args.out / f"{name}.json").write_text(json.dumps(report, indent=2, default=str))
    report["plot"] = str(args.out / f"{name}.png") if plot(report, args.out / f"{name}.png") else None
    (args.out / f"{name}.json").write_text(json.dumps(report, indent=2, default=str))
    print(table(report))
    print(f"wrote {args.out / f'{name}.json'}" + (f" and {report['plot']}" if report["plot"] else ""))
    if args.markdown is not None:
        update_markdown(args.markdown, args.broker, markdown(report, report["command"]))
        print(f"rewrote the {args.broker} figures in {args.markdown}")
        if has_block(args.markdown, "targets"):
            # Each broker's latest report in --out (the other broker's from its own, earlier run).
            suffix = "-smoke" if args.smoke else ""
            paths = {b: args.out / f"bench-{b}{suffix}.json" for b in ("redis", "rabbitmq")}
            reports = {b: json.loads(p.read_text()) for b, p in paths.items() if p.exists()}
            update_markdown(args.markdown, "targets", targets_markdown(reports))
            print(f"rewrote the targets in {args.markdown}")
    return 0
