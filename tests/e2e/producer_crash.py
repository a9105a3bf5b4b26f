"""A producer that dies by SIGKILL after its batch is committed, before or while publishing the children.

Run as `python -m tests.e2e.producer_crash N_CHILDREN KILL_ON_CHUNK [--stream KEY]`: prints the batch id, then kills
itself on the KILL_ON_CHUNK-th chunk it publishes (1 = before publishing anything). With --stream the children come
from a generator under KEY, written in chunks of 500. Fault injection for the recovery and resumption tests.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Any

from celery_fanin import fan_in_group
from celery_fanin.broker import confirms, publish
from celery_fanin.store import batches
from tests import app as tasks
from tests.workers import ROOT


def run_killed(env: dict[str, str], *args: str, timeout: float = 60) -> str:
    """Run this module in a subprocess with `env` and `args` (as above), check that it was killed; its batch id."""
    proc = subprocess.run(
        [sys.executable, "-m", "tests.e2e.producer_crash", *args],
        cwd=ROOT,
        env={**os.environ, **env, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == -9, proc.stdout + proc.stderr
    return proc.stdout.split()[0]


def main() -> None:
    n, kill_on = int(sys.argv[1]), int(sys.argv[2])
    stream_key = sys.argv[4] if len(sys.argv) > 4 and sys.argv[3] == "--stream" else None
    tasks.app.conf.fanin_chunk_size = 500 if stream_key else 10
    calls = {"n": 0}
    real = publish.publish_children

    def crashing(*args: Any, **kwargs: Any) -> confirms.Unconfirmed:
        calls["n"] += 1
        if calls["n"] == kill_on:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*args, **kwargs)

    publish.publish_children = crashing  # type: ignore[assignment]
    original_insert = batches.insert_batch

    def insert_and_announce(conn: Any, batch: Any, **kwargs: Any) -> Any:
        if kwargs.get("parent_id") is None:
            print(batch.id, flush=True)
        return original_insert(conn, batch, **kwargs)

    batches.insert_batch = insert_and_announce  # type: ignore[assignment]
    if stream_key:  # a generator, written chunk by chunk under a key: the rerun resumes it
        source = (tasks.ok.s(i) for i in range(n))
        fan_in_group(source, then=tasks.record_run.s("resumed"), key=stream_key).apply_async()
    else:
        fan_in_group([tasks.ok.s(i) for i in range(n)], then=tasks.record_run.s("crash")).apply_async()
    print("producer was not killed", flush=True)


if __name__ == "__main__":
    main()
