"""Batched terminal reports, the database's side (issue 41, a prototype measured, not a shipped path):
`python -m bench.batched_reports --reporters 1,4,16 --groups 1,8,16 --events 4000 --rounds 3`.

Issue 41's first candidate design group-commits many children's terminal reports: a worker's main process, which
receives every task's return value from its pool, sends them in one statement and one durable commit instead of one
each. Before building that path, this measures what it would buy on the database's side, on one batch with the
library's default settings (a tree of counters), against the reports as they are sent today:

- `R` reporter processes (each standing for one worker's main process, or, at a group of 1, for one pool process
  reporting as today) report `--events` children together;
- each sends its children in groups of `G`: one statement and one transaction per group, the group sorted by the
  counter row each child decrements (so that two groups take their leaves' locks in one order). Each child is
  counted by the report function the worker calls today (`fanin_report_terminal_v2`, through a set-returning
  join), so nothing is counted otherwise than it is now; a group of 1 is today's report.

Prints terminal events/s and events per WAL flush (`pg_stat_wal.wal_sync`, server-wide: nothing else writes) for
each reporter count and group size, the order of the group sizes rotated in each round, and the ratio of each group
size's events/s to a group of 1's, paired within each round.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time
from typing import Any

import psycopg

from bench.run import services
from bench.scaling import Parked, _ints, _wal
from celery_fanin.store.batches import Claim, terminal_params
from celery_fanin.store.statements import q

# One group of reports in one statement (one transaction): each child through the worker's report function.
GROUP_REPORT = """
SELECT count(*) FILTER (WHERE r.counted), count(*) FILTER (WHERE r.late)
  FROM unnest(%(task_ids)s::text[], %(batches)s::uuid[], %(idxs)s::int[], %(names)s::text[])
       WITH ORDINALITY AS u(task_id, batch_id, idx, task_name, n)
 CROSS JOIN LATERAL fanin_report_terminal_v2(u.task_id, u.batch_id, u.idx, u.task_name, 'succeeded', NULL, NULL,
                                             NULL, NULL, NULL, NULL, NULL, NULL, NULL) AS r
"""


# The least a set-based group statement could do (a bound, not a report: no late or refused report, no state, no
# leaf or batch completing, nothing for a successor): the group's child rows moved in one UPDATE, then each counter
# row it touches moved once by its share. Leaves about to reach zero are left alone, so nothing completes.
BOUND_REPORT = """
WITH u AS (
    SELECT * FROM unnest(%(task_ids)s::text[], %(batches)s::uuid[], %(idxs)s::int[], %(names)s::text[])
           WITH ORDINALITY AS u(task_id, batch_id, idx, task_name, n)
), c AS (
    UPDATE fanin_children ch
       SET state = 'succeeded', finished_at = now(), result = NULL, result_content_type = NULL,
           result_content_encoding = NULL, exc_type = NULL, exc_message = NULL
      FROM u
     WHERE ch.task_id = u.task_id AND ch.state IN ('pending', 'started') AND ch.idx = u.idx
       AND (u.task_name IS NULL OR ch.task_name = u.task_name)
       AND (ch.batch_id = u.batch_id
            OR EXISTS (SELECT 1 FROM fanin_batches l WHERE l.id = ch.batch_id AND l.parent_id = u.batch_id))
    RETURNING ch.batch_id
), k AS (
    SELECT batch_id, count(*)::int AS n FROM c GROUP BY batch_id
), s AS (
    UPDATE fanin_batches b SET remaining = b.remaining - k.n, succeeded = b.succeeded + k.n
      FROM k WHERE b.id = k.batch_id AND b.remaining > k.n
    RETURNING 1
)
SELECT (SELECT count(*) FROM c), 0::bigint
"""


# The same group as the worker's single report statements, one after another in one transaction and one round trip
# (psycopg's pipeline mode): today's statement per child, one commit per group.
SINGLE = q("report_terminal")


def _single_params(child: tuple[str, str, int, str]) -> dict[str, object]:
    claim = Claim(child[1], child[2], child[3])
    return terminal_params(child[0], "succeeded", None, None, None, None, claim, None)


def _pipelined(conn: psycopg.Connection[Any], group: list[tuple[str, str, int, str]]) -> int:
    with conn.transaction(), conn.pipeline():
        cursors = [conn.execute(SINGLE.psycopg, _single_params(c)) for c in group]
    return sum(1 for cur in cursors if (row := cur.fetchone()) and row[0])


def _reporter(
    url: str, groups: list[list[tuple[str, str, int, str]]], style: str, ready: Any, go: Any, out: Any
) -> None:
    from bench.drain import _cpu_seconds

    conn = psycopg.connect(url, autocommit=True)
    backend = conn.info.backend_pid  # this machine's server: its CPU read from /proc, before the backend exits
    ready.release()
    go.wait()
    cpu = _cpu_seconds(backend)
    start = time.time()
    counted = deadlocks = 0
    for group in groups:
        params = {
            "task_ids": [c[0] for c in group],
            "batches": [c[1] for c in group],
            "idxs": [c[2] for c in group],
            "names": [c[3] for c in group],
        }
        while True:
            try:
                if style == "pipeline" and len(group) > 1:
                    counted += _pipelined(conn, group)
                elif style in ("pipeline", "single"):  # a group of one: today's statement, alone
                    row = conn.execute(SINGLE.psycopg, _single_params(group[0])).fetchone()
                    counted += int(bool(row and row[0]))
                else:
                    row = conn.execute(BOUND_REPORT if style == "bound" else GROUP_REPORT, params).fetchone()
                    counted += int(row[0]) if row else 0
                break
            except psycopg.errors.DeadlockDetected:  # a leaf finishing locks the root after its leaves: retried
                deadlocks += 1
    end = time.time()
    out.put((start, end, counted, deadlocks, _cpu_seconds(backend) - cpu))
    conn.close()


def _claims(url: str, ids: list[str]) -> dict[str, tuple[str, str, int, str, str]]:
    """What each child's message says (its batch as named, index, task name) and the counter row it decrements."""
    with psycopg.connect(url, autocommit=True) as db:
        rows = db.execute(
            "SELECT c.task_id, coalesce(b.parent_id, b.id)::text, c.idx, c.task_name, c.batch_id::text"
            " FROM fanin_children c JOIN fanin_batches b ON b.id = c.batch_id WHERE c.task_id = ANY(%s)",
            (ids,),
        )
        return {r[0]: (r[0], r[1], r[2], r[3], r[4]) for r in rows}


def phase(url: str, ids: list[str], reporters: int, group: int, style: str = "set") -> tuple[float, float, int, float]:
    """Events/s, events per WAL flush, deadlocks and PostgreSQL CPU µs per event of `reporters` processes reporting
    `ids` in groups of `group`, each group as `style` sends it ("set": one set-returning statement; "pipeline": the
    single statements in one transaction; "single": the single statement, groups of one only)."""
    claims = _claims(url, ids)
    work = []
    for i in range(reporters):
        mine = [claims[t] for t in ids[i::reporters]]
        groups = [sorted(mine[j : j + group], key=lambda c: c[4]) for j in range(0, len(mine), group)]
        work.append([[c[:4] for c in g] for g in groups])
    ctx: Any = multiprocessing.get_context("fork")
    ready, go, out = ctx.Semaphore(0), ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_reporter, args=(url, w, style, ready, go, out)) for w in work]
    for p in procs:
        p.start()
    for _ in procs:
        if not ready.acquire(timeout=60):
            raise RuntimeError("a reporter did not start")
    before = _wal(url)
    go.set()
    results = [out.get(timeout=600) for _ in procs]
    after = _wal(url)
    for p in procs:
        p.join(30)
    counted = sum(r[2] for r in results)
    if counted != len(ids):
        raise RuntimeError(f"{counted} of {len(ids)} reports counted")
    elapsed = max(r[1] for r in results) - min(r[0] for r in results)
    cpu = 1e6 * sum(r[4] for r in results) / len(ids)  # the reporters' backends only
    return len(ids) / elapsed, len(ids) / max(1, after[1] - before[1]), sum(r[3] for r in results), cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reporters", type=_ints, default=[1, 4, 16])
    parser.add_argument("--groups", type=_ints, default=[1, 8, 16])
    parser.add_argument("--events", type=int, default=4000, help="children reported per phase")
    parser.add_argument("--children", type=int, default=10_000, help="children per batch (default layout)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--style",
        choices=("set", "pipeline", "bound"),
        default="set",
        help="a group as one set-returning statement (default), as the single statements in one transaction, or "
        "as the least a set-based statement could do (`bound`: not a report, a bound on one)",
    )
    args = parser.parse_args()
    if 1 not in args.groups:
        parser.error("--groups must include 1 (today's report), the base of every ratio")
    with services("redis", "batched") as (url, _redis, queue, broker, _env):
        parked = Parked(url, f"{queue}-parked", broker, args.children, {})
        rates: dict[tuple[int, int], list[float]] = {(r, g): [] for r in args.reporters for g in args.groups}
        flushes: dict[tuple[int, int], list[float]] = {k: [] for k in rates}
        cpus: dict[tuple[int, int], list[float]] = {k: [] for k in rates}
        ratios: dict[tuple[int, int], list[float]] = {k: [] for k in rates}
        deadlocks = 0
        for rnd in range(args.rounds):
            for reporters in args.reporters:
                shift = rnd % len(args.groups)
                figures: dict[int, float] = {}
                for group in args.groups[shift:] + args.groups[:shift]:
                    _, ids = parked.take(args.events)
                    rate, per_flush, dead, cpu = phase(url, ids, reporters, group, args.style)
                    figures[group] = rate
                    rates[(reporters, group)].append(rate)
                    flushes[(reporters, group)].append(per_flush)
                    cpus[(reporters, group)].append(cpu)
                    deadlocks += dead
                for group in args.groups:
                    ratios[(reporters, group)].append(figures[group] / figures[1])
                line = " ".join(f"G={g} {figures[g]:.0f}/s" for g in args.groups)
                print(f"round {rnd + 1} reporters {reporters:>2}: {line}", flush=True)
    print(
        f"\none default batch of {args.children} ({parked.leaves} leaves), {args.events} reports a phase, "
        f"{args.rounds} rounds, groups sent as {args.style!r}; deadlocks retried: {deadlocks}"
    )
    print(
        "| reporters | group | events/s (median, range) | vs group of 1, paired (median, range) | events/WAL flush "
        "| PostgreSQL CPU µs/event |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    for (reporters, group), v in rates.items():
        r, flush = ratios[(reporters, group)], statistics.median(flushes[(reporters, group)])
        cpu = statistics.median(cpus[(reporters, group)])
        print(
            f"| {reporters} | {group} | {statistics.median(v):.0f} ({min(v):.0f}-{max(v):.0f}) | "
            f"{statistics.median(r):.2f} ({min(r):.2f}-{max(r):.2f}) | {flush:.1f} | {cpu:.0f} |"
        )


if __name__ == "__main__":
    main()
