"""docs/how-to/django.md's example (examples/django_orders), run with pytest-django in a pytest of its own (its
Django settings are the process's), against this session's database and broker."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import psycopg
from sqlalchemy.engine import make_url

from celery_fanin.store.reports import libpq_conninfo

ROOT = Path(__file__).resolve().parents[2]


def test_the_django_example_passes_its_own_tests(e2e_env: dict[str, str]) -> None:
    env = {
        **os.environ,
        "FANIN_DATABASE_URL": e2e_env["FANIN_DATABASE_URL"],
        "FANIN_BROKER_URL": e2e_env["FANIN_TEST_BROKER"],
        "FANIN_EXAMPLE_QUEUE": f"django-orders-{uuid.uuid4().hex[:8]}",
        "DJANGO_SETTINGS_MODULE": "examples.django_orders.settings",
        "PYTHONPATH": str(ROOT),
    }
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "examples/django_orders/tests",
            "-q",
            "-p",
            "no:randomly",
            "-p",
            "no:cacheprovider",
            "--timeout",
            "60",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "5 passed" in done.stdout
    # pytest-django dropped its test database: PostgreSQL refuses while a fan-in connection is open to it, and then
    # leaves it behind (celery-fanin's plugin closes them first). A second run would find it there.
    test_db = "test_" + make_url(e2e_env["FANIN_DATABASE_URL"]).database
    with psycopg.connect(libpq_conninfo(e2e_env["FANIN_DATABASE_URL"]), autocommit=True) as conn:
        left = conn.execute("SELECT datname FROM pg_database WHERE datname = %s", (test_db,)).fetchall()
    assert not left, f"pytest-django's test database {test_db} was left behind"
