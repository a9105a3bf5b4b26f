"""Celery message signing (`task_serializer = "auth"`) with fan-in: children (plain and chains) published on the
producer's fast path, signed; a real worker that accepts only signed messages runs and counts them; the relay
publishes the successor, signed, from its stored signature; the successor runs once with every value. An unsigned
message carrying a pending child's headers is refused by the worker and moves nothing."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import redis
from celery import Celery, chain
from kombu.serialization import registry

from celery_fanin import fan_in_group
from tests.signing import configure_signing, make_certificate

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def signing_dir(tmp_path: Path) -> Path:
    return make_certificate(tmp_path / "signing")


@pytest.fixture
def signed_app(app: Celery, signing_dir: Path) -> Iterator[Celery]:
    """The producer app, signing; kombu's registry (process-wide) is put back afterwards."""
    saved = (registry._default_content_type, registry._default_content_encoding, set(registry._disabled_content_types))
    configure_signing(app, signing_dir)
    yield app
    registry._default_content_type, registry._default_content_encoding = saved[0], saved[1]
    registry._disabled_content_types.clear()
    registry._disabled_content_types.update(saved[2])


def _sig(app: Celery, name: str, *args: Any, **kwargs: Any) -> Any:
    return app.signature(f"tests.app.{name}", args=args, kwargs=kwargs)


def test_signed_children_successor_and_relay(
    signed_app: Celery, signing_dir: Path, e2e_env: dict[str, str], processes: Any, successor_runs: Any
) -> None:
    env = {**e2e_env, "FANIN_TEST_SIGNING_DIR": str(signing_dir)}
    app = signed_app
    children = [_sig(app, "ok", 1), chain(_sig(app, "ok", 2), _sig(app, "ok")), _sig(app, "fail", 3)]
    handle = fan_in_group(children, then=_sig(app, "record_run", "signed", with_values=True), app=app).apply_async()
    # What the producer's fast path put on the broker is signed.
    client = redis.Redis.from_url(e2e_env["FANIN_TEST_BROKER"])
    queued = [json.loads(m) for m in client.lrange("celery", 0, -1)]
    assert len(queued) == 3 and {m["content-type"] for m in queued} == {"application/data"}
    # A forger who can publish but cannot sign: an unsigned copy of child 0's message with its headers, ahead of
    # it, and one that names a task no worker knows. The worker refuses both; neither ends the child.
    forged = {**queued[0], "body": queued[2]["body"]}
    forged["content-type"], forged["headers"] = "application/json", {**queued[0]["headers"]}
    unknown = {**forged, "headers": {**forged["headers"], "task": "tests.app.nobody"}}
    client.rpush("celery", json.dumps(forged), json.dumps(unknown))
    processes.worker(env)
    processes.relay(env)
    status = handle.wait(timeout=60)
    assert status.successor_state == "succeeded", status
    assert (status.planned, status.succeeded, status.failed, status.refused_reports) == (3, 2, 1, 0)
    runs = successor_runs(handle.batch_id)
    assert len(runs) == 1 and runs[0]["values"] == [10, 200], runs
    with psycopg.connect(e2e_env["FANIN_DATABASE_URL"]) as conn:
        rows = conn.execute(
            "SELECT idx, state, late_reports FROM fanin_children WHERE batch_id = %s ORDER BY idx",
            (uuid.UUID(handle.batch_id),),
        ).fetchall()
    assert rows == [(0, "succeeded", 0), (1, "succeeded", 0), (2, "failed", 0)]
