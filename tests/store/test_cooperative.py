"""`store.cooperative`: under eventlet, psycopg's statements let the other green threads run (each case in a fresh
interpreter, since eventlet's monkey-patching cannot be undone)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.workers import ROOT

pytestmark = pytest.mark.timeout(60)

# Three green threads, each a one-second statement on the worker's report connection: together in about one second
# if they cooperate, three if each blocks the hub.
SCRIPT = """
import eventlet
eventlet.monkey_patch()
import sys, time
from celery_fanin.store.reports import ReportConnection
from celery_fanin.store.statements import Statement
from psycopg import waiting

reports = ReportConnection(sys.argv[1])
sleep = Statement("sleep", "", "SELECT pg_sleep(1)")
started = time.monotonic()
pool = eventlet.GreenPool()
for _ in range(3):
    pool.spawn(reports.one, sleep, {})
pool.waitall()
print(waiting.wait.__name__, round(time.monotonic() - started, 2))
"""


def test_statements_of_green_threads_run_together_under_eventlet(clean_db: str) -> None:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(SCRIPT), clean_db],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=45,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    wait, took = out.stdout.split()
    assert wait == "wait_select"
    assert float(took) < 2.0, f"three one-second statements took {took}s: each blocked the hub"


def test_without_eventlet_psycopg_keeps_its_own_wait() -> None:
    code = "from celery_fanin.store import cooperative; from psycopg import waiting; w = waiting.wait; "
    code += "print(cooperative.ensure(), waiting.wait is w)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert out.stdout.split() == ["False", "True"], out.stderr[-2000:]
