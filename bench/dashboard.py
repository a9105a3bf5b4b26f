"""The dashboard on a big store: `python -m bench.dashboard [--batches 100000 --children 1000000]`.

Creates a scratch database (dropped afterwards), migrates it, fills it with one INSERT ... SELECT generate_series
per table (root batches of about ten children each, one large tree of leaf counters with failures, successors,
sagas with steps), ANALYZEs it, serves the dashboard with uvicorn on loopback, and times each page over HTTP
(`--repeats` requests after one warm-up): the batches page unfiltered, by each filter and one keyset page on, a
batch page (the tree's), the sagas page and a saga. Prints one line per page (p50, p95 and max in ms) and exits 1
if the batches page's p95 is over `--budget-ms` (200). `populate` is also what tests/web/test_explain.py plans on.
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import socket
import statistics
import sys
import threading
import time
from typing import Any

from sqlalchemy import create_engine, text
from sqlalchemy.pool import NullPool

from celery_fanin.context import normalise_database_url

# One statement per table. Batch i (1-based) of `:batches`; batch 1 is the big tree's root, whose `:leaves` leaf
# counters (ids from 'leaf' || k) hold `:big` children; the other roots hold `:per` children each. States, steps,
# apps and keys are spread so that each filter of the page has a common value and a rare one (bench and EXPLAIN
# test alike): state failed_threshold 1 %, step rare-step and app rare-app a few rows, key order-<i> on even i.
POPULATE = [
    """
    INSERT INTO fanin_batches (id, step, state, planned, remaining, succeeded, failed, published_upto,
                               successor_task_id, successor_name, successor_message, successor_content_type,
                               successor_content_encoding, created_at, completed_at, app_name, key)
    SELECT md5('batch' || i)::uuid,
           CASE WHEN i % 4000 = 13 THEN 'rare-step' ELSE 'step-' || (i % 20) END,
           st.state, p.planned,
           CASE WHEN i = 1 THEN :leaves WHEN st.state = 'running' THEN p.planned - p.planned / 2 ELSE 0 END,
           CASE WHEN i = 1 THEN 0 WHEN st.state = 'running' THEN p.planned / 2 WHEN st.state = 'failed_threshold'
                THEN 0 ELSE p.planned - CASE WHEN i % 7 = 0 THEN 1 ELSE 0 END END,
           CASE WHEN i = 1 OR st.state = 'running' THEN 0 WHEN st.state = 'failed_threshold' THEN p.planned
                ELSE CASE WHEN i % 7 = 0 THEN 1 ELSE 0 END END,
           p.planned, 'succ-' || i, 'bench.then', convert_to('{"task": "bench.then", "args": []}', 'UTF8'),
           'application/json', 'utf-8',
           now() - make_interval(secs => (:batches - i) * 20.0),
           CASE WHEN st.state = 'running' THEN NULL ELSE now() - make_interval(secs => (:batches - i) * 20.0 - 5) END,
           CASE WHEN i % 5000 = 11 THEN 'rare-app' WHEN i % 50 = 3 THEN 'billing' ELSE 'shop' END,
           CASE WHEN i % 2 = 0 THEN 'order-' || i END
      FROM generate_series(1, :batches) AS i
     CROSS JOIN LATERAL (SELECT CASE WHEN i = 1 OR i % 10 = 1 THEN 'running'
                                     WHEN i % 100 = 0 THEN 'failed_threshold' ELSE 'complete' END AS state) st
     CROSS JOIN LATERAL (SELECT CASE WHEN i = 1 THEN :big ELSE :per END AS planned) p
    """,
    """
    INSERT INTO fanin_batches (id, step, state, planned, remaining, succeeded, failed, published_upto,
                               successor_task_id, successor_name, successor_message, successor_content_type,
                               successor_content_encoding, created_at, app_name, parent_id)
    SELECT md5('leaf' || k)::uuid, 'step-1', 'running', :big / :leaves, :big / :leaves / 2,
           :big / :leaves / 2 - :big / :leaves / 200, :big / :leaves / 200, :big / :leaves, 'leaf-' || k,
           'bench.then', '\\x'::bytea, 'application/json', 'utf-8', now() - make_interval(secs => :batches * 20.0),
           'shop', md5('batch1')::uuid
      FROM generate_series(1, :leaves) AS k
    """,
    """
    INSERT INTO fanin_children (task_id, batch_id, idx, task_name, state, message, content_type, content_encoding,
                                exc_type, exc_message, started_at, finished_at, starts)
    SELECT 'child-' || j, g.batch_id, g.idx, 'bench.child', c.state,
           convert_to('{"task": "bench.child", "args": [' || j || '], "kwargs": {}}', 'UTF8'),
           'application/json', 'utf-8',
           CASE WHEN c.state = 'failed' THEN 'ValueError' END,
           CASE WHEN c.state = 'failed' THEN 'child ' || j || ' failed' END,
           CASE WHEN c.state <> 'pending' THEN c.at END,
           CASE WHEN c.state NOT IN ('pending', 'started') THEN c.at + interval '1 second' END,
           CASE WHEN c.state <> 'pending' THEN 1 ELSE 0 END
      FROM generate_series(0, :children - 1) AS j
     CROSS JOIN LATERAL (
           -- the tree's children go round robin to its leaves (pos: the place in its leaf); the rest in order
           SELECT CASE WHEN j < :big THEN md5('leaf' || (j % :leaves + 1))::uuid
                       ELSE md5('batch' || ((j - :big) / :per + 2))::uuid END AS batch_id,
                  CASE WHEN j < :big THEN j ELSE (j - :big) % :per END AS idx,
                  CASE WHEN j < :big THEN 1 ELSE (j - :big) / :per + 2 END AS i,
                  j / :leaves AS pos) g
     CROSS JOIN LATERAL (
           SELECT CASE WHEN g.i = 1 THEN
                            CASE WHEN g.pos < :big / :leaves / 2 - :big / :leaves / 200 THEN 'succeeded'
                                 WHEN g.pos < :big / :leaves / 2 THEN 'failed'
                                 WHEN g.pos % 97 = 0 THEN 'started' ELSE 'pending' END
                       WHEN g.i % 10 = 1 THEN
                            CASE WHEN g.idx < :per / 2 THEN 'succeeded' WHEN g.idx = :per / 2 THEN 'started'
                                 ELSE 'pending' END
                       WHEN g.i % 100 = 0 THEN 'failed'
                       WHEN g.i % 7 = 0 AND g.idx = 0 THEN 'failed'
                       ELSE 'succeeded' END AS state,
                  now() - make_interval(secs => (:batches - g.i) * 20.0)
                      + make_interval(secs => CASE WHEN g.i = 1 THEN g.pos * 0.05 ELSE 1 + g.idx * 0.1 END) AS at) c
    """,
    """
    INSERT INTO fanin_successors (batch_id, step, task_id, state, runs, created_at, started_at, finished_at)
    SELECT b.id, b.step, b.successor_task_id, 'succeeded', 1, b.completed_at, b.completed_at, b.completed_at
      FROM fanin_batches b
     WHERE b.parent_id IS NULL AND b.state <> 'running'
    """,
    """
    INSERT INTO fanin_sagas (id, app_name, key, state, steps, current_step, failed_step, exc_type, exc_message,
                             created_at, state_at, finished_at)
    SELECT md5('saga' || s)::uuid, 'shop', 'saga-order-' || s,
           CASE WHEN s % 100 = 0 THEN 'manual_action_required' WHEN s % 10 = 1 THEN 'running' ELSE 'succeeded' END,
           3, CASE WHEN s % 10 = 1 THEN 2 ELSE 3 END, CASE WHEN s % 100 = 0 THEN 3 END,
           CASE WHEN s % 100 = 0 THEN 'ConnectionError' END, CASE WHEN s % 100 = 0 THEN 'the carrier is down' END,
           now() - make_interval(secs => (:sagas - s) * 30.0), now(), CASE WHEN s % 10 <> 1 THEN now() END
      FROM generate_series(1, :sagas) AS s
    """,
    """
    INSERT INTO fanin_saga_steps (saga_id, position, kind, name, definition, content_type, content_encoding, state,
                                  batch_id)
    SELECT md5('saga' || s)::uuid, p, 'task', 'shop.step' || p, '\\x'::bytea, 'application/json', 'utf-8',
           CASE WHEN s % 10 = 1 AND p = 3 THEN 'pending' WHEN s % 10 = 1 AND p = 2 THEN 'running'
                ELSE 'succeeded' END,
           md5('batch' || ((s * 3 + p) % :batches + 1))::uuid
      FROM generate_series(1, :sagas) AS s CROSS JOIN generate_series(1, 3) AS p
    """,
]


def populate(url: str, *, batches: int, children: int, sagas: int, big: int | None = None) -> dict[str, Any]:
    """Fill a migrated, empty database (see POPULATE); returns the sizes and the ids the pages are timed on."""
    if batches < 2:
        raise ValueError("--batches must be at least 2 (one tree and the rest)")
    big = big if big is not None else max(10, children // 10)
    leaves = max(1, big // 10_000)
    big = big // leaves * leaves  # whole leaves
    per = max(1, (children - big) // (batches - 1))
    params = {
        "batches": batches,
        "children": big + per * (batches - 1),
        "sagas": max(1, sagas),
        "big": big,
        "leaves": leaves,
        "per": per,
    }
    engine = create_engine(normalise_database_url(url), poolclass=NullPool)
    try:
        with engine.begin() as conn:
            for statement in POPULATE:
                conn.execute(text(statement), params)
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(text("ANALYZE"))
            tree, saga, rows, child_rows = conn.execute(
                text(
                    "SELECT md5('batch1')::uuid, md5('saga100')::uuid, (SELECT count(*) FROM fanin_batches),"
                    " (SELECT count(*) FROM fanin_children)"
                )
            ).one()
    finally:
        engine.dispose()
    return {
        "batches": rows,
        "children": child_rows,
        "sagas": params["sagas"],
        "tree_children": big,
        "tree_leaves": leaves,
        "tree": str(tree),
        "saga": str(saga),
    }


def _serve(app: Any) -> tuple[int, Any, threading.Thread]:
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # else a keep-alive response waits out a delayed ACK
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    return sock.getsockname()[1], server, thread


class Client:
    """One keep-alive HTTP connection to the dashboard (http.client: nothing between the timer and the socket)."""

    def __init__(self, port: int) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)

    def get(self, path: str) -> tuple[int, str]:
        self.conn.request("GET", path)
        response = self.conn.getresponse()
        return response.status, response.read().decode()

    def close(self) -> None:
        self.conn.close()


def pages(info: dict[str, Any], client: Client) -> dict[str, str]:
    """The pages timed: name -> path (the older page is the one the first page links to)."""
    first = client.get("/batches")[1]
    marker = 'rel="next" href="'
    older = first.split(marker, 1)[1].split('"', 1)[0].replace("&amp;", "&") if marker in first else "/batches"
    return {
        "batches": "/batches",
        "batches, older page": older,
        "batches ?state=running": "/batches?state=running",
        "batches ?state=failed_threshold": "/batches?state=failed_threshold",
        "batches ?step=rare-step": "/batches?step=rare-step",
        "batches ?app=rare-app": "/batches?app=rare-app",
        "batches ?key=order-1234": "/batches?key=order-1234",
        f"batch (a tree of {info['tree_children']:,} children)": f"/batches/{info['tree']}",
        "sagas": "/sagas",
        "saga": f"/sagas/{info['saga']}",
    }


def measure(client: Client, paths: dict[str, str], repeats: int) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for name, path in paths.items():
        status, _ = client.get(path)  # warm-up: the plan, the pool, the cache
        if status != 200:
            raise SystemExit(f"{name}: GET {path} answered {status}")
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            status, _ = client.get(path)
            times.append((time.perf_counter() - start) * 1000)
            if status != 200:
                raise SystemExit(f"{name}: GET {path} answered {status}")
        times.sort()
        out[name] = {
            "p50_ms": round(statistics.median(times), 1),
            "p95_ms": round(times[max(0, math.ceil(len(times) * 0.95) - 1)], 1),
            "max_ms": round(times[-1], 1),
        }
    return out


def statement_ms(engine: Any, path: str) -> float | None:
    """For a batches page: its statement's own time in PostgreSQL (EXPLAIN ANALYZE: planning and execution), the
    part of the page that grows with the store; None for the other pages."""
    from urllib.parse import parse_qsl, urlsplit

    from celery_fanin.web import data
    from celery_fanin.web.sql import sql

    url = urlsplit(path)
    if url.path != "/batches":
        return None
    query = dict(parse_qsl(url.query))
    before = data.Cursor.decode(query.get("before"))
    params = {
        **data.BatchFilters.from_query(query).params(),
        "n": 51,
        "before_at": before.created_at if before else None,
        "before_id": before.id if before else None,
    }
    with data.read(engine) as conn:
        plan = conn.execute(
            text("EXPLAIN (ANALYZE, FORMAT JSON) " + sql("dashboard", "batches_page")), params
        ).scalar_one()
    top = plan[0] if isinstance(plan, list) else json.loads(plan)[0]
    return round(float(top["Planning Time"]) + float(top["Execution Time"]), 2)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.dashboard", description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, default=100_000)
    p.add_argument("--children", type=int, default=1_000_000)
    p.add_argument("--sagas", type=int, default=10_000)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--budget-ms", type=float, default=200.0, help="the batches page's p95 must be under this")
    p.add_argument("--json", action="store_true", help="print the figures as JSON too")
    args = p.parse_args(argv)

    from celery import Celery

    from bench.run import database
    from celery_fanin import FanIn
    from celery_fanin.web import create_app

    with database() as url:
        app = Celery("bench-dashboard", set_as_current=False)
        app.conf.fanin_database_url = url
        fanin = FanIn(app)
        fanin.migrate()
        start = time.perf_counter()
        info = populate(url, batches=args.batches, children=args.children, sagas=args.sagas)
        filled = time.perf_counter() - start
        print(
            f"store: {info['batches']:,} batches (a tree's {info['tree_leaves']} leaf counters among them), "
            f"{info['children']:,} children, {info['sagas']:,} sagas; filled and analysed in {filled:.1f} s",
            flush=True,
        )
        load_before = os.getloadavg()[0]
        dashboard = create_app(fanin)
        port, server, thread = _serve(dashboard)
        client = Client(port)
        try:
            paths = pages(info, client)
            figures = measure(client, paths, args.repeats)
            for name, path in paths.items():
                figures[name]["sql_ms"] = statement_ms(dashboard.state.engine, path)
        finally:
            client.close()
            server.should_exit = True
            thread.join(10)
            dashboard.state.engine.dispose()
            fanin.dispose()
    load_after = os.getloadavg()[0]
    print(
        f"machine: {os.cpu_count()} cores, load average {load_before:.1f} before the requests, {load_after:.1f} after"
    )
    width = max(len(n) for n in figures)
    head = f"{'page':<{width}}  {'p50 ms':>8}  {'p95 ms':>8}  {'max ms':>8}  {'SQL ms':>7}"
    print(f"{head}   ({args.repeats} requests each; SQL: the batches statement's planning and execution)")
    for name, f in figures.items():
        sql_ms = "" if f["sql_ms"] is None else f["sql_ms"]
        print(f"{name:<{width}}  {f['p50_ms']:>8}  {f['p95_ms']:>8}  {f['max_ms']:>8}  {sql_ms:>7}")
    if args.json:
        machine = {"cores": os.cpu_count(), "load_before": round(load_before, 2), "load_after": round(load_after, 2)}
        print(json.dumps({"store": info, "filled_s": round(filled, 1), "machine": machine, "pages": figures}, indent=2))
    worst = max(f["p95_ms"] for n, f in figures.items() if n.startswith("batches"))
    ok = worst < args.budget_ms
    print(
        f"batches pages: worst p95 {worst} ms, budget {args.budget_ms:.0f} ms: {'met' if ok else 'MISSED'}",
        file=sys.stderr,
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
