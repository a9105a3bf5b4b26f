"""One dispatch in a fresh process: `python -m bench.dispatch CONTENDER N RUN_ID` prints one JSON line.

A process of its own per dispatch, so that its peak RSS is this dispatch's alone. The signatures are built before
the clock starts, for every contender alike; the clock covers the call to `apply_async` and nothing else. As in a
process that has dispatched before, the connections are made first: the broker's for every contender, and the
fan-in's database pool for the fan-in (its first connection costs ~25 ms, most of it SQLAlchemy importing its
PostgreSQL dialect).
"""

from __future__ import annotations

import json
import resource
import sys
import time

from celery import chord, group

from bench.tasks import app, child, mark
from celery_fanin import FanIn, fan_in_group


def main(contender: str, n: int, run: str) -> dict[str, float]:
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with app.producer_or_acquire() as prod:  # connect first: no contender pays for the broker handshake
        prod.channel  # noqa: B018
    if contender == "group":
        sigs = [child.s(i, run, n) for i in range(n)]
        job = group(sigs)
        start = time.time()
        job.apply_async()
    elif contender == "group_ff":
        # Fire and forget: the same group with no result kept, as a user writes it when nothing waits on it.
        sigs = [child.s(i, run, n).set(ignore_result=True) for i in range(n)]
        job = group(sigs)
        start = time.time()
        job.apply_async()
    elif contender == "chord":
        sigs = [child.s(i, run, n) for i in range(n)]
        job = chord(sigs, mark.s(run))
        start = time.time()
        job.apply_async()
    elif contender == "fanin":
        # The children as a chord user writes them: the fan-in itself keeps their results out of the backend.
        sigs = [child.s(i, run, n) for i in range(n)]
        fanin_job = fan_in_group(sigs, then=mark.s(run), app=app)
        FanIn.of(app).engine.connect().close()  # the pool keeps the connection
        start = time.time()
        fanin_job.apply_async()
    else:
        raise SystemExit(f"unknown contender {contender!r}")
    end = time.time()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return {"start": start, "dispatch_s": end - start, "rss_peak_mb": peak / 1024, "rss_base_mb": rss_before / 1024}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], int(sys.argv[2]), sys.argv[3])), flush=True)
