"""The dashboard's actions (`--allow-actions`, issue 40, item 6): retry failed, cancel, seal and rerun from a
batch's page, each a CSRF-protected POST, recorded with who and when, and none of it without the flag. Against the
real test database and broker; the browser's side is in tests/e2e/test_dashboard_browser.py."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from starlette.testclient import TestClient

from celery_fanin import FanIn, protocol
from celery_fanin.web import create_app
from celery_fanin.worker import runtime, successor_runs

from .conftest import Store, fanin_status

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def acting(app: Celery) -> Iterator[TestClient]:
    web = create_app(app, page_size=50, allow_actions=True)
    try:
        with TestClient(web, base_url="http://dash.test") as client:
            yield client
    finally:
        web.state.engine.dispose()


def _form(client: TestClient, batch_id: str) -> tuple[list[str], str]:
    page = client.get(f"/batches/{batch_id}").text
    buttons = re.findall(r'<button type="submit" name="action" value="([a-z-]+)"', page)
    found = re.search(r'name="csrf" value="([0-9a-f]+)"', page)
    return buttons, found.group(1) if found else ""


def _log(client: TestClient, batch_id: str) -> list[tuple[str, str, str]]:
    body = client.get(f"/api/batches/{batch_id}").json()
    return [(r["action"], r["outcome"], r["actor"]) for r in body["operator_actions"]]


def _fail_successor(store: Store, batch: Any) -> None:
    fanin = FanIn.of(batch.app)
    status = fanin_status(batch)
    live = successor_runs.admit(fanin, batch.id, status.step, status.successor_task_id, 0)
    assert live is not None
    marker = protocol.Marker(batch.id, None, status.step)
    assert runtime.current.reporter.record_successor(fanin, marker, "failed", exc=RuntimeError("a bug"), live=live)


def test_cancel_is_a_csrf_checked_post_recorded_with_who_and_when(acting: TestClient, store: Store) -> None:
    batch = store.batch(2, step="act-cancel")
    buttons, csrf = _form(acting, batch.id)
    assert buttons == ["cancel"] and csrf
    url = f"/batches/{batch.id}/actions"
    no_token = acting.post(url, data={"action": "cancel"}, follow_redirects=False)
    assert no_token.status_code == 403 and "reload the page" in no_token.text
    wrong = acting.post(url, data={"action": "cancel", "csrf": "0" * 64}, follow_redirects=False)
    assert wrong.status_code == 403
    elsewhere = acting.post(
        url, data={"action": "cancel", "csrf": csrf}, headers={"origin": "https://evil.test"}, follow_redirects=False
    )
    assert elsewhere.status_code == 403 and "another origin" in elsewhere.text
    unknown = acting.post(url, data={"action": "drop-table", "csrf": csrf}, follow_redirects=False)
    assert unknown.status_code == 400
    assert fanin_status(batch).state == "running" and _log(acting, batch.id) == [], "nothing done, nothing recorded"

    done = acting.post(url, data={"action": "cancel", "csrf": csrf}, follow_redirects=False)
    assert done.status_code == 303 and done.headers["location"].endswith(f"/batches/{batch.id}")
    assert fanin_status(batch).state == "cancelled"
    assert _log(acting, batch.id) == [("cancel", "done", "anonymous (testclient)")]
    # The same form again: the batch has ended, so it is refused, and that is recorded too.
    again = acting.post(url, data={"action": "cancel", "csrf": csrf}, follow_redirects=False)
    assert again.status_code == 303
    assert [(a, o) for a, o, _ in _log(acting, batch.id)] == [("cancel", "refused"), ("cancel", "done")]
    page = acting.get(f"/batches/{batch.id}").text
    assert '<table class="actions-log">' in page and "nothing to cancel" in page and "abandoned and revoked" in page


def test_rerun_and_retry_failed_from_the_page(acting: TestClient, store: Store) -> None:
    batch = store.batch(2, step="act-rerun")
    store.finish(batch, 0)
    store.finish(batch, 1, "failed")
    _fail_successor(store, batch)
    buttons, csrf = _form(acting, batch.id)
    assert buttons == ["retry-failed", "rerun"]
    url = f"/batches/{batch.id}/actions"
    assert acting.post(url, data={"action": "rerun", "csrf": csrf}, follow_redirects=False).status_code == 303
    status = fanin_status(batch)
    assert status.successor_state == "pending", "back in line under a new task id"
    body = acting.get(f"/api/batches/{batch.id}").json()
    assert [r["requested_by"] for r in body["reruns"]] == ["anonymous (testclient)"]
    assert acting.post(url, data={"action": "retry-failed", "csrf": csrf}, follow_redirects=False).status_code == 303
    log = _log(acting, batch.id)
    assert [(a, o) for a, o, _ in log] == [("retry-failed", "refused"), ("rerun", "done")], log
    # (refused: its successor runs again now; retry-failed waits for it to finish)


def test_without_allow_actions_there_are_no_buttons_and_no_post(client: TestClient, store: Store) -> None:
    batch = store.batch(1, step="act-none")
    page = client.get(f"/batches/{batch.id}").text
    assert 'class="actions"' not in page and "csrf" not in page
    assert client.post(f"/batches/{batch.id}/actions", data={"action": "cancel"}).status_code == 404
    assert fanin_status(batch).state == "running"


def test_the_record_names_who_signed_in_never_who_a_client_says_it_is(app: Celery, store: Store) -> None:
    import base64

    def basic(user: str, password: str) -> dict[str, str]:
        return {"authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}

    for options, headers, who in (
        ({"basic_auth": ("ops", "s3cret")}, basic("ops", "s3cret"), "ops (testclient)"),
        ({"token": "t0ken"}, basic("alice", "t0ken"), "token (testclient)"),  # any user name: the token is the key
    ):
        web = create_app(app, allow_actions=True, **options)  # type: ignore[arg-type]
        try:
            with TestClient(web, base_url="http://dash.test", headers=headers) as client:
                batch = store.batch(1, step="act-who")
                _, csrf = _form(client, batch.id)
                sent = client.post(
                    f"/batches/{batch.id}/actions", data={"action": "cancel", "csrf": csrf}, follow_redirects=False
                )
                assert sent.status_code == 303
                assert _log(client, batch.id) == [("cancel", "done", who)]
        finally:
            web.state.engine.dispose()
    # No auth at all: a client's own claim is not taken.
    web = create_app(app, allow_actions=True)
    try:
        with TestClient(web, base_url="http://dash.test", headers=basic("mallory", "x")) as client:
            batch = store.batch(1, step="act-who")
            _, csrf = _form(client, batch.id)
            client.post(f"/batches/{batch.id}/actions", data={"action": "cancel", "csrf": csrf})
            assert _log(client, batch.id) == [("cancel", "done", "anonymous (testclient)")]
    finally:
        web.state.engine.dispose()
