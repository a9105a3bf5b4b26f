"""The dashboard's statements walk indexes on a big store: each page's plan, read with EXPLAIN on a scratch database
filled by bench/dashboard.py's generator, scans no big table sequentially and uses the index its filter has.

The planner prefers a sequential scan on small tables, so the store is filled to a size (20,000 batches, 130,000
children) where only an index makes a page cheap; the plans are those of the dashboard's own connections (no
server-side prepares: each statement is planned with its values, as when it serves a page).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from celery import Celery
from sqlalchemy import text

from bench.dashboard import populate
from celery_fanin import FanIn
from celery_fanin.web import create_app, data
from celery_fanin.web.sql import sql
from tests.conftest import ADMIN_URL

pytestmark = pytest.mark.timeout(300)
BIG_TABLES = {"fanin_batches", "fanin_children", "fanin_successors", "fanin_sagas"}


@pytest.fixture(scope="module")
def big_store() -> Iterator[tuple[Any, dict[str, Any]]]:
    name = f"fanin_explain_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(ADMIN_URL, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')  # a generated identifier, not input
    url = f"{ADMIN_URL.rsplit('/', 1)[0]}/{name}"
    app = Celery("fanin-explain", set_as_current=False)
    app.conf.fanin_database_url = url
    fanin = FanIn(app)
    try:
        fanin.migrate()
        info = populate(url, batches=20_000, children=130_000, sagas=3_000, big=30_000)
        web = create_app(app)
        yield web.state.engine, info
        web.state.engine.dispose()
    finally:
        fanin.dispose()
        with psycopg.connect(ADMIN_URL, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", []):
        yield from _nodes(child)


def _plan(engine: Any, name: str, params: dict[str, Any]) -> list[dict[str, Any]]:
    with data.read(engine) as conn:
        raw = conn.execute(text("EXPLAIN (FORMAT JSON) " + sql("dashboard", name)), params).scalar_one()
    plan = raw if isinstance(raw, list) else json.loads(raw)
    return list(_nodes(plan[0]["Plan"]))


def _page(filters: data.BatchFilters, before: data.Cursor | None = None) -> dict[str, Any]:
    return {
        **filters.params(),
        "before_at": before.created_at if before else None,
        "before_id": before.id if before else None,
        "n": 51,
    }


def _check(nodes: list[dict[str, Any]], *indexes: str) -> None:
    """No big table read sequentially, and one of `indexes` used."""
    scans = [(n["Node Type"], n.get("Relation Name"), n.get("Index Name")) for n in nodes]
    seq = [s for s in scans if s[0] == "Seq Scan" and s[1] in BIG_TABLES]
    assert not seq, f"sequential scan of a big table: {scans}"
    used = {s[2] for s in scans if s[2]}
    assert used & set(indexes), f"none of {indexes} used: {scans}"


def test_the_batches_page_walks_the_index_of_its_filter(big_store: tuple[Any, dict[str, Any]]) -> None:
    engine, _ = big_store
    cases = {
        "fanin_batches_roots": data.BatchFilters(),
        "fanin_batches_roots_state": data.BatchFilters(state="failed_threshold"),
        "fanin_batches_roots_step": data.BatchFilters(step="rare-step"),
        "fanin_batches_roots_app": data.BatchFilters(app="rare-app"),
        "fanin_batches_roots_key": data.BatchFilters(key="order-1234"),
    }
    for index, filters in cases.items():
        nodes = _plan(engine, "batches_page", _page(filters))
        _check(nodes, index)
        assert "fanin_successors_pkey" in {n.get("Index Name") for n in nodes}, "each row's successor by key"
    # Common values too: however many rows match, the page reads an index in the page's order.
    for filters in (
        data.BatchFilters(state="complete"),
        data.BatchFilters(step="step-3"),
        data.BatchFilters(app="shop"),
        data.BatchFilters(key="order-"),
    ):
        nodes = _plan(engine, "batches_page", _page(filters))
        _check(nodes, next(n["Index Name"] for n in nodes if n.get("Relation Name") == "fanin_batches"))
    # A page further on: the keyset cursor is an index condition, not rows skipped over.
    with data.read(engine) as conn:
        first = data.batches_page(conn, data.BatchFilters(), None, 50)
    assert first.next is not None
    nodes = _plan(engine, "batches_page", _page(data.BatchFilters(), first.next))
    _check(nodes, "fanin_batches_roots")
    roots = next(n for n in nodes if n.get("Index Name") == "fanin_batches_roots")
    assert "created_at" in roots.get("Index Cond", ""), roots
    _check(_plan(engine, "active_counts", {}), "fanin_batches_roots_state", "fanin_batches_running")


def test_the_batch_page_reads_a_trees_failures_and_sample_by_index(big_store: tuple[Any, dict[str, Any]]) -> None:
    engine, info = big_store
    tree = uuid.UUID(info["tree"])
    with data.read(engine) as conn:
        leaves = conn.execute(text(sql("dashboard", "leaf_sizes")), {"id": tree}).all()
    assert len(leaves) == info["tree_leaves"] > 1
    _check(_plan(engine, "batch_detail", {"id": tree}), "fanin_batches_pkey")
    _check(_plan(engine, "leaf_sizes", {"id": tree}), "fanin_batches_leaves")
    _check(_plan(engine, "failure_counts", {"id": tree}), "fanin_children_failures")
    _check(_plan(engine, "failures_page", {"id": tree, "after": -1, "n": 51}), "fanin_children_failures")
    sizes = [0, *(int(leaf.planned) for leaf in leaves)]
    params = {"ids": [tree, *(leaf.id for leaf in leaves)], "counts": data.sample_counts(sizes)}
    _check(_plan(engine, "start_sample", params), "fanin_children_batch_id_idx_key")
    with data.read(engine) as conn:
        page = data.batch_page(conn, tree)
    assert page is not None and page.chart is not None and page.chart.is_sample
    # A bounded sample, whatever the tree's size (each leaf's share is rounded up).
    assert data.SAMPLE <= page.chart.sampled <= data.SAMPLE + len(leaves) < info["tree_children"]
    assert page.failures_total == info["tree_children"] // 200


def test_the_sagas_page_walks_its_index(big_store: tuple[Any, dict[str, Any]]) -> None:
    engine, _ = big_store
    _check(
        _plan(engine, "sagas_page", {"state": None, "before_at": None, "before_id": None, "n": 51}),
        "fanin_sagas_created",
    )
