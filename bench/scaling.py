"""How throughput scales with concurrency here: `python -m bench.scaling` (`--smoke`: a tiny run of every series).

Two curves, each measured in one run with its series alternated:

- terminal events/s against concurrent reporters (1, 2, 4, ... 64 processes) on one batch of `--children`
  children: flat (`max_width` = the batch), trees of `--leaves` leaf counters (`max_width` = children / leaves),
  the batch with the library's default settings (no `max_width` given), the same through a worker's report
  batcher (`default-batched`: `fanin_report_batching`, one batcher per `--per-batcher` reporters, its reports per
  commit counted), and the raw one-row `UPDATE` beside them; with CPU µs per event for the reporters, the batchers
  and the whole PostgreSQL server.
  The reporters are bench/run.py's: the worker's own terminal-report path (`Reporter.record_child`) and the
  raw `UPDATE ... RETURNING` in autocommit. Each round sweeps the reporter counts (ascending, then descending the
  next round) and, at each count, runs the series in an order rotated per count and round; every phase reports
  `--events` children not reported before (batches are refilled when used up), and each figure is the median of
  the rounds, each ratio to the raw `UPDATE` the median of the per-round ratios;
- successors/s published by 1, 2 and 4 `celery fanin relay` processes: many one-child batches are created, their
  children reported finished straight through the store (the terminal function the workers call, so each report
  creates its batch's successor and outbox row, and no worker exists to publish it), and their outbox rows held
  back (`available_at` a day ahead). For each relay count, the relays are started and left to settle, then one
  slice of `--successors` rows is made due with a `NOTIFY`; the time is until every row of the slice is sent.

Prints both tables and writes `scaling[-smoke].json` (and a PNG of the first curve when matplotlib is there)
under `--out`. No worker runs: nothing else competes for the two cores but what is measured.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import psycopg

from bench.run import ROOT, Proc, _concurrent, machine, purge_queue, services, start_run, timed_phase

RAW = "raw"
# The default layout again, each reporter sending its reports through a worker's report batcher
# (`fanin_report_batching`), one batcher per `--per-batcher` reporters, as a prefork worker's pool processes do.
BATCHED = "default-batched"


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


# --- terminal events against reporters ---------------------------------------------------------------------------


class Parked:
    """Batches of one layout whose children nobody consumes, handed out a slice of task ids at a time."""

    def __init__(self, url: str, parked_queue: str, broker: str, children: int, options: dict[str, Any]) -> None:
        self.url, self.parked_queue, self.broker = url, parked_queue, broker
        self.children, self.options = children, options
        self.batch_id = ""
        self.ids: list[str] = []
        self.leaves = 0
        self.created = 0

    def take(self, k: int) -> tuple[str, list[str]]:
        if len(self.ids) < k:
            self._create()
        taken, self.ids = self.ids[:k], self.ids[k:]
        return self.batch_id, taken

    def _create(self) -> None:
        from bench.tasks import app, child, mark
        from celery_fanin import fan_in_group

        run = f"scaling-{uuid.uuid4().hex[:6]}"
        n = self.children
        sigs = [child.s(i, run, n).set(queue=self.parked_queue) for i in range(n)]
        handle = fan_in_group(sigs, then=mark.s(run), app=app, **self.options).apply_async()
        purge_queue(self.broker, self.parked_queue, delete=True)
        with psycopg.connect(self.url, autocommit=True) as db:
            # In index order: child i of a tree is on leaf i % leaves, so any run of ids spreads over every leaf.
            self.ids = [
                r[0]
                for r in db.execute(
                    "SELECT task_id FROM fanin_children WHERE batch_id IN (SELECT id FROM fanin_batches "
                    "WHERE id = %s OR parent_id = %s) ORDER BY idx",
                    (handle.batch_id, handle.batch_id),
                )
            ]
            row = db.execute("SELECT count(*) FROM fanin_batches WHERE parent_id = %s", (handle.batch_id,)).fetchone()
        self.leaves = int(row[0]) if row else 0
        self.batch_id = handle.batch_id
        self.created += 1


def series_options(children: int, leaves: Sequence[int]) -> dict[str, dict[str, Any]]:
    """Each series' `fan_in_group` options: flat, trees of `leaves` counters, and the defaults (none given)."""
    options: dict[str, dict[str, Any]] = {"flat": {"max_width": children}}
    for k in leaves:
        options[f"tree-{k}"] = {"max_width": math.ceil(children / k)}
    options["default"] = {}
    return options


def terminal_curves(
    args: argparse.Namespace, url: str, broker: str, queue: str, progress: Callable[[str], None]
) -> dict[str, Any]:
    from celery_fanin.context import Settings

    with psycopg.connect(url, autocommit=True) as db:
        db.execute("CREATE TABLE IF NOT EXISTS bench_hot (id int PRIMARY KEY, n bigint NOT NULL)")
        db.execute("INSERT INTO bench_hot VALUES (1, 1000000000) ON CONFLICT (id) DO NOTHING")
    parked_queue = f"{queue}-parked"
    options = series_options(args.children, args.leaves)
    pools = {name: Parked(url, parked_queue, broker, args.children, opts) for name, opts in options.items()}
    names = [*options, RAW]
    if args.per_batcher:
        pools[BATCHED] = Parked(url, parked_queue, broker, args.children, options["default"])
        names.insert(len(options), BATCHED)
    # What the batchers counted, per phase: reports per statement (each statement one commit), and the reports
    # that went alone (a batcher's refusal or timeout; each its own commit).
    per_statement: dict[int, list[float]] = {r: [] for r in args.reporters}
    # CPU µs per event, by role (the reporters' loops, the batchers' threads, the whole PostgreSQL server).
    cpu_us: dict[str, dict[int, dict[str, list[float]]]] = {name: {r: {} for r in args.reporters} for name in names}
    alone: dict[int, list[int]] = {r: [] for r in args.reporters}
    vs_default: dict[int, list[float]] = {r: [] for r in args.reporters}
    runs: dict[str, dict[int, list[float]]] = {name: {r: [] for r in args.reporters} for name in names}
    ratios: dict[str, dict[int, list[float]]] = {name: {r: [] for r in args.reporters} for name in names}
    errors: list[str] = []
    wal_bytes: dict[str, dict[int, list[float]]] = {name: {r: [] for r in args.reporters} for name in names}
    per_sync: dict[str, dict[int, list[float]]] = {name: {r: [] for r in args.reporters} for name in names}
    for rnd in range(args.rounds):
        counts = args.reporters if rnd % 2 == 0 else list(reversed(args.reporters))
        for j, reporters in enumerate(counts):
            shift = (rnd + j) % len(names)
            figures: dict[str, float] = {}
            for name in names[shift:] + names[:shift]:
                if name == RAW:
                    batch_id, ids = "", [""] * args.events
                else:
                    batch_id, ids = pools[name].take(args.events)
                work = [ids[i::reporters] for i in range(reporters)]
                kind = RAW if name == RAW else "fanin_one_conn"
                before = _wal(url)
                cpu: dict[str, float] = {}
                try:
                    if name == BATCHED:
                        figures[name], groups, sent = _concurrent_batched(url, batch_id, work, args.per_batcher, cpu)
                        commits = groups + (len(ids) - sent)
                        per_statement[reporters].append(len(ids) / max(1, commits))
                        alone[reporters].append(len(ids) - sent)
                    else:
                        figures[name] = _concurrent(url, batch_id, kind, work, start_method="fork", cpu=cpu)
                except Exception as exc:  # noqa: BLE001 - keep the other figures; the error is reported
                    errors.append(f"round {rnd + 1} reporters {reporters} {name}: {exc!r}"[:500])
                    progress(errors[-1])
                    figures[name] = float("nan")
                    continue
                after = _wal(url)
                runs[name][reporters].append(figures[name])
                wal_bytes[name][reporters].append((after[0] - before[0]) / len(ids))
                per_sync[name][reporters].append(len(ids) / max(1, after[1] - before[1]))
                for role, seconds in cpu.items():
                    cpu_us[name][reporters].setdefault(role, []).append(seconds / len(ids) * 1e6)
            for name in names:
                if figures[name] == figures[name] and figures[RAW] == figures[RAW]:  # neither failed (NaN)
                    ratios[name][reporters].append(figures[name] / figures[RAW])
            if BATCHED in figures and figures[BATCHED] == figures[BATCHED] and figures["default"] == figures["default"]:
                vs_default[reporters].append(figures[BATCHED] / figures["default"])
            progress(
                f"round {rnd + 1} reporters {reporters:>2}: "
                + " ".join(f"{n} {figures[n]:.0f}/s ({figures[n] / figures[RAW]:.2f})" for n in names)
                + (f" reports/commit batched {per_statement[reporters][-1]:.1f}" if per_statement[reporters] else "")
            )
    series = {
        name: {str(r): _figures(v, ratios[name][r], wal_bytes[name][r], per_sync[name][r]) for r, v in per.items()}
        for name, per in runs.items()
    }
    for name, per_count in cpu_us.items():
        for r, roles in per_count.items():
            if roles:
                series[name][str(r)]["cpu_us_per_event"] = {k: statistics.median(v) for k, v in roles.items()}
    for r in args.reporters if BATCHED in series else []:
        f = series[BATCHED][str(r)]
        if per_statement[r]:
            f["reports_per_commit"] = statistics.median(per_statement[r])
            f["reports_per_commit_runs"] = per_statement[r]
            f["sent_alone"] = alone[r]
        if vs_default[r]:
            f["ratio_to_default"] = statistics.median(vs_default[r])
            f["ratio_to_default_runs"] = vs_default[r]
    return {
        "children": args.children,
        "events_per_phase": args.events,
        "per_batcher": args.per_batcher,
        "rounds": args.rounds,
        "reporters": args.reporters,
        "default_max_width": Settings().max_width,
        "leaves": {name: pools[name].leaves for name in pools},
        "errors": errors,
        "series": series,
    }


def _batcher_host(url: str, batch_id: str, work: list[list[str]], ready: Any, go: Any, out: Any, stats: Any) -> None:
    """One prefork worker's main process with `fanin_report_batching` on, and no Celery around it: it starts the
    worker's own batcher (`batching.start`), forks its reporters (which inherit the batcher's address, as pool
    processes do), waits for them, and sends what the batcher counted (statements, reports)."""
    from celery import Celery
    from celery.concurrency.prefork import TaskPool

    from bench.run import _reporter
    from celery_fanin import FanIn
    from celery_fanin.worker import batching

    app = Celery("bench-batcher", set_as_current=False)
    app.conf.fanin_database_url = url
    app.conf.fanin_report_batching = True
    batcher = batching.start(FanIn(app), TaskPool)
    if batcher is None:
        raise RuntimeError("the report batcher did not start")
    ctx: Any = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_reporter, args=(url, batch_id, "fanin_batched", ids, ready, go, out)) for ids in work]
    for p in procs:
        p.start()
    go.wait()
    cpu = time.process_time()  # from here on, this process is the batcher's thread
    for p in procs:
        p.join()
    stats.put((batcher.groups, batcher.reports, time.process_time() - cpu))
    batching.stop()


def _concurrent_batched(
    url: str, batch_id: str, work: list[list[str]], per_batcher: int, cpu: dict[str, float]
) -> tuple[float, int, int]:
    """As `bench.run._concurrent`, the reporters split among batchers of `per_batcher` reporters each (the workers
    of a deployment, each with its pool processes): events/s, and the statements and reports the batchers
    committed (a report the batcher did not commit went alone); `cpu` as there, with "batchers" too."""
    ctx: Any = multiprocessing.get_context("fork")
    ready, go, out, stats = ctx.Semaphore(0), ctx.Event(), ctx.Queue(), ctx.Queue()
    hosts = [
        ctx.Process(target=_batcher_host, args=(url, batch_id, work[i : i + per_batcher], ready, go, out, stats))
        for i in range(0, len(work), per_batcher)
    ]
    rate = timed_phase(url, hosts, len(work), ready, go, out, cpu)
    counted = [stats.get(timeout=60) for _ in hosts]
    cpu["batchers"] = sum(c[2] for c in counted)
    for h in hosts:
        h.join(30)
    return rate, sum(c[0] for c in counted), sum(c[1] for c in counted)


def _figures(v: list[float], ratios: list[float], wal: list[float], syncs: list[float]) -> dict[str, Any]:
    v = [x for x in v if x == x]  # without the failed phases (NaN)
    if not v or not ratios:
        return {"median": float("nan"), "runs": v, "ratio_to_raw": float("nan"), "failed": True}
    return {
        "median": statistics.median(v),
        "min": min(v),
        "max": max(v),
        "runs": v,
        "ratio_to_raw": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "wal_bytes_per_event": statistics.median(wal),
        "events_per_wal_sync": statistics.median(syncs),
    }


# --- relay successors/s --------------------------------------------------------------------------------------------


def relay_curve(
    args: argparse.Namespace,
    url: str,
    broker: str,
    queue: str,
    env: dict[str, str],
    log_dir: Path,
    progress: Callable[[str], None],
) -> dict[str, Any]:
    from bench.tasks import app, child, mark
    from celery_fanin import fan_in_group
    from celery_fanin.protocol import OUTBOX_CHANNEL

    parked_queue = f"{queue}-parked"
    phases = [k for _ in range(args.relay_rounds) for k in args.relays]
    total = args.successors * len(phases)
    began = time.monotonic()
    for i in range(total):
        run = f"relay-{i}"
        fan_in_group([child.s(0, run, 1).set(queue=parked_queue)], then=mark.s(run), app=app).apply_async()
    purge_queue(broker, parked_queue, delete=True)
    created = time.monotonic() - began
    with psycopg.connect(url, autocommit=True) as db:  # the run's first batches: nothing else is in the database
        task_ids = [r[0] for r in db.execute("SELECT task_id FROM fanin_children")]
    # Every child reported finished through the store, as a worker's report would be; each creates its batch's
    # successor and outbox row. No relay is running and no worker exists, so the rows pile up unsent.
    _concurrent(url, "", "fanin_sql", [task_ids[i :: args.creators] for i in range(args.creators)], start_method="fork")
    with psycopg.connect(url, autocommit=True) as db:
        db.execute("UPDATE fanin_outbox SET available_at = now() + interval '1 day' WHERE sent_at IS NULL")
        pending = [r[0] for r in db.execute("SELECT id FROM fanin_outbox WHERE sent_at IS NULL ORDER BY id")]
    if len(pending) != total:
        raise RuntimeError(f"expected {total} pending successors, found {len(pending)}")
    progress(f"relay: {total} one-child batches created in {created:.1f}s, their successors held back")
    rates: dict[int, list[float]] = {k: [] for k in args.relays}
    for p, k in enumerate(phases):
        rows = pending[p * args.successors : (p + 1) * args.successors]
        relays = [Proc(["fanin", "relay"], env, log_dir / f"relay-{p}-{i}.log") for i in range(k)]
        try:
            for relay in relays:
                if not relay.wait_for("relay started", 60):
                    raise RuntimeError(f"relay did not start: {relay.log.read_text()[-2000:]}")
            with psycopg.connect(url, autocommit=True) as db:
                _wait_listening(db, k, timeout=60)
                time.sleep(1.0)  # each relay's first round (its maintenance duties) is over by then
                db.execute("UPDATE fanin_outbox SET available_at = now() WHERE id = ANY(%s)", (rows,))
                db.execute(f"NOTIFY {OUTBOX_CHANNEL}")  # a constant
                t0 = time.monotonic()
                deadline = t0 + 120 + len(rows) / 10
                while True:
                    left = db.execute(
                        "SELECT count(*) FROM fanin_outbox WHERE id = ANY(%s) AND sent_at IS NULL", (rows,)
                    ).fetchone()
                    if left is not None and left[0] == 0:
                        break
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{left} successors still unsent after {deadline - t0:.0f}s")
                    time.sleep(0.01)
                elapsed = time.monotonic() - t0
        finally:
            for relay in relays:
                relay.stop()
        rates[k].append(len(rows) / elapsed)
        progress(f"relay: {k} relay(s) sent {len(rows)} successors in {elapsed:.2f}s: {len(rows) / elapsed:.0f}/s")
    purge_queue(broker, queue, delete=False)
    return {
        "successors_per_phase": args.successors,
        "rounds": args.relay_rounds,
        "relays": {
            str(k): {"median": statistics.median(v), "min": min(v), "max": max(v), "runs": v} for k, v in rates.items()
        },
    }


def _wal(url: str) -> tuple[int, int]:
    """The server's WAL position (bytes) and how many times it has synced WAL to disk (pg_stat_wal, PostgreSQL
    14+): server-wide figures, so a phase's share is exact only while nothing else writes."""
    with psycopg.connect(url, autocommit=True) as db:
        row = db.execute(
            "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint, (SELECT wal_sync FROM pg_stat_wal)"
        ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def _wait_listening(db: psycopg.Connection[Any], k: int, timeout: float) -> None:
    """Until `k` relays of this database have their LISTEN connection open."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        row = db.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND query ILIKE 'LISTEN%%'"
        ).fetchone()
        if row is not None and row[0] >= k:
            return
        time.sleep(0.05)
    raise RuntimeError(f"{k} relays did not LISTEN within {timeout:.0f}s")


# --- report --------------------------------------------------------------------------------------------------------


def table(report: dict[str, Any]) -> str:
    t = report["terminal"]
    names = list(t["series"])
    head = "| reporters | " + " | ".join(_label(n, t) for n in names) + " |"
    lines = [head, "|---:|" + "---:|" * len(names)]
    for r in t["reporters"]:
        cells = []
        for n in names:
            f = t["series"][n][str(r)]
            cells.append(f"{f['median']:.0f}" if n == RAW else f"{f['median']:.0f} ({f['ratio_to_raw']:.2f})")
        lines.append(f"| {r} | " + " | ".join(cells) + " |")
    lines += ["", "WAL bytes per event / events per WAL sync (server-wide counters):", "", head, lines[1]]
    for r in t["reporters"]:
        cells = [_wal_cell(t["series"][n][str(r)]) for n in names]
        lines.append(f"| {r} | " + " | ".join(cells) + " |")
    lines += ["", "CPU µs per event: reporters' loops / batchers / the whole PostgreSQL server:", "", head, lines[1]]
    for r in t["reporters"]:
        cells = [_cpu_cell(t["series"][n][str(r)]) for n in names]
        lines.append(f"| {r} | " + " | ".join(cells) + " |")
    if BATCHED in t["series"]:
        lines += [
            "",
            f"{BATCHED}: reports through a worker's batcher, {t.get('per_batcher')} reporters per batcher; paired to "
            "default (no batcher) within each round; reports per commit from the batchers' counts:",
            "",
            "| reporters | events/s | vs default, paired (min–max) | reports per commit | sent alone |",
            "|---:|---:|---:|---:|---:|",
        ]
        for r in t["reporters"]:
            f = t["series"][BATCHED][str(r)]
            vs = f.get("ratio_to_default_runs") or [float("nan")]
            lines.append(
                f"| {r} | {f['median']:.0f} | {f.get('ratio_to_default', float('nan')):.2f} "
                f"({min(vs):.2f}–{max(vs):.2f}) | {f.get('reports_per_commit', float('nan')):.1f} "
                f"| {sum(f.get('sent_alone', []))} |"
            )
    lines += ["", "| relays | successors/s, median (min–max) |", "|---:|---:|"]
    for k, f in report["relay"]["relays"].items():
        lines.append(f"| {k} | {f['median']:.0f} ({f['min']:.0f}–{f['max']:.0f}) |")
    return "\n".join(lines)


def _cpu_cell(f: dict[str, Any]) -> str:
    c = f.get("cpu_us_per_event")
    if not c:
        return ""
    return " / ".join(f"{c[k]:.0f}" if k in c else "-" for k in ("reporters", "batchers", "postgres"))


def _wal_cell(f: dict[str, Any]) -> str:
    if "wal_bytes_per_event" not in f:
        return ""
    return f"{f['wal_bytes_per_event']:.0f} / {f['events_per_wal_sync']:.1f}"


def _label(name: str, t: dict[str, Any]) -> str:
    if name == RAW:
        return "raw UPDATE"
    leaves = t["leaves"].get(name, 0)
    shape = f"{leaves} leaves" if leaves else "flat"
    return f"{name} ({shape})" if name in ("default", BATCHED) else name


def plot(report: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    t = report["terminal"]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, per in t["series"].items():
        xs = [int(r) for r in per]
        ax.plot(xs, [per[str(r)]["median"] for r in xs], marker="o", label=_label(name, t))
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent reporters (processes)")
    ax.set_ylabel("terminal events/s (median)")
    ax.set_title(f"one batch of {t['children']:,} children, {report['machine']['nproc']} cores")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.scaling", description=__doc__.split("\n\n")[0])
    p.add_argument("--broker", choices=("redis", "rabbitmq"), default="redis")
    p.add_argument("--reporters", type=_ints, default=[1, 2, 4, 8, 16, 32, 64], help="comma-separated")
    p.add_argument("--children", type=int, default=10_000, help="children per batch (default 10,000)")
    p.add_argument("--leaves", type=_ints, default=[4, 16, 64], help="the trees' leaf counts (comma-separated)")
    p.add_argument("--events", type=int, default=2000, help="terminal events per phase (default 2,000)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--relays", type=_ints, default=[1, 2, 4], help="relay counts (comma-separated)")
    p.add_argument("--successors", type=int, default=1200, help="successors per relay phase (default 1,200)")
    p.add_argument("--relay-rounds", type=int, default=2)
    p.add_argument("--creators", type=int, default=4, help="processes reporting the relay phase's children")
    p.add_argument("--skip-relay", action="store_true", help="the terminal curves only")
    p.add_argument(
        "--per-batcher",
        type=int,
        default=16,
        help="the default-batched series: reporters per report batcher, as pool processes per worker (0: no series)",
    )
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "report")
    p.add_argument("--smoke", action="store_true", help="a tiny run of every series: checks the harness")
    args = p.parse_args(argv)
    if args.smoke:
        args.reporters, args.children, args.leaves, args.events, args.rounds = [1, 2, 4], 200, [4], 40, 1
        args.relays, args.successors, args.relay_rounds, args.creators = [1, 2], 20, 1, 2
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    log_dir, started, progress = start_run(args.out)
    with services(args.broker, "scaling") as (db_url, _, queue, broker, env):
        from bench.tasks import app
        from celery_fanin import FanIn

        report: dict[str, Any] = {
            "command": " ".join(["python -m bench.scaling", *(argv if argv is not None else sys.argv[1:])]),
            "broker": args.broker,
            "started_at": datetime.now(timezone.utc).isoformat(),
            "machine": machine(),
            "smoke": args.smoke,
        }
        try:
            # The relays first: later, the parked batches of the terminal curves would be theirs to reconcile.
            if not args.skip_relay:
                report["relay"] = relay_curve(args, db_url, broker, queue, env, log_dir, progress)
            report["terminal"] = terminal_curves(args, db_url, broker, queue, progress)
        finally:
            purge_queue(broker, queue, delete=args.broker == "rabbitmq")
            FanIn(app).dispose()
    report.setdefault("relay", {"relays": {}})
    report["duration_s"] = time.time() - started
    name = f"scaling{'-smoke' if args.smoke else ''}"
    png = args.out / f"{name}.png"
    report["plot"] = str(png) if plot(report, png) else None
    (args.out / f"{name}.json").write_text(json.dumps(report, indent=2, default=str))
    print(table(report))
    print(f"wrote {args.out / f'{name}.json'}" + (f" and {png}" if report["plot"] else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
