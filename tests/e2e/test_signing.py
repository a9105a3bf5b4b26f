"""Celery message signing (`task_serializer = "auth"`) with fan-in: children (plain and chains) published on the
producer's fast path, signed; a real worker that accepts only signed messages runs and counts them; the relay
publishes the successor, signed, from its stored signature; the successor runs once with every value. An unsigned
message carrying a pending child's headers is refused by the worker and moves nothing.

Signing covers the body, not the headers: a captured signed body published again under another child's or
successor's headers (task id, batch, index) is refused by the fan-in claim in the body, and a replayed successor
message by the run guard."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psycopg
import pytest
import redis
from celery import Celery, chain
from click.testing import CliRunner
from kombu.serialization import registry

from celery_fanin import FanIn, fan_in_group, protocol
from celery_fanin.cli import fanin as fanin_cli
from tests.e2e.brokers import on_broker
from tests.e2e.helpers import sig
from tests.signing import configure_signing, make_certificate
from tests.sql import children as child_rows
from tests.sql import unpublish
from tests.workers import wait_for

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def signing_dir(tmp_path: Path) -> Path:
    return make_certificate(tmp_path / "signing")


@pytest.fixture
def kombu_registry() -> Iterator[None]:
    """Signing changes kombu's serializer registry (process-wide): put it back afterwards."""
    saved = (registry._default_content_type, registry._default_content_encoding, set(registry._disabled_content_types))
    yield
    registry._default_content_type, registry._default_content_encoding = saved[0], saved[1]
    registry._disabled_content_types.clear()
    registry._disabled_content_types.update(saved[2])


@pytest.fixture
def signed_app(app: Celery, signing_dir: Path, kombu_registry: None) -> Celery:
    """The producer app, signing."""
    configure_signing(app, signing_dir)
    return app


def test_signed_children_successor_and_relay(
    signed_app: Celery, signing_dir: Path, e2e_env: dict[str, str], processes: Any, successor_runs: Any
) -> None:
    env = {**e2e_env, "FANIN_TEST_SIGNING_DIR": str(signing_dir)}
    app = signed_app
    children = [sig(app, "ok", 1), chain(sig(app, "ok", 2), sig(app, "ok")), sig(app, "fail", 3)]
    handle = fan_in_group(children, then=sig(app, "record_run", "signed", with_values=True), app=app).apply_async()
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
    status = handle.wait_batch(timeout=60)
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


def test_signed_replacements_whose_task_before_the_carrier_fails(
    signed_app: Celery, signing_dir: Path, e2e_env: dict[str, str], processes: Any
) -> None:
    """The headers a replacement's other tasks get (a child's chain marker, a successor's part) are bound into
    their signed bodies too: a signing worker takes them, and their failure ends the child and the successor."""
    env = {**e2e_env, "FANIN_TEST_SIGNING_DIR": str(signing_dir)}
    app = signed_app
    then = chain(sig(app, "values"), app.signature("tests.app.fail", args=(7,), immutable=True), sig(app, "identity"))
    handle = fan_in_group([sig(app, "ok", 1), sig(app, "replacing_child_failing", 2)], then=then, app=app)
    handle = handle.apply_async()
    processes.worker(env)
    processes.relay(env)
    status = handle.wait_batch(timeout=60)
    assert (status.successor_state, status.succeeded, status.failed, status.refused_reports) == ("failed", 1, 1, 0)
    with psycopg.connect(e2e_env["FANIN_DATABASE_URL"]) as conn:
        [(state, exc)] = conn.execute(
            "SELECT state, exc_message FROM fanin_successors WHERE batch_id = %s", (uuid.UUID(handle.batch_id),)
        ).fetchall()
    assert (state, exc) == ("failed", "child 7 failed on purpose")


@pytest.mark.parametrize("broker", ["redis", "rabbitmq"])
def test_signed_on_both_brokers_with_retries_and_children_the_relay_republishes(
    broker: str,
    signing_dir: Path,
    kombu_registry: None,
    e2e_env: dict[str, str],
    processes: Any,
    successor_runs: Any,
) -> None:
    """The fast path on each broker (RabbitMQ: the frames written by `broker.amqp_frames`), a child retried until
    it fails (each retry is a message Celery publishes from the worker), a chain, and a batch whose producer died
    before publishing: its children are published by the relay from their stored signatures. All signed, all run
    by a worker that accepts only signed messages, none refused."""
    with on_broker(e2e_env, broker) as env:
        queue = env["FANIN_TEST_QUEUE"]
        app = Celery(f"signed-{uuid.uuid4().hex[:6]}", broker=env["FANIN_TEST_BROKER"], set_as_current=False)
        app.conf.update(fanin_database_url=env["FANIN_DATABASE_URL"], task_default_queue=queue)
        configure_signing(app, signing_dir)
        FanIn(app)
        env = {**env, "FANIN_TEST_SIGNING_DIR": str(signing_dir)}
        try:
            orphan = fan_in_group(
                [sig(app, "ok", 4), sig(app, "ok", 5)],
                then=sig(app, "record_run", "orphan", with_values=True),
                app=app,
            ).apply_async()
            # Its producer "died" before publishing: its messages taken off the broker, the batch marked unpublished.
            if broker == "rabbitmq":
                with app.connection_for_write() as conn:
                    assert conn.default_channel.queue_purge(queue) == 2
            else:
                assert redis.Redis.from_url(env["FANIN_TEST_BROKER"]).delete(queue) == 1
            unpublish(env, orphan.batch_id)
            children = [sig(app, "ok", 1), sig(app, "always_retry", 2), chain(sig(app, "ok", 3), sig(app, "ok"))]
            handle = fan_in_group(
                children, then=sig(app, "record_run", "signed", with_values=True), app=app
            ).apply_async()
            worker = processes.worker(env)
            processes.relay(env)
            status = handle.wait_batch(timeout=90)
            assert (status.succeeded, status.failed, status.refused_reports, status.successor_state) == (
                2,
                1,
                0,
                "succeeded",
            )
            assert [r["values"] for r in successor_runs(handle.batch_id)] == [[10, 300]]
            status = orphan.wait_batch(timeout=60)
            assert (status.published, status.succeeded, status.refused_reports) == (2, 2, 0)
            assert [r["values"] for r in successor_runs(orphan.batch_id)] == [[40, 50]]
            assert "report refused" not in worker.output() and "not counted" not in worker.output()
        finally:
            FanIn.of(app).dispose()


def _take_queue(client: redis.Redis) -> list[bytes]:
    """Everything on the `celery` queue, taken off it (put back later with `lpush`)."""
    raw: list[bytes] = client.lrange("celery", 0, -1)  # type: ignore[assignment]
    client.delete("celery")
    return raw


def _reheaded(message: dict[str, Any], **headers: Any) -> str:
    """`message` (a Redis transport message: signed body, headers, properties) under other headers: what a publisher
    without the key can make of a signed message it captured."""
    forged = json.loads(json.dumps(message))
    forged["headers"].update(headers)
    if "id" in headers:
        forged["properties"]["correlation_id"] = headers["id"]
    forged["properties"]["delivery_tag"] = str(uuid.uuid4())
    return json.dumps(forged)


def _rows(env: dict[str, str], batch_id: str) -> list[tuple[Any, ...]]:
    return [tuple(r.values()) for r in child_rows(env, batch_id, "idx", "state", "starts", "late_reports")]


def test_a_signed_body_under_another_childs_headers_is_refused_and_counted(
    signed_app: Celery, signing_dir: Path, e2e_env: dict[str, str], processes: Any, successor_runs: Any
) -> None:
    app = signed_app
    env = {**e2e_env, "FANIN_TEST_SIGNING_DIR": str(signing_dir)}
    handle = fan_in_group(
        [sig(app, "ok", i) for i in (1, 2, 3)], then=sig(app, "record_run", "signed", with_values=True), app=app
    ).apply_async()
    app.send_task("tests.app.ok", args=(7,))  # a signed message of no batch
    client = redis.Redis.from_url(e2e_env["FANIN_TEST_BROKER"])
    genuine = _take_queue(client)
    messages = [json.loads(m) for m in genuine]
    child = {m["headers"]["fanin_index"]: m for m in messages if protocol.HEADER_BATCH in m["headers"]}
    loose = next(m for m in messages if protocol.HEADER_BATCH not in m["headers"])
    as_1 = {"id": child[1]["headers"]["id"], protocol.HEADER_INDEX: 1}
    as_2 = {"id": child[2]["headers"]["id"], protocol.HEADER_BATCH: handle.batch_id, protocol.HEADER_INDEX: 2}
    forgeries = [
        # Child 0's signed body (ok(1)) under child 1's task id and index: its claim names child 0.
        _reheaded(child[0], **as_1),
        # A signed body of no batch (ok(7)) under child 2's headers: it carries no claim at all...
        _reheaded(loose, **as_2),
        # ... nor does a claim put in a header count (the worker takes the claim from the body alone).
        _reheaded(loose, **as_2, **{protocol.BODY_CLAIM: protocol.claim({**loose["headers"], **as_2})}),
        # Child 0's own message, expired: the worker would revoke it and count the child revoked.
        _reheaded(child[0], expires="2000-01-01T00:00:00+00:00"),
    ]
    client.rpush("celery", *forgeries)
    worker = processes.worker(env)
    wait_for(lambda: handle.batch_status().refused_reports == 4, timeout=60, message="four refused reports")
    # Refused before they ran: no child started or finished, nothing was counted late.
    assert [
        tuple(r.values()) for r in child_rows(e2e_env, handle.batch_id, "idx", "state", "starts", "late_reports")
    ] == [(0, "pending", 0, 0), (1, "pending", 0, 0), (2, "pending", 0, 0)]
    assert worker.output().count("report refused") == 4, worker.output()
    shown = CliRunner().invoke(fanin_cli, ["status", handle.batch_id], obj=SimpleNamespace(app=app))
    assert shown.exit_code == 0 and "refused reports" in shown.output and " 4" in shown.output, shown.output
    # The genuine messages count each child with its own value.
    client.lpush("celery", *genuine)
    processes.relay(env)
    status = handle.wait_batch(timeout=60)
    assert (status.succeeded, status.failed, status.refused_reports, status.successor_state) == (3, 0, 4, "succeeded")
    assert [r["values"] for r in successor_runs(handle.batch_id)] == [[10, 20, 30]]
    assert [
        row[1]
        for row in [
            tuple(r.values()) for r in child_rows(e2e_env, handle.batch_id, "idx", "state", "starts", "late_reports")
        ]
    ] == ["succeeded"] * 3


def _successor_state(e2e_env: dict[str, str], batch_id: str) -> tuple[Any, ...] | None:
    with psycopg.connect(e2e_env["FANIN_DATABASE_URL"]) as conn:
        return conn.execute(
            "SELECT state, runs, duplicates, task_id FROM fanin_successors WHERE batch_id = %s", (uuid.UUID(batch_id),)
        ).fetchone()


def test_a_signed_successor_replayed_or_reheaded_is_refused(
    signed_app: Celery, signing_dir: Path, e2e_env: dict[str, str], processes: Any, successor_runs: Any
) -> None:
    """Two batches whose successors are waiting on the broker (empty groups: sent at once). B1's signed successor
    message under B2's successor headers (its batch and pre-assigned task id, which the run guard admits) is refused
    by the claim; B1's message delivered again after B1's successor ran is refused by the run guard."""
    app = signed_app
    env = {**e2e_env, "FANIN_TEST_SIGNING_DIR": str(signing_dir)}
    b1 = fan_in_group([], then=sig(app, "record_run", "b1"), app=app).apply_async()
    b2 = fan_in_group([], then=sig(app, "record_run", "b2"), app=app).apply_async()
    client = redis.Redis.from_url(e2e_env["FANIN_TEST_BROKER"])
    genuine = _take_queue(client)
    by_batch = {json.loads(m)["headers"][protocol.HEADER_SUCCESSOR]: m for m in genuine}
    assert set(by_batch) == {b1.batch_id, b2.batch_id}
    b2_state = _successor_state(e2e_env, b2.batch_id)
    assert b2_state is not None
    first = json.loads(by_batch[b1.batch_id])
    client.rpush("celery", _reheaded(first, id=b2_state[3], **{protocol.HEADER_SUCCESSOR: b2.batch_id}))
    worker = processes.worker(env)
    wait_for(lambda: (_successor_state(e2e_env, b2.batch_id) or ())[2] == 1, timeout=60, message="B2 refused once")
    assert "report refused" in worker.output()
    assert successor_runs(b1.batch_id) == [] and successor_runs(b2.batch_id) == []
    client.lpush("celery", *genuine)
    assert b1.wait_batch(timeout=60).successor_state == "succeeded"
    assert b2.wait_batch(timeout=60).successor_state == "succeeded"
    # The same signed message again (a broker redelivery, or a publisher replaying what it captured).
    client.rpush("celery", _reheaded(first))
    wait_for(lambda: (_successor_state(e2e_env, b1.batch_id) or ())[2] == 1, timeout=60, message="B1 replay refused")
    assert [r["label"] for r in successor_runs(b1.batch_id)] == ["b1"]
    assert [r["label"] for r in successor_runs(b2.batch_id)] == ["b2"]
    assert [_successor_state(e2e_env, b.batch_id)[:3] for b in (b1, b2)] == [("succeeded", 1, 1)] * 2  # type: ignore[index]
