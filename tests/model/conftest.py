"""The protocol model's options and its database: `--model-examples N` (and `--model-steps N`) for a long run.

A database of its own, migrated once per session and dropped at the end: the breakage tests alter its functions
in scratch databases of their own (see test_breakages.py), never in this one.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator

import psycopg
import pytest
from celery import Celery

from celery_fanin import FanIn
from tests.conftest import ADMIN_URL

from .machine import dispose_engines


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("model")
    group.addoption(
        "--model-examples", type=int, default=None, help="protocol model: examples to run (default: the CI budget)"
    )
    group.addoption("--model-steps", type=int, default=None, help="protocol model: steps per example")


def _admin() -> psycopg.Connection:
    return psycopg.connect(ADMIN_URL, autocommit=True, connect_timeout=5)


@pytest.fixture(scope="session")
def scratch_db() -> Iterator[Callable[[], str]]:
    """`scratch_db()`: the URL of a new database with the whole schema migrated; each is dropped at the end."""
    names: list[str] = []

    def create() -> str:
        name = f"fanin_model_{uuid.uuid4().hex[:10]}"
        with _admin() as admin:
            admin.execute(f'CREATE DATABASE "{name}"')  # a generated identifier, not input
        names.append(name)
        url = f"{ADMIN_URL.rsplit('/', 1)[0]}/{name}"
        app = Celery("fanin-model-migrate")
        app.conf.fanin_database_url = url
        fanin = FanIn(app)
        fanin.migrate()
        fanin.dispose()
        return url

    try:
        yield create
    finally:
        dispose_engines()
        with _admin() as admin:
            for name in names:
                admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def model_budget(config: pytest.Config, examples: int, steps: int) -> tuple[int, int]:
    """(examples, steps per example): the CI budget given, or the command line's."""
    given = config.getoption("--model-examples", default=None)
    given_steps = config.getoption("--model-steps", default=None)
    return (given if given is not None else examples, given_steps if given_steps is not None else steps)
