"""celery-fanin as a user installs it: a wheel built from this checkout, `pip install "celery-fanin[redis,binary]"`
into a new venv (not editable, nothing of the suite's own venv), then `fanin migrate`, a real `celery worker` and a
batch, all run from that venv in a directory away from the checkout.

`[redis]` once installed only redis-py, and the worker stopped with `No module named 'packaging'` (kombu's Redis
transport imports it; only `kombu[redis]`, through `celery[redis]`, brings it). `[binary]`: psycopg's wheel, so the
test does not depend on the machine's libpq. pip resolves from the same index and wheel cache as `make install`
(about 20 s here), so the test runs in `make test`; its timeout leaves room for a slow index."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.workers import ROOT, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

PROJ = """
import os

from celery import Celery

from celery_fanin import FanIn

app = Celery("proj", broker=os.environ["PROJ_BROKER"])
app.conf.fanin_database_url = os.environ["FANIN_DATABASE_URL"]
FanIn(app)


@app.task
def double(i):
    return 2 * i


@app.task
def total(outcome):
    return None
"""

PRODUCER = """
from celery_fanin import fan_in_group

from proj import app, double, total

handle = fan_in_group([double.s(i) for i in range(3)], then=total.s(), app=app).apply_async()
status = handle.wait_batch(timeout=60)
print("SUCCESSOR", status.successor_state, status.succeeded)
"""


def _pip(venv: Path, *args: str) -> None:
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "-q", *args], check=True, timeout=240)


def test_a_clean_install_with_the_redis_extra_runs_a_worker_and_a_batch(
    tmp_path: Path, fresh_db: Callable[[], str], clean_redis: str
) -> None:
    # Built from a copy: setuptools' build/ in the checkout could keep a module since removed and package it.
    src = tmp_path / "src"
    shutil.copytree(
        ROOT, src, ignore=shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", ".*cache", ".fanin")
    )
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dist), str(src)], check=True, timeout=240
    )
    (wheel,) = dist.glob("celery_fanin-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    _pip(venv, "install", f"celery-fanin[redis,binary] @ {wheel.as_uri()}")

    work = tmp_path / "proj"  # away from the checkout: nothing imports the repository's celery_fanin by accident
    work.mkdir()
    (work / "proj.py").write_text(textwrap.dedent(PROJ))
    (work / "producer.py").write_text(textwrap.dedent(PRODUCER))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update(FANIN_DATABASE_URL=fresh_db(), PROJ_BROKER=clean_redis, PYTHONUNBUFFERED="1")
    python, celery = str(venv / "bin" / "python"), str(venv / "bin" / "celery")

    where = subprocess.run(
        [python, "-c", "import celery_fanin; print(celery_fanin.__file__)"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert where.stdout.startswith(str(venv)), f"imported from {where.stdout}: not the installed package"
    subprocess.run([celery, "-A", "proj", "fanin", "migrate"], cwd=work, env=env, check=True, timeout=60)

    log = tmp_path / "worker.log"
    with log.open("w") as out:
        worker = subprocess.Popen(
            [celery, "-A", "proj", "worker", "-P", "solo", "-l", "INFO", "--without-gossip", "--without-mingle"],
            cwd=work,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        wait_for(lambda: " ready." in log.read_text() or worker.poll() is not None, 60, 0.2, "the worker's start")
        assert worker.poll() is None, log.read_text()
        produced = subprocess.run(
            [python, "producer.py"], cwd=work, env=env, capture_output=True, text=True, timeout=90
        )
        assert produced.returncode == 0, produced.stdout + produced.stderr + log.read_text()
        assert "SUCCESSOR succeeded 3" in produced.stdout, produced.stdout + log.read_text()
    finally:
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGTERM)
            try:
                worker.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(worker.pid, signal.SIGKILL)
                worker.wait(10)
