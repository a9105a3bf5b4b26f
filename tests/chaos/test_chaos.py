"""The chaos suite: many concurrent batches while a driver kills and restarts every component.

Faults, drawn at random from a printed seed: SIGKILL of a pool process; SIGKILL of a whole worker (one worker
runs with acks_late and task_reject_on_worker_lost, one without) and a replacement started; SIGKILL of a relay
and a new one started; a second relay started or stopped; PostgreSQL restarted; the broker restarted (Redis
without persistence: every queued message is lost; RabbitMQ: stop_app/start_app); and child messages published
a second time. Afterwards, for every batch in the database: its successor's body ran exactly once (recorded by
the successor itself), succeeded + failed == planned, the counters equal what the child rows say (no child
counted twice), every child that fails by design is failed, and nothing is left unfinished.

CI runs the default size (about two minutes per broker); `--chaos-scale 5` runs a longer, larger one, and
`--chaos-seed N` replays a run's fault sequence.
"""

from __future__ import annotations

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

import psycopg
import pytest
from celery import Celery
from rich.console import Console
from rich.table import Table

from celery_fanin import FanIn, FanInDatabaseError, fan_in_group, publish
from celery_fanin.store.batches import Encoded
from tests.faults import release_producer_app
from tests.workers import CeleryProcess, start_relay, start_worker, wait_for

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(900)]

RABBITMQ_URL = os.environ.get("FANIN_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672//")
MODES = ("ok", "ok", "ok", "fail", "flaky", "slow")


@dataclass
class Run:
    seed: int
    scale: float
    broker: str
    faults: Counter[str] = field(default_factory=Counter)
    batches_created: int = 0


class Chaos:
    """The processes under test and the faults applied to them."""

    def __init__(self, env: dict[str, str], tmp: Path, rng: random.Random, run: Run) -> None:
        self.env = {**env, "FANIN_TEST_REAPER_INTERVAL": "1", "FANIN_TEST_SUCCESSOR_TIMEOUT": "10"}
        self.tmp = tmp
        self.rng = rng
        self.run = run
        self.workers: dict[str, CeleryProcess] = {}
        self.relays: list[CeleryProcess] = []
        self.all: list[CeleryProcess] = []
        self._n = 0

    def _log(self, name: str) -> Path:
        self._n += 1
        return self.tmp / f"{self._n:03d}-{name}.log"

    def start_worker(self, kind: str) -> None:
        extra = {"FANIN_TEST_ACKS_LATE": "1"} if kind == "acks_late" else {}
        proc = start_worker({**self.env, **extra}, self._log(f"worker-{kind}"), concurrency=2)
        self.workers[kind] = proc
        self.all.append(proc)

    def start_relay(self) -> None:
        proc = start_relay(self.env, self._log("relay"))
        self.relays.append(proc)
        self.all.append(proc)

    # --- faults -------------------------------------------------------------------------------------------

    def kill_pool_process(self) -> None:
        worker = self.workers[self.rng.choice(sorted(self.workers))]
        pids = worker.pool_pids()
        if pids:
            os.kill(self.rng.choice(pids), 9)

    def kill_worker(self) -> None:
        kind = self.rng.choice(sorted(self.workers))
        self.workers[kind].kill()
        self.start_worker(kind)

    def kill_relay(self) -> None:
        victim = self.rng.choice(self.relays)
        victim.kill()
        self.relays.remove(victim)
        self.start_relay()

    def toggle_second_relay(self) -> None:
        if len(self.relays) < 2:
            self.start_relay()
        else:
            self.relays.pop().stop()

    def restart_postgres(self) -> None:
        version = os.listdir("/etc/postgresql")[0]
        subprocess.run(["pg_ctlcluster", "--skip-systemctl-redirect", version, "main", "restart", "-m", "fast"],
                       check=True, capture_output=True, timeout=60)  # fmt: skip

    def restart_broker(self) -> None:
        if self.run.broker == "redis":
            subprocess.run(["redis-cli", "-h", "127.0.0.1", "shutdown", "nosave"], capture_output=True, timeout=30)
            subprocess.run(
                ["redis-server", "--daemonize", "yes", "--bind", "127.0.0.1", "-::1", "--port", "6379", "--save", "",
                 "--appendonly", "no", "--dir", "/var/lib/redis", "--logfile", "/var/log/redis/ci.log"],
                check=True, capture_output=True, timeout=30,
            )  # fmt: skip
            wait_for(lambda: subprocess.run(["redis-cli", "ping"], capture_output=True).stdout.strip() == b"PONG",
                     30, 0.1, "redis back")  # fmt: skip
        else:
            subprocess.run(["rabbitmqctl", "stop_app"], check=True, capture_output=True, timeout=60)
            subprocess.run(["rabbitmqctl", "start_app"], check=True, capture_output=True, timeout=120)

    def duplicate_children(self, producer: Any) -> None:
        """Publish some unfinished children's stored messages again, as a broker redelivery would."""
        with psycopg.connect(self.env["FANIN_DATABASE_URL"], autocommit=True) as conn:
            rows = conn.execute(
                "SELECT batch_id, idx, task_id, message, content_type, content_encoding FROM fanin_children "
                "WHERE state IN ('pending', 'started') ORDER BY random() LIMIT 5"
            ).fetchall()
        app = producer
        with publish.producer(app) as prod:
            for batch_id, idx, task_id, body, ct, ce in rows:
                sig = publish.decode_signature(app, Encoded(ct, ce, bytes(body)))
                publish.publish_children(app, prod, batch_id, [(idx, task_id, sig)])

    def stop_all(self) -> None:
        for proc in self.all:
            proc.stop()


def _create_batches(producer: Any, run: Run, n_batches: int, width: int, rng: random.Random,
                    stop: threading.Event) -> None:  # fmt: skip
    for b in range(n_batches):
        if stop.is_set():
            return
        children = [producer.signature("tests.app.chaos_child", args=(b, i, rng.choice(MODES))) for i in range(width)]
        successor = producer.signature("tests.app.chaos_successor", args=(b,))
        group = fan_in_group(children, then=successor, app=producer, child_timeout=45, on_lost="redrive",
                             max_redrives=20)  # fmt: skip
        for _ in range(60):  # Postgres may be restarting: nothing was written, try again
            try:
                group.apply_async()
                run.batches_created += 1
                break
            except FanInDatabaseError:
                stop.wait(1)
        stop.wait(rng.uniform(0.2, 1.5))


@pytest.fixture(params=["redis", "rabbitmq"])
def broker_env(request: pytest.FixtureRequest, e2e_env: dict[str, str]) -> Iterator[dict[str, str]]:
    if request.param == "redis":
        yield {**e2e_env, "FANIN_TEST_QUEUE": f"chaos-{uuid.uuid4().hex[:8]}"}
    else:
        yield {**e2e_env, "FANIN_TEST_BROKER": RABBITMQ_URL, "FANIN_TEST_QUEUE": f"chaos-{uuid.uuid4().hex[:8]}"}


def _ensure_services(broker: str) -> None:
    """Leave the machine's services running whatever happened (a failed restart must not break later tests)."""
    version = os.listdir("/etc/postgresql")[0]
    subprocess.run(["pg_ctlcluster", "--skip-systemctl-redirect", version, "main", "start"], capture_output=True)
    if subprocess.run(["redis-cli", "ping"], capture_output=True).returncode != 0:
        subprocess.run(["redis-server", "--daemonize", "yes", "--bind", "127.0.0.1", "-::1", "--port", "6379",
                        "--save", "", "--appendonly", "no", "--dir", "/var/lib/redis", "--logfile",
                        "/var/log/redis/ci.log"], capture_output=True)  # fmt: skip
    if broker == "rabbitmq":
        subprocess.run(["rabbitmqctl", "start_app"], capture_output=True, timeout=120)


def test_chaos(broker_env: dict[str, str], tmp_path: Path, request: pytest.FixtureRequest) -> None:
    scale = float(request.config.getoption("--chaos-scale"))
    seed_opt = request.config.getoption("--chaos-seed")
    seed = int(seed_opt) if seed_opt is not None else random.randrange(1_000_000)
    broker = "rabbitmq" if broker_env.get("FANIN_TEST_BROKER", "").startswith("amqp") else "redis"
    run = Run(seed, scale, broker)
    print(f"\nchaos: broker={broker} seed={seed} scale={scale} (replay with --chaos-seed {seed})")
    rng = random.Random(seed)
    n_batches, width, duration = int(12 * scale), int(100 * min(scale, 5)), 60 * scale

    # A producer app of its own: the shared `tests.app.app` (and its cached producer pool) stays untouched.
    capp = Celery("chaos-producer", broker=broker_env["FANIN_TEST_BROKER"], set_as_current=False)
    capp.conf.task_default_queue = broker_env["FANIN_TEST_QUEUE"]
    capp.conf.fanin_database_url = broker_env["FANIN_DATABASE_URL"]
    FanIn(capp)
    chaos = Chaos(broker_env, tmp_path, rng, run)
    stop = threading.Event()
    try:
        chaos.start_worker("acks_late")
        chaos.start_worker("acks_early")
        chaos.start_relay()
        producer = threading.Thread(target=_create_batches,
                                    args=(capp, run, n_batches, width, random.Random(seed + 1), stop))  # fmt: skip
        producer.start()
        faults = {
            "kill pool process": (chaos.kill_pool_process, 6),
            "kill whole worker": (chaos.kill_worker, 2),
            "kill relay": (chaos.kill_relay, 2),
            "start/stop second relay": (chaos.toggle_second_relay, 2),
            "restart postgres": (chaos.restart_postgres, 1),
            f"restart {broker}": (chaos.restart_broker, 1),
            "publish children twice": (lambda: chaos.duplicate_children(capp), 3),
        }
        names = list(faults)
        weights = [faults[n][1] for n in names]
        deadline = time.monotonic() + duration
        while time.monotonic() < deadline:
            name = rng.choices(names, weights)[0]
            try:
                faults[name][0]()
                run.faults[name] += 1
            except Exception as exc:  # a fault that could not be applied is reported, not fatal
                run.faults[f"{name} (failed: {type(exc).__name__})"] += 1
            time.sleep(rng.uniform(1.0, 3.0))
        producer.join(120)
        assert not producer.is_alive(), "the producer did not finish creating batches"
        # Faults over: every component is up again; wait for the recovery timeouts to finish every batch.
        _ensure_services(broker)
        if len(chaos.relays) == 0:
            chaos.start_relay()
        FanIn.of(capp).dispose()
        results = _wait_until_finished(broker_env["FANIN_DATABASE_URL"], timeout=240 * max(1.0, scale))
        _report(run, results)
        _check(results, run)
    finally:
        stop.set()
        _ensure_services(broker)
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
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(
            """
            SELECT b.id::text, b.state, b.planned, b.remaining, b.succeeded, b.failed, s.state, s.runs, s.duplicates,
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
    keys = ["batch_id", "state", "planned", "remaining", "succeeded", "failed", "successor_state", "successor_runs",
            "duplicates", "created", "rows_succeeded", "rows_failed", "rows_open", "body_runs",
            "redrives", "late_reports"]  # fmt: skip
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
    summary = Table("batches", "children", "succeeded", "failed", "successor body runs", "duplicate deliveries",
                    "redrives", "late reports", title="outcome")  # fmt: skip
    summary.add_row(str(len(rows)), str(sum(r["planned"] for r in rows)), str(sum(r["succeeded"] for r in rows)),
                    str(sum(r["failed"] for r in rows)), str(sum(r["body_runs"] for r in rows)),
                    str(sum(r["duplicates"] or 0 for r in rows)), str(sum(r["redrives"] for r in rows)),
                    str(sum(r["late_reports"] for r in rows)))  # fmt: skip
    console.print(summary)


def _check(rows: list[dict[str, Any]], run: Run) -> None:
    assert len(rows) >= run.batches_created > 0
    problems = []
    for r in rows:
        bid = r["batch_id"]
        if r["body_runs"] != 1:
            problems.append(f"{bid}: successor body ran {r['body_runs']} times")
        if r["successor_state"] != "succeeded":
            problems.append(f"{bid}: successor ended {r['successor_state']}")
        if r["succeeded"] + r["failed"] != r["planned"] or r["remaining"] != 0:
            problems.append(f"{bid}: succeeded {r['succeeded']} + failed {r['failed']} != planned {r['planned']}")
        if (r["succeeded"], r["failed"], r["rows_open"]) != (r["rows_succeeded"], r["rows_failed"], 0):
            problems.append(f"{bid}: counters {r['succeeded']}/{r['failed']} but child rows "
                            f"{r['rows_succeeded']}/{r['rows_failed']} with {r['rows_open']} open")  # fmt: skip
        if r["created"] != r["planned"]:
            problems.append(f"{bid}: planned {r['planned']} but {r['created']} child rows")
        if r["fail_children_not_succeeded"] != r["fail_children"]:
            problems.append(f"{bid}: a child that always fails was counted as a success")
    assert not problems, "\n".join(problems[:20])
