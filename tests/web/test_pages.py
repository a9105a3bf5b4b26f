"""Every page of the dashboard and every filter, against the real test database: what each shows, in what order,
and what it refuses (bad filters, unknown ids, writes)."""

from __future__ import annotations

import html
import re
import uuid
from typing import Any

import pytest
from celery import Celery
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError
from starlette.testclient import TestClient

from celery_fanin import FanIn, compensated, manual, protocol, saga
from celery_fanin.sagas import driver as saga_driver
from celery_fanin.web import create_app

from .conftest import Store

pytestmark = pytest.mark.timeout(60)


def _row(page: str, attr: str, value: str) -> str:
    """The table row `<tr data-<attr>="<value>">...</tr>` of a page (AssertionError if it is not there)."""
    found = re.search(rf'<tr {attr}="{re.escape(value)}">(.*?)</tr>', page, re.S)
    assert found, f"no row {attr}={value}"
    return found.group(1)


def _listed(page: str) -> list[str]:
    return re.findall(r'<tr data-batch="([0-9a-f-]+)">', page)


def _progress(fragment: str) -> tuple[int, int]:
    """(done, planned) of the first progress bar in `fragment`."""
    found = re.search(r'aria-valuemax="(\d+)" aria-valuenow="(\d+)"', fragment)
    assert found, fragment[:500]
    return int(found.group(2)), int(found.group(1))


def _older(page: str) -> str | None:
    found = re.search(r'rel="next" href="([^"]+)"', page)
    return html.unescape(found.group(1)) if found else None


def test_batches_page_shows_each_root_with_its_progress(client: TestClient, store: Store) -> None:
    done = store.batch(3, key="order-1")
    for i in range(3):
        store.finish(done, i)
    store.run_successor(done)
    half = store.batch(4, step="resize")
    store.finish(half, 0)
    store.finish(half, 1, "failed")
    fresh = store.batch(2)

    page = client.get("/batches")
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    assert _listed(page.text) == [fresh.id, half.id, done.id], "newest first"
    row = _row(page.text, "data-batch", half.id)
    assert _progress(row) == (2, 4)
    assert 'data-failed="1"' in row and ">resize<" in row and "s-running" in row
    row = _row(page.text, "data-batch", done.id)
    assert _progress(row) == (3, 3) and "s-complete" in row and "order-1" in row
    assert "s-succeeded" in row, "the successor's state"
    assert "2 running, 0 open" in page.text
    root = client.get("/", follow_redirects=False)
    assert root.status_code == 307 and root.headers["location"] == "/batches"


def test_each_filter_selects_what_it_names(client: TestClient, store: Store, app: Celery) -> None:
    other = Celery("other-app", broker=app.conf.broker_url, set_as_current=False)
    other.conf.fanin_database_url = app.conf.fanin_database_url
    FanIn(other)
    try:
        complete = store.batch(1, step="thumbs", key="order-17")
        store.finish(complete, 0)
        running = store.batch(2, step="thumbs", key="order-170")
        elsewhere = store.batch(1, app=other, step="bill", key="order-2")
        underscore = store.batch(1, key="a_b")
        lookalike = store.batch(1, key="axb")  # `_` is a character of the prefix, not a wildcard
        keyless = store.batch(1)

        def listed(**query: str) -> set[str]:
            page = client.get("/batches", params=query)
            assert page.status_code == 200, page.text
            return set(_listed(page.text))

        everything = {complete.id, running.id, elsewhere.id, underscore.id, lookalike.id, keyless.id}
        assert listed() == everything
        assert listed(state="complete") == {complete.id}
        assert listed(state="running") == everything - {complete.id}
        assert listed(state="expired") == set()
        assert listed(step="thumbs") == {complete.id, running.id}
        assert listed(step="thumb") == set(), "a step matches exactly"
        assert listed(app="other-app") == {elsewhere.id}
        assert listed(app="fanin-tests") == everything - {elsewhere.id}
        assert listed(key="order-17") == {complete.id, running.id}, "a key filter is a prefix"
        assert listed(key="order-") == {complete.id, running.id, elsewhere.id}
        assert listed(key="a_") == {underscore.id}
        assert listed(key="order-1", state="running", step="thumbs") == {running.id}, "filters combine"
        assert listed(step="", app="", key="", state="") == everything, "an empty filter is no filter"
        # The filters stay in the form and in the links of the page.
        page = client.get("/batches", params={"step": "thumbs", "state": "running"})
        assert 'value="thumbs"' in page.text and '<option value="running" selected>' in page.text
    finally:
        FanIn.of(other).dispose()


def test_keyset_pages_cover_every_batch_once_in_order(app: Celery, store: Store) -> None:
    made = [store.batch(1, step="paged").id for _ in range(7)]
    web = create_app(app, page_size=3)
    try:
        with TestClient(web) as client:
            seen: list[list[str]] = []
            url: str | None = "/batches?step=paged"
            while url is not None:
                page = client.get(url)
                assert page.status_code == 200
                seen.append(_listed(page.text))
                url = _older(page.text)
                if url:
                    assert "step=paged" in url, "the next page keeps the filters"
                assert ("« newest" in page.text) == (len(seen) > 1)
            assert [len(p) for p in seen] == [3, 3, 1]
            assert [b for p in seen for b in p] == list(reversed(made))
            # A cursor at the epoch: nothing is older, and the page links back to the newest.
            past = client.get(f"/batches?step=paged&before=0_{uuid.UUID(made[0]).hex}").text
            assert _listed(past) == [] and "« newest" in past and "No batches match these filters" in past
    finally:
        web.state.engine.dispose()


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("/batches?state=nope", "unknown batch state 'nope'"),
        ("/batches?before=yesterday", "is not a page cursor"),
        ("/batches?before=12_nothex", "is not a page cursor"),
        ("/batches?key=" + "k" * 501, "longer than 500 characters"),
        ("/batches/not-a-uuid", "is not a batch id"),
        ("/sagas?state=nope", "unknown saga state 'nope'"),
        ("/sagas/not-a-uuid", "is not a saga id"),
        (f"/batches/{uuid.UUID(int=1)}?failures_after=x", "is not a whole number"),
    ],
)
def test_bad_input_is_a_400_that_says_why(client: TestClient, path: str, message: str) -> None:
    page = client.get(path)
    assert page.status_code == 400
    assert message in html.unescape(page.text)
    partial = client.get(path + ("&" if "?" in path else "?") + "partial=1")
    assert partial.status_code == 400 and message in partial.text and "<html" not in partial.text


def test_unknown_ids_are_a_404(client: TestClient) -> None:
    missing = uuid.uuid4()
    page = client.get(f"/batches/{missing}")
    assert page.status_code == 404 and f"no fan-in batch with id {missing}" in page.text
    page = client.get(f"/sagas/{missing}")
    assert page.status_code == 404 and f"no saga with id {missing}" in page.text


def test_batch_page_counts_children_lists_failures_and_the_successor(client: TestClient, store: Store) -> None:
    batch = store.batch(6, step="ingest", key="nightly-7")
    store.finish(batch, 0)
    store.finish(batch, 1)
    store.finish(batch, 2, "failed", "disk <full> & 'quota'")
    page = client.get(f"/batches/{batch.id}")
    assert page.status_code == 200
    text_ = page.text
    assert batch.id in text_ and "nightly-7" in text_ and "ingest" in text_
    assert _progress(text_) == (3, 6)
    cards = dict(re.findall(r'data-state="(\w+)">\s*<div class="n">([\d,]+)</div>', text_))
    assert cards == {"succeeded": "2", "failed": "1", "started": "0", "pending": "3"}
    failures = text_.split('<table class="failures">', 1)[1].split("</table>", 1)[0]
    assert "ValueError: disk &lt;full&gt; &amp; &#39;quota&#39;" in failures, "escaped, never raw HTML"
    assert "[2]" in failures and "{&#34;label&#34;: &#34;item-2&#34;}" in failures, "the child's arguments"
    assert batch.task_ids[2] in failures and batch.task_ids[0] not in failures
    assert "not created yet" in text_, "no successor before the last child"
    assert 'class="chart"' in text_ and "3 of the 6 children have started" in text_
    assert "x-fanin-final" not in page.headers

    for i in (3, 4, 5):
        store.finish(batch, i)
    page = client.get(f"/batches/{batch.id}")
    successor = page.text.split('<table class="successor">', 1)[1].split("</table>", 1)[0]
    assert "s-sent" in successor or "s-pending" in successor
    assert "x-fanin-final" not in page.headers, "its successor has not run yet"
    store.run_successor(batch)
    page = client.get(f"/batches/{batch.id}")
    successor = page.text.split('<table class="successor">', 1)[1].split("</table>", 1)[0]
    assert "s-succeeded" in successor and '<td class="num">1</td>' in successor, "state and runs"
    assert page.headers["x-fanin-final"] == "1" and "data-final" in page.text


def test_partial_is_the_live_region_alone(client: TestClient, store: Store) -> None:
    batch = store.batch(2)
    full = client.get(f"/batches/{batch.id}")
    part = client.get(f"/batches/{batch.id}?partial=1")
    assert part.status_code == 200 and "<html" not in part.text and "<h1>Batch" in part.text
    assert 'id="live"' in full.text and 'id="live"' not in part.text
    assert part.headers["cache-control"] == "no-store"
    listed = client.get("/batches?partial=1")
    assert "<form" not in listed.text and batch.id in listed.text, "the filters form stays put while it updates"
    store.finish(batch, 0)
    assert _progress(client.get(f"/batches/{batch.id}?partial=1").text) == (1, 2)


def test_failures_page_on_and_back(client: TestClient, store: Store) -> None:
    from celery_fanin.web.data import FAILURES_SHOWN

    n = FAILURES_SHOWN + 3
    batch = store.batch(n)
    for i in range(n):
        store.finish(batch, i, "failed")
    first = client.get(f"/batches/{batch.id}").text
    table = first.split('<table class="failures">', 1)[1].split("</table>", 1)[0]
    assert table.count("<tr>") == FAILURES_SHOWN + 1  # the header's row too
    assert f"({n})" in first, "the total"
    more = re.search(r'href="([^"]+failures_after=(\d+))"', first)
    assert more and int(more.group(2)) == FAILURES_SHOWN - 1
    second = client.get(html.unescape(more.group(1))).text
    table = second.split('<table class="failures">', 1)[1].split("</table>", 1)[0]
    shown = [int(i) for i in re.findall(r'<td class="num">(\d+)</td>\s*<td>web.child', table)]
    assert shown == list(range(FAILURES_SHOWN, n))
    assert "« first failures" in second and "more failures" not in second


def test_a_trees_leaves_are_listed_and_link_back(client: TestClient, store: Store) -> None:
    tree = store.batch(7, max_width=2)
    for i in range(3):
        store.finish(tree, i)
    page = client.get(f"/batches/{tree.id}").text
    assert _progress(page) == (3, 7), "counts include the leaves still counting"
    leaves = re.findall(r'<a class="mono" href="/batches/([0-9a-f-]+)"', page.split('<table class="leaves">', 1)[1])
    assert len(leaves) >= 3
    leaf_page = client.get(f"/batches/{leaves[0]}").text
    assert "leaf of" in leaf_page and f"/batches/{tree.id}" in leaf_page
    listed = client.get("/batches").text
    assert _listed(listed) == [tree.id], "leaves are part of their root, not rows of their own"


def _saga_done(app: Celery, batch_id: str | None, state: str) -> None:
    """Finish the one child of a saga step's (or a compensation stage's) batch, as a worker would."""
    from sqlalchemy import text as sql

    assert batch_id is not None
    fanin = FanIn.of(app)
    with fanin.engine.connect() as conn:
        task_id, idx = conn.execute(
            sql("SELECT task_id, idx FROM fanin_children WHERE batch_id = :b ORDER BY idx LIMIT 1"), {"b": batch_id}
        ).one()
    from celery_fanin.worker import runtime

    exc = RuntimeError("the carrier is down") if state == "failed" else None
    rec = runtime.current.reporter.record_child(
        fanin, task_id, protocol.Marker(batch_id, idx, None), state, value=1, has_value=state == "succeeded", exc=exc
    )
    assert rec is not None and rec.counted


def _rolled_back_saga(app: Celery) -> Any:
    """reserve (compensated), notify (manual undo), ship (fails): the rollback undoes reserve and asks an
    operator to undo notify."""
    sig = app.signature
    handle = saga(
        compensated(sig("web.child", args=("reserve",)), sig("web.child", args=("unreserve",))),
        manual(sig("web.child", args=("notify",)), "Call the customer: the confirmation was sent in error"),
        sig("web.child", args=("ship",)),
        app=app,
        key=f"order-{uuid.uuid4().hex[:6]}",
    ).apply_async()
    step_done = app.tasks[protocol.SAGA_STEP_DONE_TASK]
    for position in (1, 2):
        _saga_done(app, handle.status().step(position).batch_id, "succeeded")
        step_done({"succeeded": 1, "failed": 0}, handle.saga_id, position)
    _saga_done(app, handle.status().step(3).batch_id, "failed")
    step_done({"succeeded": 0, "failed": 1}, handle.saga_id, 3)
    comp = next(c for c in handle.status().compensations if c.kind != "manual")
    _saga_done(app, comp.batch_id, "succeeded")
    app.tasks[protocol.COMPENSATION_DONE_TASK]({"batch_id": comp.batch_id, "succeeded": 1, "failed": 0})
    return handle


def test_saga_page_lists_steps_compensations_and_what_to_ack(client: TestClient, app: Celery) -> None:
    handle = _rolled_back_saga(app)
    assert handle.status().state == "manual_action_required"
    page = client.get(f"/sagas/{handle.saga_id}")
    assert page.status_code == 200
    body = html.unescape(page.text)
    steps = re.findall(
        r'<tr data-step="(\d)">.*?<td>([\w.]+)</td><td>(\w+)</td><td><span class="badge s-(\w+)"', page.text, re.S
    )
    assert [(p, s) for p, _, _, s in steps] == [("1", "compensated"), ("2", "manual_action_required"), ("3", "failed")]
    assert "RuntimeError: the carrier is down" in body
    callout = body.split('class="callout to-ack"', 1)[1].split("</div>", 1)[0]
    assert "Call the customer: the confirmation was sent in error" in callout
    assert f"celery -A proj fanin saga ack {handle.saga_id} 2 --by YOUR_NAME" in callout
    comps = page.text.split('<table class="compensations">', 1)[1]
    assert comps.index("manual action") < comps.index("web.child"), "in the order they run (stage 0 first)"
    assert "x-fanin-final" not in page.headers

    saga_driver.acknowledge(FanIn.of(app), handle.saga_id, 2, "alice")
    page = client.get(f"/sagas/{handle.saga_id}")
    assert "to-ack" not in page.text and "by alice" in page.text
    assert page.headers["x-fanin-final"] == "1", "compensated: nothing will change"
    step_batch = handle.status().step(1).batch_id
    assert f"/batches/{step_batch}" in page.text
    batch_page = client.get(f"/batches/{step_batch}").text
    assert f"/sagas/{handle.saga_id}" in batch_page, "a step's batch links back to its saga"


def test_sagas_page_filters_by_state_and_pages(app: Celery) -> None:
    done = [_rolled_back_saga(app) for _ in range(3)]
    saga_driver.acknowledge(FanIn.of(app), done[0].saga_id, 2, "bob")
    web = create_app(app, page_size=1)
    try:
        with TestClient(web) as client:
            page = client.get("/sagas?state=manual_action_required").text
            assert re.findall(r'data-saga="([0-9a-f-]+)"', page) == [done[2].saga_id]
            older = _older(page)
            assert older and "state=manual_action_required" in older
            page = client.get(older).text
            assert re.findall(r'data-saga="([0-9a-f-]+)"', page) == [done[1].saga_id]
            assert _older(page) is None
            compensated_ = client.get("/sagas?state=compensated").text
            assert re.findall(r'data-saga="([0-9a-f-]+)"', compensated_) == [done[0].saga_id]
            assert "<strong>1</strong>" in page, "its one manual action waits"
    finally:
        web.state.engine.dispose()


def test_read_only_no_write_route_and_no_write_transaction(client: TestClient, dashboard: Any, store: Store) -> None:
    batch = store.batch(1)
    for method in ("post", "put", "patch", "delete"):
        assert getattr(client, method)("/batches").status_code == 405
        assert getattr(client, method)(f"/batches/{batch.id}").status_code == 405
    with dashboard.state.engine.connect() as conn, pytest.raises(DBAPIError, match="read-only transaction"):
        conn.execute(text("DELETE FROM fanin_batches"))
    assert client.get(f"/batches/{batch.id}").status_code == 200


def test_static_files_and_security_headers(client: TestClient) -> None:
    css = client.get("/static/dashboard.css")
    assert css.status_code == 200 and "svg.bar" in css.text
    js = client.get("/static/live.js")
    assert js.status_code == 200 and "X-Fanin-Final" in js.text
    page = client.get("/batches")
    assert "script-src" not in page.headers["content-security-policy"]  # default-src 'self' covers it
    assert "default-src 'self'" in page.headers["content-security-policy"]
    assert page.headers["x-frame-options"] == "DENY" and page.headers["referrer-policy"] == "no-referrer"
    assert "<script>" not in page.text and " style=" not in page.text, "nothing inline the policy would block"


def test_an_unreachable_database_is_a_503_with_one_line(app: Celery) -> None:
    broken = Celery("broken", set_as_current=False)
    broken.conf.fanin_database_url = "postgresql://nobody:secret-pw@127.0.0.1:1/none"
    web = create_app(broken)
    try:
        with TestClient(web) as client:
            page = client.get("/batches")
            assert page.status_code == 503
            assert "the database could not be read" in page.text and "secret-pw" not in page.text
    finally:
        web.state.engine.dispose()
        FanIn.of(broken).dispose()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"token": "  "}, "token must not be empty"),
        ({"basic_auth": ("user", "")}, "basic_auth must be a (user, password) pair"),
        ({"refresh": 0.01}, "refresh must be at least 0.2"),
        ({"page_size": 0}, "page_size must be at least 1"),
    ],
)
def test_create_app_refuses_bad_options(app: Celery, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        create_app(app, **kwargs)


def test_refresh_comes_from_the_app_conf(app: Celery, store: Store) -> None:
    app.conf.fanin_dashboard_refresh = 7
    try:
        web = create_app(app)
        with TestClient(web) as client:
            assert 'data-interval="7.0"' in client.get("/batches").text
        web.state.engine.dispose()
    finally:
        app.conf.fanin_dashboard_refresh = None


def test_the_urls_own_server_options_are_kept_beside_read_only(app: Celery) -> None:
    custom = Celery("with-options", set_as_current=False)
    custom.conf.fanin_database_url = app.conf.fanin_database_url + "?options=-c%20lock_timeout%3D1234"
    web = create_app(custom, statement_timeout=7)
    try:
        with web.state.engine.connect() as conn:
            shown = [
                conn.execute(text(f"SHOW {name}")).scalar_one()
                for name in ("lock_timeout", "statement_timeout", "transaction_read_only")
            ]
        assert shown == ["1234ms", "7s", "on"]
    finally:
        web.state.engine.dispose()
        FanIn.of(custom).dispose()
