"""The dashboard's JSON API (`/api/batches`, `/api/batches/<id>`) and its lookup by id (`/lookup?id=`), against the
real test database (issue 40, item 6): what they answer, and what they refuse."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from sqlalchemy import text
from starlette.testclient import TestClient

from celery_fanin import FanIn
from celery_fanin.store.urls import libpq_conninfo

from .conftest import Store, fanin_status

pytestmark = pytest.mark.timeout(60)


def test_the_batches_api_lists_what_the_page_lists_with_its_filters_and_cursor(
    client: TestClient, store: Store
) -> None:
    first, second, third = (store.batch(2, step=f"api-{i}") for i in range(3))
    store.finish(first, 0, "failed")
    listed = client.get("/api/batches", params={"limit": 2})
    assert listed.status_code == 200 and listed.headers["content-type"] == "application/json"
    body = listed.json()
    assert [b["id"] for b in body["batches"]] == [third.id, second.id]  # newest first
    assert body["batches"][0]["step"] == "api-2" and body["batches"][0]["planned"] == 2
    assert body["next"] is not None and body["active"]["running"] >= 3
    rest = client.get("/api/batches", params={"limit": 2, "before": body["next"]}).json()
    assert first.id in [b["id"] for b in rest["batches"]]
    [only] = client.get("/api/batches", params={"step": "api-0"}).json()["batches"]
    assert (only["id"], only["failed"], only["successor_state"]) == (first.id, 1, None)


def test_the_batch_api_gives_counts_failures_and_the_successor(client: TestClient, store: Store) -> None:
    batch = store.batch(3, step="api-one", key="api-key")
    store.finish(batch, 0)
    store.finish(batch, 1, "failed", "no <disk>")
    store.finish(batch, 2)
    store.run_successor(batch)
    body = client.get(f"/api/batches/{batch.id}").json()
    assert (body["batch"]["id"], body["batch"]["key"], body["batch"]["state"]) == (batch.id, "api-key", "complete")
    assert body["counts"]["succeeded"] == 2 and body["counts"]["failed"] == 1 and body["remaining"] == 0
    [failure] = body["failures"]
    assert (failure["index"], failure["state"], failure["worker"]) == (1, "failed", "web@test")
    assert (failure["exc_type"], failure["exc_message"]) == ("ValueError", "no <disk>"), "JSON: nothing escaped"
    assert failure["args"] == [1] and failure["kwargs"] == {"label": "item-1"}  # as the outcome lists it
    successor = body["successor"]
    assert (successor["state"], successor["task_id"]) == ("succeeded", fanin_status(batch).successor_task_id)
    assert body["final"] is True and body["failures_total"] == 1


@pytest.mark.parametrize(
    ("path", "status", "message"),
    [
        ("/api/batches/not-a-uuid", 400, "is not a batch id"),
        ("/api/batches/00000000-0000-0000-0000-000000000000", 404, "no fan-in batch"),
        ("/api/batches?before=nonsense", 400, "is not a page cursor"),
        ("/api/batches?limit=0", 400, "limit must be at least 1"),
        ("/api/batches?limit=ten", 400, "is not a whole number"),
    ],
)
def test_api_errors_are_json_that_says_why(client: TestClient, path: str, status: int, message: str) -> None:
    answer = client.get(path)
    assert answer.status_code == status and message in answer.json()["error"]


def test_lookup_finds_the_batch_of_a_child_a_successor_or_a_batch_id(client: TestClient, store: Store) -> None:
    batch = store.batch(2)
    successor_task_id = fanin_status(batch).successor_task_id
    for value in (batch.task_ids[1], successor_task_id, batch.id, f"  {batch.task_ids[0]} "):
        found = client.get("/lookup", params={"id": value}, follow_redirects=False)
        assert (found.status_code, found.headers["location"]) == (303, f"/batches/{batch.id}"), value
    assert client.get("/lookup", params={"id": batch.task_ids[0]}).url.path == f"/batches/{batch.id}"
    missing = client.get("/lookup", params={"id": "no-such-task"})
    assert missing.status_code == 404 and "no batch, child or successor with id no-such-task" in missing.text
    assert client.get("/lookup").status_code == 400
    assert 'action="/lookup"' in client.get("/batches").text, "every page has the lookup form"
    assert client.post("/lookup", data={"id": batch.id}).status_code == 405


def test_the_relay_panel_shows_connected_relays_the_backlog_and_the_oldest_unsent(
    client: TestClient, store: Store, app: Any
) -> None:
    """Issue 40, item 6: the dashboard no longer looks healthy while the relay is down."""
    batch = store.batch(1, step="relay-panel")
    store.finish(batch, 0)
    with FanIn.of(app).engine.begin() as conn:  # its successor not sent for 5 minutes, the broker refusing it
        conn.execute(
            text(
                "UPDATE fanin_outbox SET sent_at = NULL, attempts = 2, last_error = 'broker refused',"
                " created_at = now() - interval '5 minutes', available_at = now() - interval '1 second'"
                " WHERE batch_id = :b"
            ),
            {"b": batch.id},
        )
    down = client.get("/api/relay").json()
    assert down["relays"] == [] and down["unsent"] >= 1 and down["due"] >= 1 and down["failing"] >= 1
    assert down["oldest_unsent"]["batch_id"] == batch.id and down["oldest_unsent_seconds"] >= 299
    assert any("no relay is connected" in w for w in down["warnings"])
    assert any("failed to publish" in w for w in down["warnings"])
    page = client.get("/batches").text
    assert '<section class="relay warn"' in page and "none connected" in page and "broker refused" in page
    # A relay connects (its LISTEN connection is named so): the panel sees it.
    url = libpq_conninfo(FanIn.of(app).database_url)
    with psycopg.connect(url, application_name="celery-fanin relay web-test:1"):
        up = client.get("/api/relay").json()
        assert up["relays"] == ["celery-fanin relay web-test:1"]
        assert not any("no relay" in w for w in up["warnings"])
        assert "web-test:1" in client.get("/batches").text
