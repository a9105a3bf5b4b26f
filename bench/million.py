"""A very wide batch: `python -m bench.million --n 1000000 [--e2e]`.

Streams N children from a generator into one fan-in (chunks of `fanin_chunk_size`, a tree above `max_width`) and
prints the dispatch time, the producer's peak RSS, and the counts the store holds (planned, child rows, distinct
indexes, leaves, published), which must all equal N.

Without `--e2e` no worker consumes the children (the producer side alone). With `--e2e` a `celery worker -P
prefork` and a relay run from the start, the children are consumed while the producer is still streaming, and the
run ends when the successor's first line runs: it then also prints the end-to-end time, the worker's rate, and
the final counts (succeeded = N, no failures, one successor run). Its own database and Redis database, both
dropped afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import redis

from bench.run import ROOT, Proc, database, harness_env, redis_database, worker_argv


def _counts(url: str, batch_id: str) -> dict[str, Any]:
    with psycopg.connect(url, autocommit=True) as conn:
        rows, distinct, succeeded, failed, open_ = conn.execute(
            "SELECT count(*), count(DISTINCT idx), count(*) FILTER (WHERE state = 'succeeded'),"
            " count(*) FILTER (WHERE state NOT IN ('pending', 'started', 'succeeded')),"
            " count(*) FILTER (WHERE state IN ('pending', 'started'))"
            " FROM fanin_children WHERE batch_id IN (SELECT id FROM fanin_batches WHERE id = %s OR parent_id = %s)",
            (batch_id, batch_id),
        ).fetchone()  # type: ignore[misc]
        leaves = conn.execute("SELECT count(*) FROM fanin_batches WHERE parent_id = %s", (batch_id,)).fetchone()
        successor = conn.execute(
            "SELECT state, runs, duplicates FROM fanin_successors WHERE batch_id = %s", (batch_id,)
        ).fetchone()
    return {
        "child_rows": rows,
        "distinct_indexes": distinct,
        "rows_succeeded": succeeded,
        "rows_failed": failed,
        "rows_open": open_,
        "leaves": leaves[0] if leaves else None,
        "successor": None
        if successor is None
        else {"state": successor[0], "runs": successor[1], "duplicates": successor[2]},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.million", description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=1_000_000)
    p.add_argument("--e2e", action="store_true", help="run a worker and a relay: the batch end to end")
    p.add_argument("--concurrency", type=int, default=2, help="the worker's prefork processes (with --e2e)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "report")
    args = p.parse_args(argv)
    log_dir = args.out / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    with database() as url, redis_database() as redis_url:
        queue = f"bench-million-{uuid.uuid4().hex[:6]}"
        env = harness_env(url, redis_url, redis_url, queue)
        from bench.tasks import app, child, mark
        from celery_fanin import FanIn, fan_in_group

        fanin = FanIn(app)
        fanin.migrate()
        run = f"million-{uuid.uuid4().hex[:6]}"
        target = queue if args.e2e else f"{queue}-parked"  # parked: no worker consumes it
        procs: list[Proc] = []
        marks = redis.Redis.from_url(redis_url)
        try:
            if args.e2e:
                procs.append(
                    Proc(
                        worker_argv(queue, f"million-{os.getpid()}@%h", concurrency=args.concurrency),
                        env,
                        log_dir / "million-worker.log",
                    )
                )
                procs.append(Proc(["fanin", "relay"], env, log_dir / "million-relay.log"))
                procs[1].wait_for("relay started", 60)

            def source() -> Iterator[Any]:
                for i in range(args.n):
                    yield child.s(i, run, args.n).set(queue=target)

            start = time.time()
            handle = fan_in_group(source(), then=mark.s(run).set(queue=target), app=app).apply_async()
            dispatched = time.time()
            rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            report: dict[str, Any] = {
                "n": args.n,
                "e2e": args.e2e,
                "dispatch_s": round(dispatched - start, 1),
                "dispatch_children_per_s": round(args.n / (dispatched - start)),
                "producer_peak_rss_mb": round(rss_mb),
            }
            print(json.dumps(report), flush=True)
            if args.e2e:
                report["worker"] = f"celery worker -P prefork -c {args.concurrency}"
                last = time.time()
                while True:
                    got = marks.blpop([f"bench:start:{run}"], timeout=2)
                    if got is not None:
                        finished = float(got[1])
                        break
                    for proc in procs:
                        if proc.proc.poll() is not None:
                            raise RuntimeError(f"{proc.log.name} exited: {proc.log.read_text()[-3000:]}")
                    if time.time() - last >= 60:
                        last = time.time()
                        s = handle.batch_status()
                        print(
                            f"[{last - start:7.0f}s] {s.state}: succeeded {s.succeeded}, failed {s.failed}, "
                            f"remaining {s.remaining}",
                            flush=True,
                        )
                report["e2e_s"] = round(finished - start, 1)
                report["worker_children_per_s"] = round(args.n / (finished - start))
                time.sleep(1.0)  # the successor's own state is recorded right after its body returns
            status = handle.batch_status()
            report.update(
                {
                    "planned": status.planned,
                    "published": status.published,
                    "state": status.state,
                    "succeeded": status.succeeded,
                    "failed": status.failed,
                    "child_executions": int(marks.get(f"bench:done:{run}") or 0),
                }
            )
            report.update(_counts(url, handle.batch_id))
        finally:
            for proc in reversed(procs):
                proc.stop()
            fanin.dispose()
    print(json.dumps(report, indent=2))
    (args.out / f"million{'-e2e' if args.e2e else ''}.json").write_text(json.dumps(report, indent=2))
    n = args.n
    ok = report["planned"] == report["child_rows"] == report["distinct_indexes"] == report["published"] == n
    if args.e2e:
        succ = report["successor"] or {}
        ok = ok and report["succeeded"] == report["rows_succeeded"] == n and report["failed"] == 0
        ok = ok and report["state"] == "complete" and succ.get("state") == "succeeded" and succ.get("runs") == 1
    else:
        ok = ok and report["state"] == "running"
    print("counts exact" if ok else "COUNTS DO NOT MATCH", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
