"""How fast one worker drains children of each kind: `python -m bench.drain --n 5000 --rounds 3`.

The children are published first, with no worker running; then a `celery worker -P prefork -c 2` is started and
the time from the first child finishing to the last is taken (children count themselves in Redis). Kinds, in
alternating order per round: `plain` (no result stored, no fan-in: the floor), `result` (the result stored in
Redis, as a group's or chord's children), `fanin` (children of one `fan_in_group`), `fanin-nostart`
(`fanin_track_started = False`), `fanin-tree` (the same batch as a tree of 16 leaf counters, `max_width=n/16`: the
pool processes' reports then rarely queue on one counter row's lock) and, on request only, `fanin-nosync` (the
database's `synchronous_commit` off while it drains: not something celery-fanin offers, since a terminal outcome
must survive a crash of the database; it shows what waiting for the WAL flush costs the worker). This isolates
the worker's cost per child from dispatch, which the main benchmark mixes in. Prints the rate of each kind per
round and their medians.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import uuid
from pathlib import Path

import redis

from bench.run import ROOT, Proc, database, harness_env, purge_queue, redis_database

KINDS = ("plain", "result", "fanin", "fanin-nostart", "fanin-tree")
EXTRA_KINDS = ("fanin-nosync",)


def drain(kind: str, n: int, env: dict[str, str], marks: redis.Redis, log_dir: Path) -> float:
    from celery import group

    from bench.tasks import app, child, mark
    from celery_fanin import fan_in_group

    run = f"drain-{kind}-{uuid.uuid4().hex[:6]}"
    if kind == "plain":
        group([child.s(i, run, n).set(ignore_result=True) for i in range(n)]).apply_async()
    elif kind == "result":
        group([child.s(i, run, n) for i in range(n)]).apply_async()
    else:
        sigs = [child.s(i, run, n).set(ignore_result=True) for i in range(n)]
        options = {"max_width": max(1, n // 16)} if kind == "fanin-tree" else {}
        fan_in_group(sigs, then=mark.s(run), app=app, **options).apply_async()
    if kind == "fanin-nosync":  # the worker's connections are opened after this, so they take it
        _synchronous_commit(env["FANIN_DATABASE_URL"], "off")
    worker_env = {**env, "BENCH_TRACK_STARTED": "0" if kind == "fanin-nostart" else "1"}
    worker = Proc(["worker", "-P", "prefork", "-c", "2", "-l", "WARNING", "-Q", env["BENCH_QUEUE"],
                   "--without-gossip", "--without-mingle", "--without-heartbeat", "-n", f"drain-{os.getpid()}@%h"],
                  worker_env, log_dir / f"drain-{kind}.log")  # fmt: skip
    key = f"bench:done:{run}"
    first = None
    deadline = time.monotonic() + 120 + n / 50
    try:
        while True:
            done = int(marks.get(key) or 0)
            if done >= 1 and first is None:
                first = time.monotonic()
            if done >= n:
                assert first is not None
                return n / (time.monotonic() - first)
            if time.monotonic() > deadline:
                raise TimeoutError(f"{kind}: {done} of {n} children done")
            time.sleep(0.005)
    finally:
        worker.stop()
        if kind == "fanin-nosync":
            _synchronous_commit(env["FANIN_DATABASE_URL"], "on")


def _synchronous_commit(url: str, value: str) -> None:
    import psycopg
    from psycopg import sql

    with psycopg.connect(url, autocommit=True) as conn:
        name = conn.info.dbname
        conn.execute(sql.SQL("ALTER DATABASE {} SET synchronous_commit = {}").format(sql.Identifier(name),
                                                                                    sql.Literal(value)))  # fmt: skip


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
        rates: dict[str, list[float]] = {k: [] for k in kinds}
        try:
            for r in range(args.rounds):
                for kind in kinds[r % len(kinds) :] + kinds[: r % len(kinds)]:
                    rates[kind].append(drain(kind, args.n, env, marks, log_dir))
                    print(f"round {r}: {kind:<14} {rates[kind][-1]:7.0f} children/s", flush=True)
        finally:
            purge_queue(redis_url, queue)
            FanIn(app).dispose()
    for kind in kinds:
        print(f"{kind:<14} median {statistics.median(rates[kind]):6.0f} children/s "
              f"(min {min(rates[kind]):.0f}, max {max(rates[kind]):.0f})")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
