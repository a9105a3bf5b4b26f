"""How fast one worker drains children of each kind: `python -m bench.drain --n 5000 --rounds 3`.

The children are published first, with no worker running; then a `celery worker -P prefork -c 2` is started and
the time from the first child finishing to the last is taken (children count themselves in Redis). Kinds, in
alternating order per round: `plain` (no result stored, no fan-in: the floor), `result` (the result stored in
Redis, as a group's or chord's children), `fanin` (children of one `fan_in_group`), `fanin-nostart`
(`fanin_track_started = False`), `fanin-tree` (the same batch as a tree of 16 leaf counters, `max_width=n/16`: the
pool processes' reports then rarely queue on one counter row's lock), `fanin-batched` (`fanin_report_batching`:
the pool processes' reports committed in groups by the worker's main process) and, on request only, `fanin-nosync` (the
database's `synchronous_commit` off while it drains: not something celery-fanin offers, since a terminal outcome
must survive a crash of the database; it shows what waiting for the WAL flush costs the worker). This isolates
the worker's cost per child from dispatch, which the main benchmark mixes in. Prints the rate of each kind per
round and their medians, with the CPU time per child that the worker's main process, its pool processes
(together), PostgreSQL and Redis spent over the middle 80% of each drain.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import time
import uuid
from pathlib import Path

import redis

from bench.run import ROOT, Proc, database, harness_env, purge_queue, redis_database, worker_argv

KINDS = ("plain", "result", "fanin", "fanin-nostart", "fanin-tree", "fanin-batched")
EXTRA_KINDS = ("fanin-nosync",)


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _pids(*pgrep_args: str) -> list[int]:
    out = subprocess.run(["pgrep", *pgrep_args], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


class CpuMeter:
    """CPU time, by process role, that the machine spends between two points of a drain.

    The worker's main process, its pool processes, the PostgreSQL backends serving the drain's database and the
    Redis server: per child, these say where a child's cost lands, which wall time alone cannot.
    """

    ROLES = ("main", "pool", "postgres", "redis")

    def __init__(self, worker_pid: int, database: str, url: str) -> None:
        self.url = url
        self.roles = {
            "main": [worker_pid],
            "pool": _pids("-P", str(worker_pid)),
            "postgres": _pids("-f", f"postgres: .* {database} "),
            "redis": _pids("-x", "redis-server"),
        }

    def read(self) -> dict[str, float]:
        totals = {"commits": _commits(self.url)}
        for role, pids in self.roles.items():
            total = 0.0
            for pid in pids:
                try:
                    total += _cpu_seconds(pid)
                except (FileNotFoundError, ProcessLookupError):  # a backend that closed meanwhile
                    continue
            totals[role] = total
        return totals


def drain(
    kind: str, n: int, env: dict[str, str], marks: redis.Redis, log_dir: Path, concurrency: int = 2
) -> dict[str, float]:
    """Drain n children of one kind: their rate, and the CPU per child (µs) of each role over the middle 80%."""
    from celery import group

    from bench.tasks import app, child, mark
    from celery_fanin import fan_in_group

    run = f"drain-{kind}-{uuid.uuid4().hex[:6]}"
    if kind == "plain":
        group([child.s(i, run, n).set(ignore_result=True) for i in range(n)]).apply_async()
    elif kind == "result":
        group([child.s(i, run, n) for i in range(n)]).apply_async()
    else:
        sigs = [child.s(i, run, n) for i in range(n)]  # as a user writes them (see bench/dispatch.py)
        options = {"max_width": max(1, n // 16)} if kind == "fanin-tree" else {}
        fan_in_group(sigs, then=mark.s(run), app=app, **options).apply_async()
    if kind == "fanin-nosync":  # the worker's connections are opened after this, so they take it
        _synchronous_commit(env["FANIN_DATABASE_URL"], "off")
    worker_env = {
        **env,
        "BENCH_TRACK_STARTED": "0" if kind == "fanin-nostart" else "1",
        "BENCH_REPORT_BATCHING": "1" if kind == "fanin-batched" else "0",
    }
    worker = Proc(
        worker_argv(env["BENCH_QUEUE"], f"drain-{os.getpid()}@%h", concurrency),
        worker_env,
        log_dir / f"drain-{kind}.log",
    )
    key = f"bench:done:{run}"
    first = None
    deadline = time.monotonic() + 120 + n / 50
    meter: CpuMeter | None = None
    window: list[tuple[int, dict[str, float]]] = []  # (children done, CPU by role) at 10% and 90%
    database = env["FANIN_DATABASE_URL"].rsplit("/", 1)[1]
    try:
        while True:
            done = int(marks.get(key) or 0)
            if done >= 1 and first is None:
                first = time.monotonic()
            if meter is None and done >= n // 10:  # the pool processes and connections all exist by now
                meter = CpuMeter(worker.proc.pid, database, env["FANIN_DATABASE_URL"])
                window.append((done, meter.read()))
            elif meter is not None and len(window) == 1 and done >= n - n // 10:
                window.append((done, meter.read()))
            if done >= n:
                assert first is not None
                figures = {"rate": n / (time.monotonic() - first)}
                if len(window) == 2:
                    (d0, c0), (d1, c1) = window
                    figures.update({role: 1e6 * (c1[role] - c0[role]) / max(1, d1 - d0) for role in CpuMeter.ROLES})
                    figures["per_commit"] = (d1 - d0) / max(1.0, c1["commits"] - c0["commits"])
                return figures
            if time.monotonic() > deadline:
                raise TimeoutError(f"{kind}: {done} of {n} children done")
            time.sleep(0.005)
    finally:
        worker.stop()
        if kind == "fanin-nosync":
            _synchronous_commit(env["FANIN_DATABASE_URL"], "on")


def _commits(url: str) -> float:
    """Transactions committed in the drain's database so far (PostgreSQL's statistics: flushed by each backend
    within a second, so read over a window of several seconds)."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SELECT pg_stat_clear_snapshot()")
        row = conn.execute("SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()").fetchone()
    return float(row[0]) if row else 0.0


def _synchronous_commit(url: str, value: str) -> None:
    import psycopg
    from psycopg import sql

    with psycopg.connect(url, autocommit=True) as conn:
        name = conn.info.dbname
        conn.execute(
            sql.SQL("ALTER DATABASE {} SET synchronous_commit = {}").format(sql.Identifier(name), sql.Literal(value))
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.drain", description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=5000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--kinds",
        type=lambda s: s.split(","),
        default=list(KINDS),
        help=f"comma-separated, from {', '.join(KINDS + EXTRA_KINDS)} (default: all but the last)",
    )
    p.add_argument("--concurrency", type=int, default=2, help="the worker's pool processes (default 2)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "report")
    args = p.parse_args(argv)
    kinds = [k for k in args.kinds if k in KINDS + EXTRA_KINDS]
    if kinds != args.kinds:
        p.error(f"unknown kinds: {', '.join(sorted(set(args.kinds) - set(kinds)))}")
    log_dir = args.out / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    with database() as url, redis_database() as redis_url:
        queue = f"bench-drain-{uuid.uuid4().hex[:6]}"
        env = harness_env(url, redis_url, redis_url, queue)
        from bench.tasks import app
        from celery_fanin import FanIn

        FanIn(app).migrate()
        marks = redis.Redis.from_url(redis_url)
        runs: dict[str, list[dict[str, float]]] = {k: [] for k in kinds}
        try:
            for r in range(args.rounds):
                for kind in kinds[r % len(kinds) :] + kinds[: r % len(kinds)]:
                    runs[kind].append(drain(kind, args.n, env, marks, log_dir, args.concurrency))
                    print(f"round {r}: {kind:<14} {runs[kind][-1]['rate']:7.0f} children/s", flush=True)
        finally:
            purge_queue(redis_url, queue)
            FanIn(app).dispose()
    print(
        f"{'kind':<14} {'children/s, median (min-max)':<30} {'children per commit':<20} CPU per child (µs, median): "
        + " ".join(f"{role:>8}" for role in CpuMeter.ROLES)
    )
    for kind in kinds:
        rates = [f["rate"] for f in runs[kind]]
        cpu = [
            statistics.median(f[role] for f in runs[kind] if role in f)
            if any(role in f for f in runs[kind])
            else float("nan")
            for role in CpuMeter.ROLES
        ]
        rate = f"{statistics.median(rates):.0f} ({min(rates):.0f}-{max(rates):.0f})"
        shared = [f["per_commit"] for f in runs[kind] if "per_commit" in f]
        per_commit = f"{statistics.median(shared):.2f}" if shared else "-"
        print(f"{kind:<14} {rate:<30} {per_commit:<20} {'':<27} " + " ".join(f"{c:8.0f}" for c in cpu))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
