"""The producer side of a very wide batch: `python -m bench.million --n 1000000`.

Streams N children from a generator into one fan-in (chunks of `fanin_chunk_size`, a tree above `max_width`),
with no worker consuming them, and prints the dispatch time, the producer's peak RSS, and the counts the store
holds (planned, child rows, leaves, published), which must all equal N. Its own database and Redis database, both
dropped afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from collections.abc import Iterator
from typing import Any

import psycopg

from bench.run import database, redis_database


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--n", type=int, default=1_000_000)
    args = p.parse_args(argv)
    with database() as url, redis_database() as broker:
        os.environ["BENCH_BROKER"] = broker
        os.environ["FANIN_DATABASE_URL"] = url
        from celery import Celery

        from celery_fanin import FanIn, fan_in_group

        app = Celery("bench-million", broker=broker, set_as_current=False)
        app.conf.fanin_database_url = url
        fanin = FanIn(app)
        fanin.migrate()

        @app.task(name="bench.million.child")
        def child(i: int) -> int:
            return i

        @app.task(name="bench.million.done")
        def done(outcome: dict[str, Any]) -> None:
            return None

        def source() -> Iterator[Any]:
            for i in range(args.n):
                yield child.s(i).set(queue="bench-million-parked")

        start = time.monotonic()
        handle = fan_in_group(source(), then=done.s(), app=app).apply_async()
        elapsed = time.monotonic() - start
        rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        status = handle.status()
        with psycopg.connect(url, autocommit=True) as conn:
            rows, distinct = conn.execute(
                "SELECT count(*), count(DISTINCT idx) FROM fanin_children WHERE batch_id IN "
                "(SELECT id FROM fanin_batches WHERE id = %s OR parent_id = %s)",
                (handle.batch_id, handle.batch_id),
            ).fetchone()  # type: ignore[misc]
            leaves = conn.execute("SELECT count(*) FROM fanin_batches WHERE parent_id = %s",
                                  (handle.batch_id,)).fetchone()[0]  # type: ignore[index]  # fmt: skip
        report = {"n": args.n, "dispatch_s": round(elapsed, 1), "children_per_s": round(args.n / elapsed),
                  "producer_peak_rss_mb": round(rss_mb), "planned": status.planned, "child_rows": rows,
                  "distinct_indexes": distinct, "published": status.published, "leaves": leaves,
                  "state": status.state}  # fmt: skip
        print(json.dumps(report, indent=2))
        ok = status.planned == rows == distinct == status.published == args.n and status.state == "running"
        fanin.dispose()
        return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
