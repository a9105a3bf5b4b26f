"""The chaos suite: many concurrent batches while a driver kills and restarts every component.

Faults, drawn at random from a printed seed after each kind has been applied once: SIGKILL of a pool process;
SIGKILL of a whole worker (one prefork worker runs with acks_late and task_reject_on_worker_lost, one without, one
is a thread pool) and a replacement started; SIGKILL of a relay and a new one started; a second relay started or
stopped; PostgreSQL restarted; PostgreSQL down for 60 s; the broker restarted (Redis without persistence: every
queued message is lost; RabbitMQ: stop_app/start_app); child messages published a second time (a batch of its own
whose children run 4 s, copied once one started); and successors
published again (duplicate deliveries, of running and of finished successors); a 3 s cut between PostgreSQL and a
worker of its own (through a proxy the test owns) while children with `expires` shorter than their run start on it
(the relay's `fanin_expires_grace` is 1 s: a start lost in the cut would let its sweep count a running child
revoked). Every successor retries itself once, except every third batch's, which is replaced by a slow chain
(`then=chain(chaos_slow_step, record_run)`: the chain's last task is its carrier). Each fault is verified to have
happened (the process is gone, the server's start time or connection changed); a fault that cannot be applied
fails the run. A second copy counts only once its effect is seen: a late report on a child published twice, a
refused duplicate on a successor published again (tests/chaos/copies.py); each kind is applied again (or, in the
first round, kept among the kinds still to apply) until one of its applications was seen, for up to CONFIRM_WITHIN
seconds past the faults' end.

The `redis-failover` run adds PostgreSQL failovers: on a primary and a synchronous standby of the test's own
(tests/cluster.py; every process given a URL naming both), the primary stopped with `immediate`, the standby
promoted and the old primary rebuilt as the new standby, again and again; its restarts and its outage act on
whichever server is primary (it has no cut worker: its proxy fronts one server).

Afterwards, for every batch in the database: its successor's body ran exactly once (recorded by the successor
itself, or by a replacement's carrier; a replacement the faults lost may instead end the successor `failed` with
`ReplacementLost` after `fanin_replaced_timeout`, its body never run, and at least one replaced successor must
finish; a successor whose run, or a part of whose replacement, was in a pool process the driver SIGKILLed may end
`failed` with Celery's WorkerLostError, as a chord body does, when its worker does not requeue it: its body ran at
most once, the run's holder is that process, and no more successors end so than processes were killed),
succeeded + failed == planned, the counters equal what the child rows say (no child counted twice),
every child that fails by design is failed, and nothing is left unfinished.

CI runs the default size (about three minutes per broker); `--chaos-scale 5` runs a longer, larger one, and
`--chaos-seed N` replays a run's fault sequence.
"""

from __future__ import annotations

import contextlib
import os
import random
import subprocess
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import amqp
import psycopg
import pytest
import redis
from celery import Celery, chain
from rich.console import Console
from rich.table import Table
from sqlalchemy.engine import make_url

from celery_fanin import FanIn, FanInDatabaseError, fan_in_group
from celery_fanin.store.reports import libpq_conninfo
from tests.chaos import copies
from tests.cluster import Cluster, cluster
from tests.faults import TcpProxy, release_producer_app
from tests.workers import CeleryProcess, start_relay, start_worker, wait_for

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(900)]

RABBITMQ_URL = os.environ.get("FANIN_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672//")
MODES = ("ok", "ok", "ok", "fail", "flaky", "slow")
# Seconds the fault loop may go on past its end for kinds not applied yet, or (a second copy) not seen to take
# effect yet; then the run fails.
CONFIRM_WITHIN = 180.0
# fanin_replaced_timeout of the chaos processes (seconds): longer than the 60 s outage.
REPLACED_TIMEOUT = 150.0


class Skipped(Exception):
    """A fault found nothing to act on this time (no unfinished child yet): drawn again later, not counted."""


@dataclass
class Run:
    seed: int
    scale: float
    broker: str
    faults: Counter[str] = field(default_factory=Counter)
    batches_created: int = 0
    # The pool processes the driver SIGKILLed: a successor run (or a replacement's part) one of them held may end
    # `failed` with Celery's WorkerLostError, as a chord body would; `_check` accepts that only for these.
    killed_pool_pids: set[int] = field(default_factory=set)


class Chaos:
    """The processes under test and the faults applied to them."""

    def __init__(self, env: dict[str, str], tmp: Path, rng: random.Random, run: Run, pg: Cluster | None = None) -> None:
        # expires_grace 1 s: the relay's expiry sweep acts as early as it may (1 s + fanin_report_timeout).
        self.env = {
            **env,
            "FANIN_TEST_REAPER_INTERVAL": "1",
            "FANIN_TEST_SUCCESSOR_TIMEOUT": "10",
            "FANIN_TEST_EXPIRES_GRACE": "1",
            # A replaced successor whose replacement the faults lose (an early-acked chain on a killed worker, a
            # Redis restart) ends `failed` (ReplacementLost) this long after its hand-over: longer than the 60 s
            # outage, so that a replacement that survives it is not cut short.
            "FANIN_TEST_REPLACED_TIMEOUT": str(REPLACED_TIMEOUT),
        }
        # The PostgreSQL faults act on the test's own cluster (`pg`), else on this machine's PostgreSQL, which must
        # then be the one this run uses; the broker's restart is always this machine's.
        self.pg = pg
        if pg is not None:
            self.admin_url = libpq_conninfo(pg.libpq_url)
        else:
            db = make_url(env["FANIN_DATABASE_URL"])
            if (db.host, db.port or 5432) not in (("127.0.0.1", 5432), ("localhost", 5432)):
                raise AssertionError(f"the chaos suite restarts the local PostgreSQL cluster; this run uses {db.host}")
            self.admin_url = db.set(drivername="postgresql").render_as_string(hide_password=False)
            self.pg_version = os.listdir("/etc/postgresql")[0]
        broker = (
            make_url(env["FANIN_TEST_BROKER"].replace("redis://", "postgresql://", 1))
            if run.broker == "redis"
            else None
        )
        self.redis_host = (broker.host if broker else None) or "127.0.0.1"
        self.redis_port = (broker.port if broker else None) or 6379
        self.outage = 60.0
        self.tmp = tmp
        self.rng = rng
        self.run = run
        self.workers: dict[str, CeleryProcess] = {}
        self.relays: list[CeleryProcess] = []
        self.all: list[CeleryProcess] = []
        # The second copies made, counted once their effect is seen.
        self.copies = copies.Ledger(lambda made: copies.read_counts(libpq_conninfo(env["FANIN_DATABASE_URL"]), made))
        self._n = 0
        # The worker of the "short cut while children start" fault: its own queue, its store through `pg_proxy`.
        self.pg_proxy: TcpProxy | None = None
        self.cut_worker: CeleryProcess | None = None
        self.cut_queue = f"{env.get('FANIN_TEST_QUEUE', 'celery')}-expiring"
        self._cut_batches = 0
        self._copied_batches = 0

    def _log(self, name: str) -> Path:
        self._n += 1
        return self.tmp / f"{self._n:03d}-{name}.log"

    def start_worker(self, kind: str) -> None:
        extra = {"FANIN_TEST_ACKS_LATE": "1"} if kind == "acks_late" else {}
        pool = "threads" if kind == "threads" else "prefork"
        proc = start_worker({**self.env, **extra}, self._log(f"worker-{kind}"), concurrency=2, pool=pool)
        self.workers[kind] = proc
        self.all.append(proc)

    def start_cut_worker(self) -> None:
        """A worker on a queue of its own whose PostgreSQL connections go through a proxy only the fault cuts (not
        in `workers`: the other faults leave it alone, so the children the fault publishes start at once)."""
        self.pg_proxy = TcpProxy.for_url(self.env["FANIN_DATABASE_URL"], 5432)
        env = {**self.env, "FANIN_DATABASE_URL": self.pg_proxy.url(self.env["FANIN_DATABASE_URL"])}
        self.cut_worker = start_worker(env, self._log("worker-cut"), concurrency=2, extra=["-Q", self.cut_queue])
        self.all.append(self.cut_worker)

    def start_relay(self) -> None:
        proc = start_relay(self.env, self._log("relay"))
        self.relays.append(proc)
        self.all.append(proc)

    def supervise(self) -> None:
        """Start again a worker that exited on its own, as systemd or Kubernetes would in production.

        Celery itself sometimes exits on a broker restart: kombu's Redis channel, closed while its connection is
        being re-established, raises AttributeError ("'NoneType' object has no attribute 'hostname'") restoring
        an acks_late worker's unacknowledged messages, and the worker stops with "Unrecoverable error" (CI,
        2026-12-03, Celery and kombu 5.7.0). To the fan-in that is one more lost worker, which it must survive as
        it survives a SIGKILLed one, so the run goes on with the worker restarted and counted in the report. Only
        that exit is forgiven: any other, or a crash whose traceback passes through celery_fanin, fails the run."""
        for kind, proc in list(self.workers.items()):
            if proc.proc.poll() is None or proc.killed:
                continue
            log = proc.output()
            marker = log.rfind("Unrecoverable error")
            crash = log[marker:] if marker >= 0 else log[-6000:]
            assert marker >= 0 and "/celery_fanin/" not in crash, (
                f"{proc.log.name} exited on its own (code {proc.proc.returncode}):\n{crash[-6000:]}"
            )
            self.run.faults["worker exited on its own (Celery), restarted"] += 1
            proc.stop()
            self.start_worker(kind)

    # --- faults: each raises if it could not be applied, and checks that it happened ---------------------------

    def kill_pool_process(self) -> None:
        prefork = sorted(kind for kind in self.workers if kind != "threads")
        worker = self.workers[self.rng.choice(prefork)]

        def pool_or_exit() -> list[int] | bool:
            return worker.pool_pids() or worker.proc.poll() is not None

        pids = wait_for(pool_or_exit, 20, 0.1, "a pool process to kill")
        if not isinstance(pids, list):  # the worker exited on its own meanwhile (see `supervise`): nothing to kill
            self.supervise()
            raise Skipped
        pid = self.rng.choice(pids)
        self.run.killed_pool_pids.add(pid)
        os.kill(pid, 9)
        wait_for(lambda: pid not in worker.pool_pids(), 10, 0.05, f"pool process {pid} gone")

    def kill_worker(self) -> None:
        kind = self.rng.choice(sorted(self.workers))
        victim = self.workers[kind]
        victim.kill()
        assert victim.proc.poll() is not None, "the worker survived SIGKILL"
        self.start_worker(kind)

    def kill_relay(self) -> None:
        victim = self.rng.choice(self.relays)
        victim.kill()
        assert victim.proc.poll() is not None, "the relay survived SIGKILL"
        self.relays.remove(victim)
        self.start_relay()

    def toggle_second_relay(self) -> None:
        if len(self.relays) < 2:
            self.start_relay()
        else:
            victim = self.relays.pop()
            victim.stop()
            assert victim.proc.poll() is not None, "the second relay did not stop"

    def _postgres_started_at(self) -> Any:
        """When the server that takes writes started (a restart, or a failover, changes it)."""
        with psycopg.connect(self.admin_url, autocommit=True, connect_timeout=5) as conn:
            row = conn.execute("SELECT pg_postmaster_start_time()").fetchone()
        assert row is not None
        return row[0]

    def _pg_ctl(self, action: str, *extra: str) -> None:
        if self.pg is not None:  # the test's own cluster: the server that is primary now
            server = self.pg.primary
            if action in ("stop", "restart"):
                server.stop(extra[-1] if extra else "fast")
            if action in ("start", "restart"):
                server.start()
            return
        subprocess.run(
            ["pg_ctlcluster", "--skip-systemctl-redirect", self.pg_version, "main", action, *extra],
            check=True,
            capture_output=True,
            timeout=120,
        )

    def restart_postgres(self) -> None:
        before = self._postgres_started_at()
        self._pg_ctl("restart", "-m", "fast")
        after = wait_for(self._started_at_or_none, 60, 0.2, "PostgreSQL back")
        assert after != before, "PostgreSQL was not restarted"

    def postgres_outage(self) -> None:
        """PostgreSQL down for `outage` seconds (60 at every scale): reports wait, nothing is lost or run twice."""
        before = self._postgres_started_at()
        self._pg_ctl("stop", "-m", "fast")
        assert self._started_at_or_none() is None, "PostgreSQL still answers after stop"
        time.sleep(self.outage)  # the fault is the passing of time with the server down
        self._pg_ctl("start")
        after = wait_for(self._started_at_or_none, 60, 0.2, "PostgreSQL back")
        assert after != before

    def fail_over(self) -> None:
        """The primary stopped as a crash would, the standby promoted; then the old primary rebuilt as the new
        primary's synchronous standby, so that the next failover has one to promote."""
        assert self.pg is not None
        before = self._postgres_started_at()
        self.pg.fail_over()
        after = wait_for(self._started_at_or_none, 60, 0.2, "the promoted standby taking writes")
        assert after != before, "the same server is primary"
        self.pg.rejoin()

    def _started_at_or_none(self) -> Any:
        try:
            return self._postgres_started_at()
        except psycopg.OperationalError:
            return None

    def restart_broker(self) -> None:
        if self.run.broker == "redis":
            client = redis.Redis(host=self.redis_host, port=self.redis_port, socket_timeout=5)
            before = client.info("server")["run_id"]
            subprocess.run(
                ["redis-cli", "-h", self.redis_host, "-p", str(self.redis_port), "shutdown", "nosave"],
                capture_output=True,
                timeout=30,
            )
            subprocess.run(
                [
                    "redis-server",
                    "--daemonize",
                    "yes",
                    "--bind",
                    "127.0.0.1",
                    "-::1",
                    "--port",
                    str(self.redis_port),
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--dir",
                    "/var/lib/redis",
                    "--logfile",
                    "/var/log/redis/ci.log",
                ],
                check=True,
                capture_output=True,
                timeout=30,
            )

            def run_id() -> str | None:
                try:
                    return str(client.info("server")["run_id"])
                except redis.RedisError:
                    return None

            after = wait_for(run_id, 30, 0.1, "redis back")
            assert after != before, "Redis was not restarted"
        else:
            url = make_url(self.env["FANIN_TEST_BROKER"].replace("amqp://", "postgresql://", 1))
            watcher = amqp.Connection(
                f"{url.host}:{url.port or 5672}",
                userid=url.username or "guest",
                password=url.password or "guest",
                connect_timeout=5,
            )
            watcher.connect()
            subprocess.run(["rabbitmqctl", "stop_app"], check=True, capture_output=True, timeout=60)
            subprocess.run(["rabbitmqctl", "start_app"], check=True, capture_output=True, timeout=120)
            try:  # the broker closed every connection it had: one opened before cannot be used any more
                with pytest.raises((OSError, amqp.exceptions.AMQPError)):
                    watcher.channel().basic_publish(amqp.Message(b"x"), routing_key="chaos-check")
                    watcher.drain_events(timeout=2)
            finally:
                watcher.collect()

    def duplicate_children(self, producer: Any) -> None:
        """Publish running children's stored messages again, as a broker redelivery would: a batch of its own of
        three children that run for 4 s each, copied once one of them has started (or after 20 s, pending)."""
        self._copied_batches += 1
        children = [producer.signature("tests.app.sleepy", args=(4,)) for _ in range(3)]
        successor = producer.signature("tests.app.chaos_successor", args=(-1000 - self._copied_batches,))
        # The run's own recovery options (`_create_batches`): a Redis restart can lose both copies of a child, and
        # then only child_timeout's redrive finishes the batch (a CI run of 5769afa waited on the default 6 h).
        handle = fan_in_group(
            children, then=successor, app=producer, child_timeout=45, on_lost="redrive", max_redrives=20
        ).apply_async()
        with psycopg.connect(libpq_conninfo(self.env["FANIN_DATABASE_URL"]), autocommit=True) as conn:

            def started() -> bool:
                sql = "SELECT 1 FROM fanin_children WHERE batch_id = %s AND state = 'started'"
                return conn.execute(sql, (handle.batch_id,)).fetchone() is not None

            deadline = time.monotonic() + 20  # the workers busy or killed meanwhile: the pending ones are copied
            while not started() and time.monotonic() < deadline:
                time.sleep(0.2)
            rows = copies.unfinished_children(conn, handle.batch_id)
        if not rows:
            raise Skipped("the copied batch finished before its copies went out")
        self.copies.add(copies.publish_children_again(producer, rows))

    def duplicate_successors(self) -> None:
        """Put sent successors' outbox rows back in line: the relay publishes them again (running or finished)."""
        with psycopg.connect(libpq_conninfo(self.env["FANIN_DATABASE_URL"]), autocommit=True) as conn:
            again = copies.send_successors_again(conn, 3)
        if again is None:
            raise Skipped("no successor sent yet")
        self.copies.add(again)

    def short_cut_while_children_start(self, producer: Any) -> None:
        """Cut the cut worker's store for 3 s (far below `fanin_report_timeout`) while two children with `expires`
        shorter than their run start on it; then each is counted by its own success, not by the expiry sweep."""
        assert self.pg_proxy is not None and self.cut_worker is not None
        self._cut_batches += 1
        n = self._cut_batches
        failed_writes = self.cut_worker.output().count("writing start records failed")
        children = [
            producer.signature("tests.app.sleepy", args=(8,)).set(expires=3, queue=self.cut_queue) for _ in range(2)
        ]
        self.pg_proxy.cut()
        try:
            handle = fan_in_group(
                children, then=producer.signature("tests.app.chaos_successor", args=(-n,)), app=producer
            ).apply_async()
            wait_for(
                lambda: (
                    self.cut_worker is not None
                    and self.cut_worker.output().count("writing start records failed") > failed_writes
                ),
                20,
                0.1,
                "a start meeting the cut",
            )
            time.sleep(3)  # the fault is the passing of time with the worker cut off from the store
        finally:
            self.pg_proxy.restore()
        # The effect: past the sweep's grace as it would have been (1 s), the children run on, counted by their
        # own reports (the batch's successor is checked with every other batch at the end).
        status = handle.wait_batch(timeout=60)
        assert (status.succeeded, status.failed) == (2, 0), f"a running child with expires was miscounted: {status}"

    def stop_all(self) -> None:
        for proc in self.all:
            proc.stop()
        if self.pg_proxy is not None:
            self.pg_proxy.close()


def _create_batches(
    producer: Any, run: Run, n_batches: int, width: int, rng: random.Random, stop: threading.Event
) -> None:
    for b in range(n_batches):
        if stop.is_set():
            return
        children = [producer.signature("tests.app.chaos_child", args=(b, i, rng.choice(MODES))) for i in range(width)]
        if b % 3 == 2:  # a successor replaced by a slow chain: its carrier, the chain's last task, records the run
            successor = chain(
                producer.signature("tests.app.chaos_slow_step", args=(b,)),
                producer.signature("tests.app.record_run", args=(f"chaos-{b}",)),
            )
        else:
            successor = producer.signature("tests.app.chaos_successor", args=(b,))
        group = fan_in_group(
            children, then=successor, app=producer, child_timeout=45, on_lost="redrive", max_redrives=20
        )
        for _ in range(60):  # Postgres may be restarting: nothing was written, try again
            try:
                group.apply_async()
                run.batches_created += 1
                break
            except FanInDatabaseError:
                stop.wait(1)
        stop.wait(rng.uniform(0.2, 1.5))


@pytest.fixture(params=["redis", "rabbitmq", "redis-failover"])
def broker_env(request: pytest.FixtureRequest, e2e_env: dict[str, str]) -> Iterator[dict[str, str]]:
    """The run's environment; `redis-failover` on a cluster of the test's own instead of the machine's
    PostgreSQL (the test finds it as `request.node.chaos_cluster`)."""
    queue = {"FANIN_TEST_QUEUE": f"chaos-{uuid.uuid4().hex[:8]}"}
    if request.param == "redis":
        yield {**e2e_env, **queue}
    elif request.param == "rabbitmq":
        yield {**e2e_env, "FANIN_TEST_BROKER": RABBITMQ_URL, **queue}
    else:
        with cluster(synchronous=True) as pg:
            pg.migrate()
            request.node.chaos_cluster = pg
            yield {**e2e_env, "FANIN_DATABASE_URL": pg.sqlalchemy_url, **queue}


def _ensure_services(broker: str, pg: Cluster | None = None) -> None:
    """Leave the machine's services running whatever happened (a failed restart must not break later tests), and
    the test's own cluster with a primary."""
    if pg is not None and not pg.primary.running:
        with contextlib.suppress(Exception):  # reported by the fault that failed, and by the checks after
            pg.primary.start()
    version = os.listdir("/etc/postgresql")[0]
    subprocess.run(["pg_ctlcluster", "--skip-systemctl-redirect", version, "main", "start"], capture_output=True)
    if subprocess.run(["redis-cli", "ping"], capture_output=True).returncode != 0:
        subprocess.run(
            [
                "redis-server",
                "--daemonize",
                "yes",
                "--bind",
                "127.0.0.1",
                "-::1",
                "--port",
                "6379",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                "/var/lib/redis",
                "--logfile",
                "/var/log/redis/ci.log",
            ],
            capture_output=True,
        )
    if broker == "rabbitmq":
        subprocess.run(["rabbitmqctl", "start_app"], capture_output=True, timeout=120)


def test_chaos(broker_env: dict[str, str], tmp_path: Path, request: pytest.FixtureRequest) -> None:
    scale = float(request.config.getoption("--chaos-scale"))
    seed_opt = request.config.getoption("--chaos-seed")
    seed = int(seed_opt) if seed_opt is not None else random.randrange(1_000_000)
    broker = "rabbitmq" if broker_env.get("FANIN_TEST_BROKER", "").startswith("amqp") else "redis"
    pg: Cluster | None = getattr(request.node, "chaos_cluster", None)
    run = Run(seed, scale, broker)
    where = "a cluster of its own, failing over" if pg else "this machine's"
    print(f"\nchaos: broker={broker} PostgreSQL={where} seed={seed} scale={scale} (replay with --chaos-seed {seed})")
    rng = random.Random(seed)
    n_batches, width, duration = int(12 * scale), int(100 * min(scale, 5)), 60 * scale

    # A producer app of its own: the shared `tests.app.app` (and its cached producer pool) stays untouched.
    capp = Celery("chaos-producer", broker=broker_env["FANIN_TEST_BROKER"], set_as_current=False)
    capp.conf.task_default_queue = broker_env["FANIN_TEST_QUEUE"]
    capp.conf.fanin_database_url = broker_env["FANIN_DATABASE_URL"]
    FanIn(capp)
    chaos = Chaos(broker_env, tmp_path, rng, run, pg)
    stop = threading.Event()
    try:
        chaos.start_worker("acks_late")
        chaos.start_worker("acks_early")
        chaos.start_worker("threads")
        if pg is None:  # its proxy fronts one server: a cluster's failover would leave it on the old primary
            chaos.start_cut_worker()
        chaos.start_relay()
        producer = threading.Thread(
            target=_create_batches, args=(capp, run, n_batches, width, random.Random(seed + 1), stop)
        )
        producer.start()
        faults = {
            "kill pool process": (chaos.kill_pool_process, 6),
            "kill whole worker": (chaos.kill_worker, 2),
            "kill relay": (chaos.kill_relay, 2),
            "start/stop second relay": (chaos.toggle_second_relay, 2),
            "restart postgres": (chaos.restart_postgres, 1),
            f"restart {broker}": (chaos.restart_broker, 1),
            copies.CHILDREN: (lambda: chaos.duplicate_children(capp), 3),
            copies.SUCCESSORS: (chaos.duplicate_successors, 2),
            "short db cut while children with expires start": (lambda: chaos.short_cut_while_children_start(capp), 1),
        }
        if pg is not None:
            del faults["short db cut while children with expires start"]
            faults["postgres failover"] = (chaos.fail_over, 3)
        names = list(faults)
        weights = [faults[n][1] for n in names]
        # Every kind once, in a random order, then random draws; the 60 s outage once, a third of the way in. A
        # kind that makes second copies stays in `first` until one of its copies was seen to take effect; while its
        # last copies may still do so (`patience`), the other kinds go first, or random draws.
        first = rng.sample(names, len(names))
        failures: list[str] = []
        outage_at = time.monotonic() + duration / 3
        deadline = time.monotonic() + duration + chaos.outage
        while time.monotonic() < deadline or (first and time.monotonic() < deadline + CONFIRM_WITHIN):
            chaos.supervise()
            chaos.copies.refresh()
            seen = chaos.copies.seen()
            first = [n for n in first if not seen[n]]
            if not first and time.monotonic() >= deadline:
                break
            if outage_at is not None and time.monotonic() >= outage_at:
                outage_at = None
                name, apply = "postgres down 60 s", chaos.postgres_outage
            else:
                due = [n for n in first if not (n in copies.EFFECTS and chaos.copies.waiting(n))]
                if first and not due and time.monotonic() >= deadline:
                    time.sleep(0.5)  # the faults are over: only copies that may still take effect are awaited
                    continue
                name = due[0] if due else rng.choices(names, weights)[0]
                apply = faults[name][0]
            try:
                apply()
            except Skipped:
                if name in first:
                    first.remove(name)
                    first.append(name)  # try the other kinds first; this one comes round again
                time.sleep(0.5)
                continue
            except Exception as exc:  # a fault that cannot be applied is a failed run, not a quieter one
                failures.append(f"{name}: {type(exc).__name__}: {exc}")
                _ensure_services(broker, pg)
            else:
                if name not in copies.EFFECTS:  # a copy is counted once its effect is seen (above, and below)
                    run.faults[name] += 1
            if name in first and name not in copies.EFFECTS:
                first.remove(name)
            time.sleep(rng.uniform(1.0, 3.0))
        assert not failures, "faults that could not be applied:\n" + "\n".join(failures)
        applied = run.faults + chaos.copies.seen()
        assert outage_at is None and not first and all(applied[n] >= 1 for n in names), (
            f"faults applied (second copies: seen to take effect) {dict(applied)}; still to apply or see after "
            f"{CONFIRM_WITHIN:.0f}s more: {first}"
        )
        producer.join(120)
        assert not producer.is_alive(), "the producer did not finish creating batches"
        # Faults over: every component is up again; wait for the recovery timeouts to finish every batch.
        _ensure_services(broker, pg)
        chaos.supervise()
        if len(chaos.relays) == 0:
            chaos.start_relay()
        FanIn.of(capp).dispose()
        results = _wait_until_finished(broker_env["FANIN_DATABASE_URL"], timeout=240 * max(1.0, scale))
        chaos.copies.refresh()  # for the report: copies seen since the loop ended too
        made, seen = chaos.copies.applied(), chaos.copies.seen()
        for name, effect in copies.EFFECTS.items():
            run.faults[name] = seen[name]
            if made[name] > seen[name]:
                run.faults[f"{name}: no {effect} seen"] = made[name] - seen[name]
        _report(run, results)
        _check(results, run)
    finally:
        stop.set()
        _ensure_services(broker, pg)
        chaos.stop_all()
        release_producer_app(capp)  # not capp.pool.force_close_all(): that pool is shared with later tests' apps


def _wait_until_finished(url: str, timeout: float) -> list[dict[str, Any]]:
    def finished() -> list[dict[str, Any]] | None:
        try:
            rows = _batch_rows(url)
        except psycopg.OperationalError:
            return None
        done = all(r["successor_state"] in ("succeeded", "failed") for r in rows)
        return rows if rows and done else None

    try:
        return wait_for(finished, timeout, 1.0, "every batch's successor to finish")
    except AssertionError:
        rows = _batch_rows(url)
        stuck = [r for r in rows if r["successor_state"] not in ("succeeded", "failed")]
        raise AssertionError(f"{len(stuck)} of {len(rows)} batches unfinished: {stuck[:5]}") from None


def _batch_rows(url: str) -> list[dict[str, Any]]:
    with psycopg.connect(libpq_conninfo(url), autocommit=True) as conn:
        rows = conn.execute(
            """
            SELECT b.id::text, b.state, b.planned, b.remaining, b.succeeded, b.failed, s.state, s.runs, s.duplicates,
                   s.carrier IS NOT NULL, s.exc_type, s.exc_message, s.run_owner,
                   (SELECT count(*) FROM fanin_children c WHERE c.batch_id = b.id) AS created,
                   (SELECT count(*) FROM fanin_children c WHERE c.batch_id = b.id AND c.state = 'succeeded'),
                   (SELECT count(*) FROM fanin_children c WHERE c.batch_id = b.id
                       AND c.state NOT IN ('pending', 'started', 'succeeded')),
                   (SELECT count(*) FROM fanin_children c WHERE c.batch_id = b.id
                       AND c.state IN ('pending', 'started')),
                   (SELECT count(*) FROM e2e_successor_runs r WHERE r.batch_id = b.id::text),
                   (SELECT coalesce(sum(c.redrives), 0) FROM fanin_children c WHERE c.batch_id = b.id),
                   (SELECT coalesce(sum(c.late_reports), 0) FROM fanin_children c WHERE c.batch_id = b.id)
              FROM fanin_batches b LEFT JOIN fanin_successors s ON s.batch_id = b.id AND s.step = b.step
            """
        ).fetchall()
        fails_by_design = {
            r[0]: (r[1], r[2])
            for r in conn.execute(
                "SELECT batch_id::text, count(*), count(*) FILTER (WHERE state <> 'succeeded') FROM fanin_children "
                "WHERE convert_from(message, 'UTF8') LIKE '%\"fail\"]%' GROUP BY batch_id"
            ).fetchall()
        }
    keys = [
        "batch_id",
        "state",
        "planned",
        "remaining",
        "succeeded",
        "failed",
        "successor_state",
        "successor_runs",
        "duplicates",
        "replaced",
        "successor_exc_type",
        "successor_exc_message",
        "run_owner",
        "created",
        "rows_succeeded",
        "rows_failed",
        "rows_open",
        "body_runs",
        "redrives",
        "late_reports",
    ]
    out = []
    for r in rows:
        d = dict(zip(keys, r, strict=True))
        d["fail_children"], d["fail_children_not_succeeded"] = fails_by_design.get(d["batch_id"], (0, 0))
        out.append(d)
    return out


def _report(run: Run, rows: list[dict[str, Any]]) -> None:
    console = Console(width=120)
    faults = Table("fault", "times", title=f"chaos faults (broker={run.broker}, seed={run.seed}, scale={run.scale})")
    for name, n in sorted(run.faults.items()):
        faults.add_row(name, str(n))
    console.print(faults)
    summary = Table(
        "batches",
        "children",
        "succeeded",
        "failed",
        "successor body runs",
        "duplicate deliveries",
        "redrives",
        "late reports",
        title="outcome",
    )
    summary.add_row(
        str(len(rows)),
        str(sum(r["planned"] for r in rows)),
        str(sum(r["succeeded"] for r in rows)),
        str(sum(r["failed"] for r in rows)),
        str(sum(r["body_runs"] for r in rows)),
        str(sum(r["duplicates"] or 0 for r in rows)),
        str(sum(r["redrives"] for r in rows)),
        str(sum(r["late_reports"] for r in rows)),
    )
    console.print(summary)


def _killed_with_its_pool_process(r: dict[str, Any], run: Run) -> bool:
    """Whether a successor ended `failed` because the driver SIGKILLed the pool process that ran it, or that ran a
    part of its replacement: Celery's WorkerLostError for a SIGKILL, on a worker that does not requeue it (without
    acks_late, or a copy already redelivered). That is the documented outcome of a lost pool process, as for a chord
    body; the run guard must still have ended only the killed process's run, which its holder says (a part's process
    holds no run: its error names the signal)."""
    if (r["successor_state"], r["successor_exc_type"]) != ("failed", "WorkerLostError"):
        return False
    if "SIGKILL" not in (r["successor_exc_message"] or ""):
        return False
    if r["replaced"]:
        return True
    holder = (r["run_owner"] or "").split(":")
    return len(holder) >= 3 and holder[2].isdigit() and int(holder[2]) in run.killed_pool_pids


def _check(rows: list[dict[str, Any]], run: Run) -> None:
    assert len(rows) >= run.batches_created > 0
    assert sum(r["fail_children"] for r in rows) > 0, "no child failing by design was found: the check below is void"
    carried = sum(1 for r in rows if r["replaced"] and r["successor_state"] == "succeeded")
    assert carried > 0, "no successor replaced by a slow chain ran to its end: the replaced path went untested"
    problems = []
    killed = [r["batch_id"] for r in rows if _killed_with_its_pool_process(r, run)]
    if len(killed) > len(run.killed_pool_pids):  # a pool process runs one task at a time
        problems.append(f"{len(killed)} successors lost with a pool process, {len(run.killed_pool_pids)} killed")
    for r in rows:
        bid = r["batch_id"]
        lost = r["replaced"] and (r["successor_state"], r["successor_exc_type"]) == ("failed", "ReplacementLost")
        if bid in killed:  # its body may have committed its record before the kill
            if r["body_runs"] not in (0, 1):
                problems.append(f"{bid}: successor body ran {r['body_runs']} times (lost with its pool process)")
        elif r["body_runs"] != (0 if lost else 1):
            problems.append(f"{bid}: successor body ran {r['body_runs']} times ({'lost' if lost else 'not lost'})")
        if r["successor_state"] != "succeeded" and not lost and bid not in killed:
            problems.append(f"{bid}: successor ended {r['successor_state']} ({r['successor_exc_type']})")
        if r["succeeded"] + r["failed"] != r["planned"] or r["remaining"] != 0:
            problems.append(f"{bid}: succeeded {r['succeeded']} + failed {r['failed']} != planned {r['planned']}")
        if (r["succeeded"], r["failed"], r["rows_open"]) != (r["rows_succeeded"], r["rows_failed"], 0):
            problems.append(
                f"{bid}: counters {r['succeeded']}/{r['failed']} but child rows "
                f"{r['rows_succeeded']}/{r['rows_failed']} with {r['rows_open']} open"
            )
        if r["created"] != r["planned"]:
            problems.append(f"{bid}: planned {r['planned']} but {r['created']} child rows")
        if r["fail_children_not_succeeded"] != r["fail_children"]:
            problems.append(f"{bid}: a child that always fails was counted as a success")
    assert not problems, "\n".join(problems[:20])
