"""Database and broker outages, in process: reports wait for the store (bounded by `fanin_report_timeout`), and
every long-lived connection (the engine's pool, the report connection, the relay's LISTEN connection, a pooled
broker connection) recovers by itself once the service is back.

A cut is made by a proxy the test owns (tests.faults) or, for PostgreSQL, by terminating every backend of the
session's own database: what a server restart looks like to its clients. No service is restarted.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import kombu
import psycopg
import pytest
from celery import Celery
from sqlalchemy import Engine, text

from celery_fanin import FanIn, fan_in_group, protocol, retry
from celery_fanin.relay import Relay
from celery_fanin.store import reports as store_reports
from celery_fanin.store.reports import record_terminal
from celery_fanin.worker import hooks, report, runtime, successor_runs
from tests.faults import TcpProxy, proxy_for, release_producer_app
from tests.sql import Held
from tests.sql import children as child_rows
from tests.store.helpers import create
from tests.workers import wait_for

pytestmark = pytest.mark.timeout(120)

AMQP_URL = "amqp://guest:guest@127.0.0.1:5672//"


@pytest.fixture
def pg_proxy(clean_db: str) -> Iterator[TcpProxy]:
    with proxy_for(clean_db, 5432) as proxy:
        yield proxy


@pytest.fixture
def proxied_app(app: Celery, pg_proxy: TcpProxy) -> Celery:
    """The `app` fixture's app, its store reached through the proxy."""
    app.conf.fanin_database_url = pg_proxy.url(app.conf.fanin_database_url)
    FanIn.of(app).dispose()
    return app


class RetryClock:
    """The retry policy's clock and sleep (`retry.call`'s `clock` and `sleep`), its jitter at its longest: the
    waits a report makes are counted in the policy's own time, not timed on a shared machine whose load changes
    how long each attempt takes but not how many the policy makes."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


@pytest.fixture
def retry_clock(monkeypatch: pytest.MonkeyPatch) -> RetryClock:
    fake = RetryClock()
    real = retry.call

    def call(fn: Callable[[], Any], **kwargs: Any) -> Any:
        return real(fn, **{**kwargs, "sleep": fake.sleep, "clock": fake.clock, "rng": lambda: 1.0})

    monkeypatch.setattr(retry, "call", call)
    return fake


@pytest.fixture
def report_attempts(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The thread of each attempt at a child's report (a call of `store.reports.record_terminal`), in order."""
    threads: list[str] = []
    real = store_reports.record_terminal

    def counted(*args: Any, **kwargs: Any) -> Any:
        threads.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(store_reports, "record_terminal", counted)
    return threads


def _report(app: Celery, task_id: str, batch_id: uuid.UUID, index: int) -> Any:
    marker = protocol.Marker(str(batch_id), index, None)
    return runtime.current.reporter.record_child(
        FanIn.of(app), task_id, marker, "succeeded", value=index, has_value=True
    )


def _given_up(kind: str) -> float:
    return report.REPORTS_GIVEN_UP.labels(kind=kind)._value.get()


def test_reports_wait_out_a_database_cut(proxied_app: Celery, pg_proxy: TcpProxy, direct: Engine) -> None:
    batch, children, _ = create(direct, 3)
    assert _report(proxied_app, children[0].task_id, batch.id, 0).counted  # the report connection is open
    given_up = _given_up("terminal")
    pg_proxy.cut()
    restore = threading.Timer(4.0, pg_proxy.restore)
    restore.start()
    started = time.monotonic()
    try:
        # Both reports are sent while the store is unreachable (a broken connection, then refused connections).
        for i in (1, 2):
            rec = _report(proxied_app, children[i].task_id, batch.id, i)
            assert rec is not None and rec.counted
    finally:
        restore.cancel()
        pg_proxy.restore()
    assert time.monotonic() - started >= 3.5  # it did wait for the store
    assert pg_proxy.refused > 0
    assert [r["state"] for r in child_rows(direct, batch.id, "state")] == ["succeeded"] * 3
    assert _given_up("terminal") == given_up


def test_a_report_is_given_up_after_report_timeout(
    proxied_app: Celery,
    pg_proxy: TcpProxy,
    direct: Engine,
    caplog: pytest.LogCaptureFixture,
    retry_clock: RetryClock,
    report_attempts: list[str],
) -> None:
    proxied_app.conf.fanin_report_timeout = 1.5
    batch, children, _ = create(direct, 1)
    given_up = _given_up("terminal")
    pg_proxy.cut()
    with caplog.at_level(logging.ERROR, logger="celery_fanin.hooks"):
        assert _report(proxied_app, children[0].task_id, batch.id, 0) is None
    # Retried with the backoff (0.2 s, doubling) until the timeout and not after it: attempts at 0, 0.2, 0.6 and
    # 1.4 s, and one at 1.5 s, the last wait shortened to end on the timeout. Each met the cut.
    assert len(report_attempts) == 5
    assert retry_clock.sleeps == pytest.approx([0.2, 0.4, 0.8, 0.1])
    assert pg_proxy.refused >= 5
    assert _given_up("terminal") == given_up + 1
    assert any("gave up recording terminal outcome" in r.getMessage() for r in caplog.records)
    pg_proxy.restore()
    # Nothing was recorded: the child stays open for child_timeout and reconciliation to settle.
    assert [r["state"] for r in child_rows(direct, batch.id, "state")] == ["pending"]


def test_a_successor_state_given_up_by_its_pool_process_is_counted(
    proxied_app: Celery, pg_proxy: TcpProxy, direct: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    """The pool process that ran a successor records its final state itself (`successor_runs.finish`); given up
    after `fanin_report_timeout`, it is counted as a successor report given up, as the main process's are."""
    batch, children, _ = create(direct, 1)
    with direct.begin() as conn:
        assert record_terminal(Held(conn), children[0].task_id, "succeeded").counted  # creates the successor
    with direct.connect() as conn:
        task_id = conn.execute(
            text("SELECT task_id FROM fanin_successors WHERE batch_id = :b"), {"b": batch.id}
        ).scalar_one()
    live = successor_runs.admit(FanIn.of(proxied_app), str(batch.id), batch.step, task_id, 0)
    assert live is not None
    proxied_app.conf.fanin_report_timeout = 1.5
    given_up = _given_up("successor")
    pg_proxy.cut()
    with caplog.at_level(logging.ERROR, logger="celery_fanin.successors"):
        assert successor_runs.finish(live, "succeeded") is False
    pg_proxy.restore()
    assert _given_up("successor") == given_up + 1
    assert any("gave up recording successor" in r.getMessage() for r in caplog.records)


def test_a_permanent_error_is_not_retried(
    app: Celery,
    clean_db: str,
    direct: Engine,
    caplog: pytest.LogCaptureFixture,
    retry_clock: RetryClock,
    report_attempts: list[str],
) -> None:
    """A report that cannot succeed however long it waits (here: a database that does not exist, a configuration
    error) fails at once, is logged and counted, and is not retried for `fanin_report_timeout`."""
    batch, children, _ = create(direct, 1)
    app.conf.fanin_database_url = clean_db.rsplit("/", 1)[0] + "/fanin_no_such_database"
    FanIn.of(app).dispose()
    given_up = _given_up("terminal")
    with caplog.at_level(logging.ERROR, logger="celery_fanin.hooks"):
        assert _report(app, children[0].task_id, batch.id, 0) is None
    assert (len(report_attempts), retry_clock.sleeps) == (1, [])  # one attempt, no wait
    assert any("not a transient error" in r.getMessage() for r in caplog.records)
    assert _given_up("terminal") == given_up + 1
    assert [r["state"] for r in child_rows(direct, batch.id, "state")] == ["pending"]


def _terminate_backends(url: str) -> int:
    """Every other session of the test database ends, as a PostgreSQL restart ends them for its clients."""
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        ).fetchall()
    return len(rows)


def test_pooled_connections_recover_after_the_server_ends_them(
    app: Celery, clean_db: str, direct: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    """The client side of a PostgreSQL restart: the engine's pooled connections and the report connection are
    dead. The next producer call and the next reports work without an error reaching the caller."""
    app.conf.fanin_report_timeout = 30
    app.task(name="t.ok", shared=False)(_ok)
    app.task(name="t.then", shared=False)(_ok)
    fanin = FanIn.of(app)
    first = fan_in_group([app.signature("t.ok", args=(1,))], then=app.signature("t.then"), app=app).apply_async()
    batch, children, _ = create(direct, 2)
    assert _report(app, children[0].task_id, batch.id, 0).counted
    with fanin.engine.connect() as conn:  # the pool holds a connection now
        conn.execute(text("SELECT 1"))
    assert _terminate_backends(clean_db) >= 2
    with caplog.at_level(logging.WARNING):
        second = fan_in_group([app.signature("t.ok", args=(2,))], then=app.signature("t.then"), app=app).apply_async()
        assert _report(app, children[1].task_id, batch.id, 1).counted
    assert second.batch_status().published == 1 and first.batch_status().published == 1
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


def _ok(*args: Any) -> Any:
    return args


def test_relay_reconnects_after_its_connections_are_cut(
    proxied_app: Celery, pg_proxy: TcpProxy, direct: Engine
) -> None:
    """The relay's LISTEN connection and its pool die with the cut; once the store is back it picks up the
    successor whose NOTIFY it missed, without being restarted."""
    relay = Relay(FanIn.of(proxied_app), poll_interval=0.2)
    thread = threading.Thread(target=relay.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: relay.stats.rounds >= 1, 20, message="the relay's first round")
        pg_proxy.cut()
        wait_for(lambda: relay.stats.errors >= 1, 20, message="the relay to notice the cut")
        batch, children, _ = create(direct, 1)
        with direct.begin() as conn:  # the last child's report creates the successor (its NOTIFY is missed)
            nulls = ", ".join(["NULL"] * 8)
            sql = text(f"SELECT fanin_record_terminal_v2(:t, 'succeeded', {nulls})")
            conn.execute(sql, {"t": children[0].task_id})
        errors = relay.stats.errors
        pg_proxy.restore()
        wait_for(lambda: relay.stats.successors_published == 1, 30, message="the successor published after restore")
        assert relay.stats.errors == errors or relay.stats.errors == errors + 1  # at most the round under way
        assert relay._listener is not None and not relay._listener.closed
    finally:
        relay.stop()
        thread.join(15)


@pytest.mark.parametrize("broker", ["redis", "rabbitmq"])
def test_producer_publishes_after_its_broker_connection_was_cut(
    broker: str, clean_db: str, clean_redis: str, direct: Engine
) -> None:
    """A pooled broker connection the broker closed (a restart) is replaced before the next batch is published:
    that batch's children reach the broker at once instead of being left to the relay."""
    url = clean_redis if broker == "redis" else AMQP_URL
    with proxy_for(url, 6379 if broker == "redis" else 5672) as proxy:
        capp = Celery("fanin-broker-cut", broker=proxy.url(url), set_as_current=False)
        capp.conf.fanin_database_url = clean_db
        capp.conf.task_default_queue = f"outage-{uuid.uuid4().hex[:8]}"
        capp.task(name="t.ok", shared=False)(_ok)
        capp.task(name="t.then", shared=False)(_ok)
        FanIn(capp)
        try:
            handles = []
            for i in range(3):
                if i == 1:
                    proxy.cut()
                    proxy.restore()
                sig = [capp.signature("t.ok", args=(i,)) for _ in range(3)]
                handles.append(fan_in_group(sig, then=capp.signature("t.then"), app=capp).apply_async())
            assert [h.batch_status().published for h in handles] == [3, 3, 3]
        finally:
            if broker == "rabbitmq":
                with capp.connection_for_write() as conn:
                    conn.default_channel.queue_delete(capp.conf.task_default_queue)
            release_producer_app(capp)


def test_the_sessions_redis_claim_survives_redis_forgetting_it(redis_url: str, request: pytest.FixtureRequest) -> None:
    """A Redis restarted without persistence (the chaos suite's broker restart) forgets this session's claim on
    its database number; the next test's `clean_redis` sets it again, so no other session takes the number."""
    import redis

    from tests.conftest import REDIS_CLAIM_KEY

    client = redis.Redis.from_url(redis_url)
    token = client.get(REDIS_CLAIM_KEY)
    assert token is not None
    client.delete(REDIS_CLAIM_KEY)
    request.getfixturevalue("clean_redis")
    assert client.get(REDIS_CLAIM_KEY) == token


@pytest.mark.parametrize("broker", ["redis", "rabbitmq"])
def test_releasing_a_producer_app_leaves_other_apps_on_its_broker_working(
    broker: str, clean_db: str, clean_redis: str
) -> None:
    """Two apps on one broker URL share kombu's process-wide connection pool. The chaos suite used to close its
    producer app's pool (`force_close_all`), which closed the shared test app's too: every later test that
    published failed with "Acquire on closed pool" (why chaos had to run last). Releasing the app instead leaves
    the pool to the others."""
    url = clean_redis if broker == "redis" else AMQP_URL
    queue = f"outage-{uuid.uuid4().hex[:8]}"
    apps = [Celery(f"fanin-share-{i}", broker=url, set_as_current=False) for i in range(2)]
    for a in apps:
        a.conf.fanin_database_url = clean_db
        a.conf.task_default_queue = queue
        FanIn(a)
    assert apps[0].pool is apps[1].pool  # what makes closing one app's pool everybody's problem
    try:
        with apps[0].producer_or_acquire() as prod:
            prod.publish({"n": 0}, routing_key=queue, declare=[kombu.Queue(queue)])
        release_producer_app(apps[0])
        with apps[1].producer_or_acquire() as prod:
            prod.publish({"n": 1}, routing_key=queue, declare=[kombu.Queue(queue)])
    finally:
        with apps[1].connection_for_write() as conn:
            conn.default_channel.queue_delete(queue)
        release_producer_app(apps[1])


class _Request(dict):  # type: ignore[type-arg]
    """Stands for the request `task_revoked` carries: the message's headers, and its id."""

    def __init__(self, task_id: str, batch_id: uuid.UUID, index: int) -> None:
        super().__init__({"fanin_batch": str(batch_id), "fanin_index": index})
        self.id = task_id


def test_a_main_process_report_does_not_hold_the_event_loop(
    proxied_app: Celery, pg_proxy: TcpProxy, direct: Engine, report_attempts: list[str]
) -> None:
    """`task_revoked` (like a hard time limit or a lost pool process) is handled in the worker's main process,
    which runs the event loop: during an outage the handler returns after one attempt and a thread keeps
    retrying, so the worker goes on consuming and heart-beating; the report lands once the store is back.

    That report completes the batch, and nobody is left to publish its successor: the thread hands it to the relay
    at once (`report.wake_relay`) instead of leaving it for the `fanin_successor_handoff` this worker was given."""
    batch, children, _ = create(direct, 1)
    proxied_app.conf.fanin_report_timeout = 10  # the bound a handler that waited would wait
    proxied_app.conf.fanin_successor_handoff = 600  # far beyond this test: a due row can only be the wake's doing
    assert FanIn.of(proxied_app).worker_publishes_successors  # the report connection says so, with the handoff
    sender = type("Consumer", (), {"app": proxied_app})()
    handler = threading.current_thread().name
    pg_proxy.cut()
    try:
        hooks.worker_hooks.task_revoked(sender=sender, request=_Request(children[0].task_id, batch.id, 0), expired=True)
        # One attempt, then it returned: any other so far is the reports thread's, which retries meanwhile.
        assert report_attempts[0] == handler and report_attempts.count(handler) == 1
        assert [r["state"] for r in child_rows(direct, batch.id, "state")] == ["pending"]
    finally:
        pg_proxy.restore()
    wait_for(
        lambda: [r["state"] for r in child_rows(direct, batch.id, "state")] == ["revoked"],
        20,
        message="the revoked report recorded",
    )
    assert report.background().flush(5)
    # The handler made no other attempt: the reports thread's last one recorded it.
    assert report_attempts.count(handler) == 1 and report_attempts[-1] == "celery-fanin-reports"
    with direct.connect() as conn:
        due = conn.execute(
            text("SELECT available_at <= now() FROM fanin_outbox WHERE batch_id = :b AND sent_at IS NULL"),
            {"b": batch.id},
        ).scalars()
        assert list(due) == [True]  # handed off for 600 s by the report, made due by the thread's wake
