"""Successor latency alone, and where it goes: `python -m bench.latency --broker redis --batches 200 [--trace]`.

The main benchmark's latency phase (`bench.run.Bench.latency`: batches of 10, chord and fan-in alternately, one at
a time, the last child's terminal commit to the successor's first line) without the rest of the run, on its own
database, worker (`-P prefork -c 2`) and relay. With `--trace` the worker runs with BENCH_TRACE (`bench.trace`)
and the fan-in's path is split into its steps, each the median (and p90) over the batches of the time from the
step before:

    completed_at (the finishing report's now()) -> the report returned to the pool process -> the claim returned
    -> the outcome built -> the message written -> flushed (Redis: the pipeline; RabbitMQ: confirmed) -> marked
    sent -> committed -> received by the worker's main process -> the guard entered (pool process) -> its
    statement returned -> the guard done -> the successor's first line

and the chord's: the last child's date_done -> its chord hook returned (the body published) -> received -> the
first line. Timestamps from different processes share the machine's clock. `--publisher relay` runs the worker
with fanin_worker_publishes_successors off.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

import psycopg
import redis

from bench.run import (
    ROOT,
    Bench,
    Proc,
    _epoch,
    database,
    harness_env,
    percentile,
    purge_queue,
    redis_database,
    worker_argv,
)

FANIN_STEPS = (
    ("completed_at", "report.done"),
    ("report.done", "pub.enter"),
    ("pub.enter", "pub.claimed"),
    ("pub.claimed", "pub.outcome"),
    ("pub.outcome", "pub.sent"),
    ("pub.sent", "pub.flushed"),
    ("pub.flushed", "pub.marked"),
    ("pub.marked", "pub.committed"),
    ("pub.committed", "recv"),
    ("recv", "guard.enter"),
    ("guard.enter", "guard.stmt"),
    ("guard.stmt", "guard.stmt_done"),
    ("guard.stmt_done", "guard.done"),
    ("guard.done", "first_line"),
)
CHORD_STEPS = (
    ("date_done", "chord.part_done"),
    ("chord.part_done", "recv"),
    ("recv", "prerun"),
    ("prerun", "first_line"),
)


def _read_traces(directory: Path) -> dict[str, dict[str, float]]:
    events: dict[str, dict[str, float]] = defaultdict(dict)
    for path in directory.glob("*.tsv"):
        for line in path.read_text().splitlines():
            key, event, t = line.split("\t")
            events[key].setdefault(event, float(t))  # the first of an event (a redelivery's come later)
    return events


def _steps(rows: list[dict[str, float]], steps: tuple[tuple[str, str], ...]) -> list[dict[str, Any]]:
    out = []
    for a, b in steps:
        values = [(r[b] - r[a]) * 1000 for r in rows if a in r and b in r]
        if values:
            out.append(
                {
                    "step": f"{a} -> {b}",
                    "p50_ms": statistics.median(values),
                    "p90_ms": percentile(values, 0.9),
                    "n": len(values),
                }
            )
    return out


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m bench.latency", description=__doc__.split("\n\n")[0])
    p.add_argument("--broker", choices=("redis", "rabbitmq"), default="redis")
    p.add_argument("--batches", type=int, default=200)
    p.add_argument("--size", type=int, default=10)
    p.add_argument("--trace", action="store_true")
    p.add_argument("--publisher", choices=("worker", "relay"), default="worker")
    p.add_argument("--json", type=Path, default=None, help="write the figures (and every batch's) here")
    args = p.parse_args()
    trace_dir = Path(tempfile.mkdtemp(prefix="fanin-trace-"))
    out_dir = ROOT / "bench" / "report" / "logs"
    out_dir.mkdir(parents=True, exist_ok=True)
    with database() as db_url, redis_database() as redis_url:
        queue = f"bench-{uuid.uuid4().hex[:8]}"
        broker = redis_url if args.broker == "redis" else "amqp://guest:guest@127.0.0.1:5672//"
        env = harness_env(db_url, redis_url, broker, queue)
        worker_env = {**env, "BENCH_WORKER_PUBLISHES": "1" if args.publisher == "worker" else "0"}
        if args.trace:
            worker_env["BENCH_TRACE"] = str(trace_dir)
        from bench.tasks import app, child, mark
        from celery_fanin import FanIn, fan_in_group

        FanIn(app).migrate()
        marks = redis.Redis.from_url(redis_url)
        worker = Proc(
            worker_argv(queue, f"lat-{os.getpid()}@%h"),
            worker_env,
            out_dir / "latency-worker.log",
        )
        relay = Proc(["fanin", "relay"], env, out_dir / "latency-relay.log")
        try:
            bench = Bench(argparse.Namespace(), env, marks, out_dir)
            child.delay(0, "probe", 1)
            bench.wait_mark("bench:end:probe", 90)
            relay.wait_for("relay started", 30)
            from celery import chord

            size = args.size
            rows: dict[str, list[dict[str, float]]] = {"chord": [], "fanin": []}
            with psycopg.connect(db_url, autocommit=True) as db:
                for k in range(args.batches):
                    for contender in ("chord", "fanin") if k % 2 == 0 else ("fanin", "chord"):
                        run = f"lat-{contender}-{k}-{uuid.uuid4().hex[:6]}"
                        row: dict[str, Any] = {"run": run}
                        if contender == "chord":
                            result = chord([child.s(i, run, size) for i in range(size)], mark.s(run)).apply_async()
                            row["first_line"] = bench.wait_mark(f"bench:start:{run}", 60)
                            done = {r.id: _epoch(r.date_done) for r in result.parent.results}
                            last = max(done, key=lambda i: done[i])
                            row["date_done"], row["last_child"] = done[last], last
                            result.forget()
                            row["start"] = row["date_done"]
                        else:
                            sigs = [child.s(i, run, size) for i in range(size)]
                            handle = fan_in_group(sigs, then=mark.s(run), app=app).apply_async()
                            row["first_line"] = bench.wait_mark(f"bench:start:{run}", 60)
                            got = db.execute(
                                "SELECT extract(epoch FROM completed_at) FROM fanin_batches WHERE id = %s",
                                (handle.batch_id,),
                            ).fetchone()
                            row["completed_at"] = row["start"] = float(got[0])
                            row["batch"] = str(handle.batch_id)
                        row["latency_ms"] = (row["first_line"] - row["start"]) * 1000
                        rows[contender].append(row)
                        marks.delete(f"bench:done:{run}")
        finally:
            relay.stop()
            worker.stop()
            purge_queue(broker, queue, delete=args.broker == "rabbitmq")
            FanIn(app).dispose()
    report: dict[str, Any] = {"broker": args.broker, "publisher": args.publisher, "batches": args.batches}
    for contender, got in rows.items():
        lat = [r["latency_ms"] for r in got]
        report[contender] = {"p50_ms": percentile(lat, 0.5), "p99_ms": percentile(lat, 0.99), "max_ms": max(lat)}
    if args.trace:
        events = _read_traces(trace_dir)
        for r in rows["fanin"]:
            r.update(events.get(r["batch"], {}))
        for r in rows["chord"]:
            r.update({k: v for k, v in events.get(f"run:{r['run']}", {}).items()})
            r.update(events.get(f"chordpart:{r['last_child']}", {}))
        report["fanin_steps"] = _steps(rows["fanin"], FANIN_STEPS)
        report["chord_steps"] = _steps(rows["chord"], CHORD_STEPS)
    report["rows"] = rows
    when = time.strftime("%H:%M:%S", time.gmtime())
    print(f"{when} UTC broker={args.broker} publisher={args.publisher} batches={args.batches}x{args.size}")
    for contender in ("chord", "fanin"):
        v = report[contender]
        print(f"  {contender:6} p50 {v['p50_ms']:.2f} ms  p99 {v['p99_ms']:.2f} ms  max {v['max_ms']:.1f} ms")
    for name in ("fanin_steps", "chord_steps") if args.trace else ():
        print(f"  {name}:")
        for s in report[name]:
            print(f"    {s['step']:36} p50 {s['p50_ms']:6.2f}  p90 {s['p90_ms']:6.2f} ms  (n={s['n']})")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
