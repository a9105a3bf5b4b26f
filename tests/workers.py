"""Real processes for the end-to-end tests: `celery worker` (prefork) and `celery fanin relay` subprocesses."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

ROOT = Path(__file__).resolve().parent.parent
T = TypeVar("T")


# A worker's environment for a test whose claim is the relay's own path for successors (its NOTIFY, its rounds,
# its metrics, what it does when the store or broker fails it): the worker leaves every successor to the relay
# (fanin_worker_publishes_successors off), as all workers did before they published their own.
RELAY_PUBLISHES = {"FANIN_TEST_WORKER_PUBLISHES": "0"}


def wait_for(condition: Callable[[], T], timeout: float, interval: float = 0.05, message: str = "condition") -> T:
    """Poll `condition` until it returns something truthy; fail the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {message}")
        time.sleep(interval)


class CeleryProcess:
    """A `celery -A tests.app ...` subprocess with its output captured in a log file."""

    def __init__(self, args: list[str], env: dict[str, str], log: Path, ready_marker: str | None) -> None:
        self.log = log
        self.ready_marker = ready_marker
        full_env = {**os.environ, **env, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
        self._log_file = log.open("w")
        self._terminated = False
        self.killed = False  # SIGKILLed on purpose (by a test, or after a shutdown that took too long)
        self.name = ""  # a worker's node name (set by start_worker)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "tests.app", *args],
            cwd=ROOT,
            env=full_env,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_ready(self, timeout: float = 30) -> None:
        if self.ready_marker is None:
            return
        marker = self.ready_marker

        def ready() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"process exited early ({self.proc.returncode}):\n{self.output()[-3000:]}")
            return marker in self.output()

        wait_for(ready, timeout, 0.1, f"{marker!r} in {self.log.name}")

    def pool_pids(self) -> list[int]:
        """The prefork pool processes (children of the worker's main process)."""
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True)
        return [int(p) for p in out.stdout.split()]

    def terminate(self) -> None:
        """Ask for a warm shutdown (SIGTERM) without waiting; `stop` then waits for it."""
        if self.proc.poll() is None and not self._terminated:
            self.proc.send_signal(signal.SIGTERM)
            self._terminated = True  # once: Celery may take a second SIGTERM as a cold shutdown

    def stop(self, timeout: float = 15) -> int:
        """Warm shutdown (SIGTERM), SIGKILL after `timeout`; returns the exit code (negative: killed by a signal)."""
        if self.proc.poll() is None:
            self.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log_file.close()
        return self.proc.returncode

    @property
    def exited_badly(self) -> bool:
        """Ended with a nonzero exit code although nobody SIGKILLed it on purpose: a crash, or an unclean stop."""
        return self.proc.returncode not in (None, 0) and not self.killed

    def kill(self) -> None:
        """SIGKILL the whole process group (main process and pool), as a crashed host would lose them."""
        if self.proc.poll() is None:
            self.killed = True
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


def start_worker(
    env: dict[str, str], log: Path, concurrency: int = 2, extra: list[str] | None = None, pool: str = "prefork"
) -> CeleryProcess:
    name = f"e2e-{os.getpid()}-{time.monotonic_ns()}@{socket.gethostname()}"
    worker = CeleryProcess(
        [
            "worker",
            "-P",
            pool,
            "-c",
            str(concurrency),
            "-l",
            "INFO",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
            "-n",
            name,
            *(extra or []),
        ],
        env,
        log,
        ready_marker="ready.",
    )
    worker.name = name  # the node name, for remote control commands sent to this worker alone
    worker.wait_ready()
    return worker


def start_relay(env: dict[str, str], log: Path) -> CeleryProcess:
    relay = CeleryProcess(["fanin", "relay", "--poll-interval", "0.2"], env, log, ready_marker="relay started")
    relay.wait_ready()
    return relay
