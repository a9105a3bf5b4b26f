"""Fixtures that start real worker and relay subprocesses against the session database and the test broker.

A relay that the test does not configure, stop or kill itself runs as a thread of the test process (the same
`Relay` loop `celery -A ... fanin relay` runs, on the producer app), which saves the seconds a new interpreter
costs; the workers are always real `celery worker` subprocesses. The relay as a process (its command, SIGTERM,
several relays, its own connections cut) is tested where that is the claim: `processes.relay(process=True)` or
any `extra_env`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from celery_fanin.store.reports import libpq_conninfo
from tests.workers import CeleryProcess, start_relay, start_worker


@pytest.fixture
def processes(
    e2e_env: dict[str, str], producer: Any, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[_Processes]:
    # After `producer` (so torn down before it): an in-process relay uses the producer app's engine and broker.
    procs = _Processes(e2e_env, tmp_path, producer)
    yield procs
    failed = getattr(request.node, "rep_call", None)
    test_failed = bool(failed and failed.failed)
    bad = procs.stop_all(dump=test_failed)
    if bad and not test_failed:  # a test that failed already says so; do not hide it behind this
        pytest.fail("exited nonzero without being killed on purpose: " + "; ".join(bad), pytrace=False)


class _Processes:
    """Starts workers and relays for one test and stops them all afterwards (dumping logs if the test failed)."""

    def __init__(self, env: dict[str, str], tmp_path: Path, app: Any) -> None:
        self.env = env
        self.tmp_path = tmp_path
        self.app = app
        self.started: list[CeleryProcess | RelayThread] = []

    def worker(self, extra_env: dict[str, str] | None = None, **kwargs: Any) -> CeleryProcess:
        n = len(self.started)
        proc = start_worker({**self.env, **(extra_env or {})}, self.tmp_path / f"worker{n}.log", **kwargs)
        self.started.append(proc)
        return proc

    def relay(self, extra_env: dict[str, str] | None = None, process: bool = False) -> CeleryProcess | RelayThread:
        """A relay: a `celery fanin relay` subprocess with `extra_env` or `process=True`, else a thread (see above)."""
        log = self.tmp_path / f"relay{len(self.started)}.log"
        relay: CeleryProcess | RelayThread
        if extra_env or process:
            relay = start_relay({**self.env, **(extra_env or {})}, log)
        else:
            relay = RelayThread(self.app, log)
        self.started.append(relay)
        return relay

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


class RelayThread:
    """The relay loop in a thread of this process, with the parts of `CeleryProcess` the fixtures and tests use:
    `output()` (the library's log records of WARNING and above, the level this process logs at, while it runs),
    `terminate()`, `stop()` and `exited_badly` (the loop raised, or did not stop)."""

    def __init__(self, app: Any, log: Path) -> None:
        from celery_fanin import FanIn
        from celery_fanin.relay import Relay

        self.log = log  # named in the teardown's dump, as a process's log file is
        self.killed = False
        self.relay = Relay(FanIn.of(app), poll_interval=0.2)
        self.error: BaseException | None = None
        self._lines: list[str] = []
        self._handler = _Lines(self._lines)
        logging.getLogger("celery_fanin").addHandler(self._handler)
        self._thread = threading.Thread(target=self._run, name="fanin-test-relay", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self.relay.run()
        except BaseException as exc:  # noqa: BLE001 - reported by exited_badly, as a process's exit code would be
            self.error = exc

    def output(self) -> str:
        return "\n".join(self._lines)

    def terminate(self) -> None:
        self.relay.stop()

    def stop(self, timeout: float = 15) -> int:
        self.terminate()
        self._thread.join(timeout)
        logging.getLogger("celery_fanin").removeHandler(self._handler)
        return 0 if not self.exited_badly else 1

    @property
    def exited_badly(self) -> bool:
        return self.error is not None or self._thread.is_alive()


class _Lines(logging.Handler):
    def __init__(self, lines: list[str]) -> None:
        super().__init__()
        self.lines = lines
        self.setFormatter(logging.Formatter("[%(asctime)s: %(levelname)s/%(name)s] %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


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
        # a URL of several hosts too (tests/ha), read as the library reads it
        with psycopg.connect(libpq_conninfo(e2e_env["FANIN_DATABASE_URL"]), autocommit=True) as conn:
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
