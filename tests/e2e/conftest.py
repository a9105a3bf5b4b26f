"""Fixtures that start real worker and relay subprocesses against the session database and the test broker."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.workers import CeleryProcess, start_relay, start_worker


@pytest.fixture
def processes(e2e_env: dict[str, str], tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[_Processes]:
    procs = _Processes(e2e_env, tmp_path)
    yield procs
    failed = getattr(request.node, "rep_call", None)
    test_failed = bool(failed and failed.failed)
    bad = procs.stop_all(dump=test_failed)
    if bad and not test_failed:  # a test that failed already says so; do not hide it behind this
        pytest.fail("exited nonzero without being killed on purpose: " + "; ".join(bad), pytrace=False)


class _Processes:
    """Starts workers and relays for one test and stops them all afterwards (dumping logs if the test failed)."""

    def __init__(self, env: dict[str, str], tmp_path: Path) -> None:
        self.env = env
        self.tmp_path = tmp_path
        self.started: list[CeleryProcess] = []

    def worker(self, extra_env: dict[str, str] | None = None, **kwargs: Any) -> CeleryProcess:
        n = len(self.started)
        proc = start_worker({**self.env, **(extra_env or {})}, self.tmp_path / f"worker{n}.log", **kwargs)
        self.started.append(proc)
        return proc

    def relay(self, extra_env: dict[str, str] | None = None) -> CeleryProcess:
        proc = start_relay({**self.env, **(extra_env or {})}, self.tmp_path / f"relay{len(self.started)}.log")
        self.started.append(proc)
        return proc

    def stop_all(self, dump: bool = False) -> list[str]:
        """Stop every process; returns one line per process that exited nonzero without being killed on purpose.

        A process a test SIGKILLed, or one this teardown kills after the grace period, is not reported: its exit
        code says nothing about the code under test. Any other nonzero exit (a crash, a shutdown that failed) is.
        """
        # All asked at once, then one shared grace period: the test is over, so a worker still running a long
        # task (a hang, a 60 s sleep) is killed rather than waited for by its warm shutdown.
        for proc in self.started:
            proc.terminate()
        deadline = time.monotonic() + 5
        bad: list[str] = []
        for proc in self.started:
            code = proc.stop(timeout=max(0.1, deadline - time.monotonic()))
            if proc.exited_badly:
                bad.append(f"{proc.log.name} exit code {code}")
            if dump or proc.exited_badly:
                print(f"===== {proc.log.name} =====\n{proc.output()[-6000:]}")
        return bad


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]) -> Iterator[None]:
    outcome = yield
    rep = outcome.get_result()
    if rep.when == "call":
        item.rep_call = rep  # type: ignore[attr-defined]


@pytest.fixture
def successor_runs(e2e_env: dict[str, str]) -> Callable[[str], list[dict[str, Any]]]:
    """The runs the successor body itself recorded for a batch."""

    def runs(batch_id: str) -> list[dict[str, Any]]:
        with psycopg.connect(e2e_env["FANIN_DATABASE_URL"], autocommit=True) as conn:
            rows = conn.execute(
                "SELECT label, outcome, values FROM e2e_successor_runs WHERE batch_id = %s ORDER BY id", (batch_id,)
            ).fetchall()
        return [{"label": r[0], "outcome": r[1], "values": r[2]} for r in rows]

    return runs


@pytest.fixture
def producer(e2e_env: dict[str, str]) -> Any:
    """`tests.app.app` in this process, pointed at the test database and broker, for calling apply_async."""
    from celery_fanin import FanIn
    from tests.app import app

    changed = ("fanin_database_url", "broker_url", "task_default_queue")
    before = {key: app.conf[key] for key in changed}  # restored afterwards: the app is shared by the session
    app.conf.fanin_database_url = e2e_env["FANIN_DATABASE_URL"]
    app.conf.broker_url = e2e_env["FANIN_TEST_BROKER"]
    app.conf.task_default_queue = e2e_env.get("FANIN_TEST_QUEUE", "celery")
    yield app
    FanIn.of(app).dispose()
    app.conf.update(before)
    # The app is shared by every test of the session, and Celery picks its broker pool once, from the broker_url
    # of the time: forget it, so that the next test's broker_url (another broker, another Redis db) is the one used.
    # (Not closed: kombu keeps the pool in a process-wide registry and hands the same one out again.)
    app._pool = None
    app.amqp._producer_pool = None
