"""A PostgreSQL failover mid-batch (issue 39): a primary with a synchronous standby of the test's own
(tests/cluster.py), every process given a URL that names both, the primary stopped as a crash would stop it and the
standby promoted while a real worker reports and a real relay listens.

The claim: every process finds the new primary by itself (no restart), the relay listens again, no report is lost
and none is counted twice, the successor runs once, and the producer that made a batch before the failover makes
and finishes one after it. The time from the primary's stop until the batch makes progress again, and how many
reports were retried, are printed (RELIABILITY.md quotes them).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
import redis

from celery_fanin import fan_in_group
from celery_fanin.protocol import OUTBOX_CHANNEL
from celery_fanin.store.reports import libpq_conninfo
from tests import app as tasks
from tests.cluster import Cluster, cluster
from tests.e2e.brokers import on_broker
from tests.workers import RELAY_PUBLISHES, ROOT, wait_for

pytestmark = [pytest.mark.e2e]

Runs = Callable[[str], list[dict[str, Any]]]
CHILDREN = 300


@pytest.fixture
def ha_cluster(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    """A primary with a synchronous standby (parametrized False: asynchronous), migrated; stopped and deleted after
    the test."""
    with cluster(synchronous=getattr(request, "param", True)) as made:
        made.migrate()
        yield made


@pytest.fixture
def e2e_env(ha_cluster: Cluster, clean_redis: str, request: pytest.FixtureRequest) -> Iterator[dict[str, str]]:
    """The e2e environment on the cluster: on Redis with SQLAlchemy's several-host URL, on RabbitMQ with libpq's,
    so that each form is run end to end."""
    broker = getattr(request, "param", "redis")
    url = ha_cluster.sqlalchemy_url if broker == "redis" else ha_cluster.libpq_url
    with on_broker({"FANIN_DATABASE_URL": url, "FANIN_TEST_BROKER": clean_redis}, broker) as env:
        yield env


def read(made: Cluster, sql: str, *params: Any) -> list[tuple[Any, ...]] | None:
    """Rows from whichever server takes writes now, or None while none does (mid-failover)."""
    try:
        with psycopg.connect(libpq_conninfo(made.libpq_url), autocommit=True, connect_timeout=2) as conn:
            return conn.execute(sql, params).fetchall()
    except psycopg.OperationalError:
        return None


def children(made: Cluster, batch_id: str) -> dict[str, int] | None:
    """The states of a batch's children, its leaves' included (a batch of 300 is a root over leaves of 150)."""
    found = read(
        made,
        "SELECT c.state, count(*) FROM fanin_children c JOIN fanin_batches b ON b.id = c.batch_id"
        " WHERE b.id = %s OR b.parent_id = %s GROUP BY c.state",
        batch_id,
        batch_id,
    )
    return None if found is None else {state: n for state, n in found}


def succeeded(made: Cluster, batch_id: str) -> int:
    return (children(made, batch_id) or {}).get("succeeded", 0)


def listening(made: Cluster) -> bool:
    """A session on the current primary LISTENs for the outbox (the relay's)."""
    found = read(
        made,
        "SELECT count(*) FROM pg_stat_activity WHERE query = %s AND pid <> pg_backend_pid()",
        f"LISTEN {OUTBOX_CHANNEL}",
    )
    return bool(found and found[0][0] >= 1)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("e2e_env", ["redis", "rabbitmq"], indirect=True)
def test_a_failover_mid_batch_loses_nothing_and_runs_no_successor_twice(
    ha_cluster: Cluster, e2e_env: dict[str, str], processes: Any, producer: Any, successor_runs: Runs
) -> None:
    # Successors only through the relay, so that the relay's path after the failover is the one tested.
    worker = processes.worker(extra_env=RELAY_PUBLISHES, concurrency=4)
    assert f"transport:   {e2e_env['FANIN_TEST_BROKER'].split(':')[0]}://" in worker.output()
    relay = processes.relay(process=True)
    before = fan_in_group([tasks.ok.s(i) for i in range(5)], then=tasks.record_run.s("before")).apply_async()
    assert before.wait_batch(timeout=30).successor_state == "succeeded"
    assert listening(ha_cluster)

    batch = fan_in_group([tasks.sleepy.s(0.05) for _ in range(CHILDREN)], then=tasks.record_run.s("big")).apply_async()
    wait_for(
        lambda: succeeded(ha_cluster, batch.batch_id) >= CHILDREN // 5,
        60,
        message="a fifth of the batch done",
    )
    stopped = ha_cluster.fail_over()
    # The new primary starts from what the old one had committed (synchronous: all of it); progress is more.
    at_stop = succeeded(ha_cluster, batch.batch_id)
    wait_for(
        lambda: succeeded(ha_cluster, batch.batch_id) > at_stop,
        60,
        interval=0.05,
        message="the batch to make progress on the new primary",
    )
    resumed = time.monotonic() - stopped

    # The same producer, with the engine it used before the failover, makes and finishes a batch after it.
    after = fan_in_group([tasks.ok.s(i) for i in range(20)], then=tasks.record_run.s("after")).apply_async()
    for handle, planned in ((batch, CHILDREN), (after, 20)):
        status = handle.wait_batch(timeout=90)
        assert (status.succeeded, status.failed, status.remaining, status.planned) == (planned, 0, 0, planned)
        assert status.successor_state == "succeeded" and status.successor_runs == 1
        assert children(ha_cluster, handle.batch_id) == {"succeeded": planned}  # none lost, none counted twice
        runs = successor_runs(handle.batch_id)
        assert len(runs) == 1 and runs[0]["outcome"]["succeeded"] == planned
    wait_for(lambda: listening(ha_cluster), 10, message="the relay LISTENing on the new primary")
    assert worker.proc.poll() is None and relay.proc.poll() is None  # nobody restarted
    log = worker.output()
    assert "gave up" not in log
    retried = log.count("failed (attempt 1,")  # each report that met the failover, once
    print(f"\nfailover: progress {resumed:.2f}s after the primary's stop; {retried} reports retried")


def on_standby(made: Cluster, sql: str, *params: Any) -> list[tuple[Any, ...]]:
    with made.standby.connect() as conn:
        return conn.execute(sql, params).fetchall()


def successor_state(made: Cluster, batch_id: str) -> str | None:
    found = read(made, "SELECT successor_state FROM fanin_nodes WHERE id = %s", batch_id)
    return found[0][0] if found else None


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ha_cluster", [pytest.param(False, id="async")], indirect=True)
def test_asynchronous_replication_loses_the_last_commits_and_still_converges(
    ha_cluster: Cluster, e2e_env: dict[str, str], processes: Any, producer: Any, successor_runs: Runs
) -> None:
    """What asynchronous replication costs (docs/how-to/high-availability.md): the commits the old primary
    acknowledged after the standby's last receipt are gone after the promotion. Here they are the children's
    terminal reports and the successor's whole run (admission, finish, its own record): on the new primary the
    children are still `started` and there is no successor. Nothing hangs: child_timeout counts them `lost`
    (failed; `on_lost="redrive"` would run them again), the batch completes, and its successor runs again.
    `succeeded + failed == planned` holds; exactly once does not (the successor's body ran twice, and four children
    that succeeded are counted failed): that needs a synchronous standby."""
    env = {"FANIN_TEST_REAPER_INTERVAL": "0.5"}
    processes.worker(extra_env=env, concurrency=4)
    processes.relay(extra_env=env)
    batch = fan_in_group(
        [tasks.sleepy.s(2) for _ in range(4)], then=tasks.slow_once_successor.s("async", 0.2), child_timeout=8
    ).apply_async()
    # The children's starts reach the standby; then it receives nothing more.
    wait_for(
        lambda: (
            on_standby(
                ha_cluster,
                "SELECT count(*) FROM fanin_children WHERE batch_id = %s AND state = 'started'",
                batch.batch_id,
            )
            == [(4,)]
        ),
        30,
        message="the four starts replicated",
    )
    ha_cluster.detach_standby()
    wait_for(
        lambda: successor_state(ha_cluster, batch.batch_id) == "succeeded",
        30,
        message="the batch done on the old primary",
    )
    assert len(successor_runs(batch.batch_id)) == 1
    broker = redis.Redis.from_url(e2e_env["FANIN_TEST_BROKER"])
    body_runs = f"e2e:slow_once_successor:{batch.batch_id}"  # counted by the body itself, outside PostgreSQL
    assert int(broker.get(body_runs) or 0) == 1

    ha_cluster.fail_over()
    # The new primary never saw the reports nor the successor.
    assert children(ha_cluster, batch.batch_id) == {"started": 4}
    assert successor_state(ha_cluster, batch.batch_id) is None and successor_runs(batch.batch_id) == []
    status = batch.wait_batch(timeout=60)  # child_timeout (8 s after the starts) and the relay's reaper end it
    assert (status.succeeded, status.failed, status.remaining, status.planned) == (0, 4, 0, 4)
    assert status.succeeded + status.failed == status.planned
    assert children(ha_cluster, batch.batch_id) == {"lost": 4}
    assert status.successor_state == "succeeded" and status.successor_runs == 1  # the store's count: one run
    assert int(broker.get(body_runs) or 0) == 2  # the body's: two, one on each side of the failover
    assert [r["outcome"]["failed"] for r in successor_runs(batch.batch_id)] == [4]


@pytest.mark.timeout(90)
def test_status_and_ls_read_from_a_standby(ha_cluster: Cluster, e2e_env: dict[str, str], producer: Any) -> None:
    """The read-only views may be pointed at a standby (`target_session_attrs=prefer-standby`): with the primary
    stopped and nothing promoted, `fanin status` and `fanin ls` still show a batch, from the standby."""
    batch = fan_in_group([tasks.ok.s(i) for i in range(3)], then=tasks.record_run.s("ro")).apply_async()
    ha_cluster.primary.stop("immediate")  # synchronous: the batch's commit is on the standby already
    url = ha_cluster.libpq_url.replace("target_session_attrs=read-write", "target_session_attrs=prefer-standby")
    env = {**e2e_env, "FANIN_DATABASE_URL": url, "PYTHONPATH": str(ROOT)}
    for args in (["status", batch.batch_id], ["ls"]):
        done = subprocess.run(
            [sys.executable, "-m", "celery", "-A", "tests.app", "fanin", *args],
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
        )
        assert done.returncode == 0, done.stderr
        assert batch.batch_id[:8] in done.stdout, done.stdout


@pytest.mark.timeout(150)
def test_failing_over_and_back_again(
    ha_cluster: Cluster, e2e_env: dict[str, str], processes: Any, producer: Any, successor_runs: Runs
) -> None:
    """Two failovers under one batch: to the standby, then (the old primary rebuilt as its standby) back to the
    first server, which the URL names first: a connection that reaches it while it is a standby is refused by
    `target_session_attrs=read-write` and goes on to the next host. The chaos suite's failover fault is these
    steps (tests/chaos/test_chaos.py)."""
    processes.worker(concurrency=4)
    processes.relay(process=True)
    batch = fan_in_group(
        [tasks.sleepy.s(0.05) for _ in range(CHILDREN)], then=tasks.record_run.s("twice")
    ).apply_async()
    first = ha_cluster.primary
    for share in (0.2, 0.5):
        wait_for(
            lambda share=share: succeeded(ha_cluster, batch.batch_id) >= CHILDREN * share,
            60,
            message=f"{share:.0%} of the batch done",
        )
        ha_cluster.fail_over()
        ha_cluster.rejoin()
    assert ha_cluster.primary is first  # back where it started, with a standby streaming synchronously again
    status = batch.wait_batch(timeout=90)
    assert (status.succeeded, status.failed, status.remaining, status.planned) == (CHILDREN, 0, 0, CHILDREN)
    assert status.successor_state == "succeeded" and status.successor_runs == 1
    assert children(ha_cluster, batch.batch_id) == {"succeeded": CHILDREN}
    assert len(successor_runs(batch.batch_id)) == 1


@pytest.mark.timeout(120)
def test_a_worker_whose_url_reaches_a_read_only_server_waits_for_it_to_take_writes(
    ha_cluster: Cluster, e2e_env: dict[str, str], processes: Any, producer: Any, successor_runs: Runs
) -> None:
    """A worker whose one-host URL reaches the standby (a DNS name that still points at a server in recovery):
    each report meets SQLSTATE 25006 ("cannot execute ... in a read-only transaction"), waits and reconnects; once
    that server is promoted every report lands. None is dropped, the successor runs once."""
    standby_only = f"postgresql+psycopg://postgres@127.0.0.1:{ha_cluster.standby.port}/fanin"
    worker = processes.worker(extra_env={"FANIN_DATABASE_URL": standby_only}, concurrency=2)
    processes.relay(process=True)  # on the several-host URL
    batch = fan_in_group([tasks.ok.s(i) for i in range(6)], then=tasks.record_run.s("read-only")).apply_async()
    wait_for(lambda: "read-only transaction" in worker.output(), 30, message="a report refused by the standby")
    assert "not a transient error" not in worker.output()  # retried, not refused
    assert children(ha_cluster, batch.batch_id) == {"pending": 6}  # nothing got through meanwhile
    ha_cluster.fail_over()
    status = batch.wait_batch(timeout=60)
    assert (status.succeeded, status.failed, status.remaining, status.planned) == (6, 0, 0, 6)
    assert status.successor_state == "succeeded" and status.successor_runs == 1
    assert len(successor_runs(batch.batch_id)) == 1
    assert "gave up" not in worker.output() and "not a transient error" not in worker.output()
