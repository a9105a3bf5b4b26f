"""What the successor predicates cost the relay's scans: `python -m bench.predicates --rows 200000 --repeats 13`.

Migration 0034 says once, in plain SQL functions (`fanin_successor_stalled` and the rest), what the relay's queries
and the store's functions restated. The planner inlines them, which a definer function (the rights every other
fanin function runs with) would prevent. This times the relay's `stalled` scan over `--rows` successors three ways,
in a rotating order within each repeat: the expression written out (version 33), the predicate (inlined), and the
same predicate behind a definer function (a call per row). Prints each one's median and the ratios paired within
each repeat (the first repeat is a warm-up and left out).
"""

from __future__ import annotations

import argparse
import statistics
import time

import psycopg
from celery import Celery

from bench.run import database
from celery_fanin import FanIn
from celery_fanin.store.statements import q

# The relay's scan as version 33 wrote it.
WRITTEN_OUT = """SELECT s.batch_id, s.step FROM fanin_successors s
 WHERE s.carrier IS NULL AND ((s.state IN ('sent', 'retrying', 'requeued', 'replaced')
        AND coalesce(s.lease_until, s.state_at)
            < now() - make_interval(secs => CAST(%(timeout)s AS double precision)))
    OR (s.state = 'running'
        AND coalesce(s.lease_until, s.state_at) < now() - make_interval(secs => CAST(%(grace)s AS double precision))))
 LIMIT %(n)s"""

# The predicate behind a definer function with a pinned search path: what it would be without the exemption.
DEFINER = """CREATE FUNCTION bench_stalled_definer(p_state text, p_carrier text, p_lease_until timestamptz,
                                      p_state_at timestamptz, p_timeout double precision, p_grace double precision)
RETURNS boolean LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, public
RETURN fanin_successor_stalled(p_state, p_carrier, p_lease_until, p_state_at, p_timeout, p_grace)"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000, help="successor rows scanned")
    parser.add_argument("--repeats", type=int, default=13, help="repeats, the first a warm-up")
    args = parser.parse_args()
    with database() as url:
        app = Celery("bench-predicates", set_as_current=False)
        app.conf.fanin_database_url = url
        fanin = FanIn(app)
        fanin.migrate()
        fanin.dispose()
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(
                "INSERT INTO fanin_batches (id, step, state, planned, remaining, successor_task_id, successor_name,"
                " successor_message, successor_content_type, successor_content_encoding)"
                " SELECT gen_random_uuid(), 'then', 'complete', 0, 0, 't', 'n', '\\x00', 'application/json', 'utf-8'"
                " FROM generate_series(1, %s)",
                (args.rows,),
            )
            # Live runs and finished ones: the scan reads every row and returns none (the common case).
            conn.execute(
                "INSERT INTO fanin_successors (batch_id, step, task_id, kind, state, lease_until)"
                " SELECT id, 'then', id::text, 'then', (ARRAY['succeeded', 'running', 'sent', 'failed'])[1 + i % 4],"
                " now() + interval '1 hour' FROM (SELECT id, row_number() OVER () AS i FROM fanin_batches) b"
            )
            conn.execute("VACUUM ANALYZE fanin_successors")
            conn.execute(DEFINER)
            inlined = q("stalled").psycopg
            contenders = [
                ("written out", WRITTEN_OUT),
                ("predicate", inlined),
                ("definer", inlined.replace("fanin_successor_stalled(", "bench_stalled_definer(")),
            ]
            params = {"timeout": 60.0, "grace": 30.0, "n": 100}
            times: dict[str, list[float]] = {name: [] for name, _ in contenders}
            for repeat in range(args.repeats):
                turn = repeat % len(contenders)
                for name, sql in contenders[turn:] + contenders[:turn]:
                    start = time.perf_counter()
                    conn.execute(sql, params).fetchall()
                    times[name].append(time.perf_counter() - start)
    print(f"the relay's stalled scan over {args.rows} successors, {args.repeats - 1} timed repeats")
    for name, seconds in times.items():
        print(f"  {name:12} median {statistics.median(seconds[1:]) * 1000:8.1f} ms")
    base = times["written out"][1:]
    for name in ("predicate", "definer"):
        ratios = [t / b for t, b in zip(times[name][1:], base, strict=True)]
        low, high = min(ratios), max(ratios)
        print(f"  {name} / written out, paired: median {statistics.median(ratios):.3f} (range {low:.3f}-{high:.3f})")


if __name__ == "__main__":
    main()
