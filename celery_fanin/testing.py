"""A pytest plugin for applications that use celery-fanin: a migrated database, a wired app, eager fan-ins.

Off unless enabled, like ``celery.contrib.pytest``. Enable it in one of these ways::

    # pytest.ini / pyproject.toml [tool.pytest.ini_options] / setup.cfg [tool:pytest]
    celery_fanin = true

    # or on the command line, or in a conftest.py
    pytest -p celery_fanin.testing
    pytest_plugins = ["celery_fanin.testing"]

The `pytest11` entry point only registers a small gate that reads the ini option; the fixtures below exist only
once the plugin is enabled, so installing celery-fanin adds nothing to other test suites.

Fixtures:

- ``fanin_database_url`` (session): a migrated PostgreSQL database. The ``fanin_test_database_url`` ini option
  or the ``FANIN_TEST_DATABASE_URL`` environment variable names one (its fan-in tables are emptied before each
  test that uses ``fanin_database``: point it at a test database only); without either, a private embedded
  server (``pip install "celery-fanin[embedded]"``) is started in a temporary directory for the session.
- ``fanin_database`` (function): the same URL, with every fan-in table emptied.
- ``fanin_celery_config`` (function): the configuration of ``fanin_app``; override it to change it. By default
  an in-memory broker and ``task_always_eager = True``.
- ``fanin_app`` (function): a Celery app wired with ``FanIn`` on ``fanin_database``. Override it to test your own
  app: set ``app.conf.fanin_database_url = fanin_database`` and call ``FanIn(app)``.
- ``fanin_run`` (function): ``fanin_run(fan_in_group(...))`` runs the fan-in to completion in this process (its
  children, then its successor, inline and eagerly, recorded in the database as a worker records them) and
  returns the handle; ``handle.status()`` has the counts, ``handle.successor().result`` the successor's return
  value.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from celery import Celery
from psycopg import sql

from .embedded import EmbeddedPostgres
from .extension import FanIn
from .producer.eager import run_eagerly
from .producer.group import FanInGroup
from .producer.result import EagerFanInResult
from .store.reports import libpq_conninfo

PLUGIN_NAME = "celery_fanin.testing"
ENABLE_INI = "celery_fanin"
DATABASE_INI = "fanin_test_database_url"
DATABASE_ENV = "FANIN_TEST_DATABASE_URL"


def _add_ini(parser: pytest.Parser) -> None:
    # addini tolerates a second registration of the same name: the gate and the plugin may both be loaded.
    parser.addini(ENABLE_INI, "enable the celery-fanin pytest plugin (fixtures fanin_app, fanin_run, ...)", "bool",
                  default=False)  # fmt: skip
    parser.addini(DATABASE_INI, "PostgreSQL URL of a test database for the celery-fanin fixtures (emptied before "
                  f"each test); default ${DATABASE_ENV}, else an embedded server", default="")  # fmt: skip


class _Gate:
    """What the `pytest11` entry point registers: the ini options, and the plugin itself when they enable it."""

    def pytest_addoption(self, parser: pytest.Parser) -> None:
        _add_ini(parser)

    def pytest_configure(self, config: pytest.Config) -> None:
        if config.getini(ENABLE_INI) and not config.pluginmanager.has_plugin(PLUGIN_NAME):
            config.pluginmanager.import_plugin(PLUGIN_NAME)


gate = _Gate()


# --- the plugin ----------------------------------------------------------------------------------------------------


def pytest_addoption(parser: pytest.Parser) -> None:
    _add_ini(parser)


def _configured_url(config: pytest.Config) -> str | None:
    try:
        value = config.getini(DATABASE_INI)
    except ValueError:  # not registered: the plugin was loaded after option parsing
        value = ""
    return str(value) or os.environ.get(DATABASE_ENV) or None


def _migrate(url: str) -> None:
    app = Celery("celery-fanin-testing-migrate", set_as_current=False)
    app.conf.fanin_database_url = url
    fanin = FanIn(app)
    try:
        fanin.migrate()
    finally:
        fanin.dispose()


@pytest.fixture(scope="session")
def fanin_database_url(pytestconfig: pytest.Config) -> Iterator[str]:
    """A migrated database for the session: the configured test database, or an embedded server's."""
    url = _configured_url(pytestconfig)
    if url is not None:
        _migrate(url)
        yield url
        return
    base = Path(tempfile.mkdtemp(prefix="celery-fanin-pytest-"))
    base.chmod(0o755)  # run as root, the server runs as another user, which must reach its data directory
    server = EmbeddedPostgres(base / "pg", database="fanin_test", ephemeral=True)
    try:
        url = server.start()
        _migrate(url)
        yield url
    finally:
        server.stop()
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def fanin_database(fanin_database_url: str) -> str:
    """The session database with every fan-in table emptied."""
    with psycopg.connect(libpq_conninfo(fanin_database_url), autocommit=True) as conn:
        tables = [r[0] for r in conn.execute(
            "SELECT tablename FROM pg_tables WHERE schemaname = current_schema() AND tablename LIKE 'fanin\\_%%' "
            "AND tablename <> 'fanin_migrations'"
        )]  # fmt: skip
        if tables:
            names = sql.SQL(", ").join(sql.Identifier(t) for t in tables)
            conn.execute(sql.SQL("TRUNCATE {} RESTART IDENTITY CASCADE").format(names))
    return fanin_database_url


@pytest.fixture
def fanin_celery_config() -> dict[str, Any]:
    """Configuration for `fanin_app` (override this fixture to change it)."""
    return {
        "broker_url": "memory://",
        "task_always_eager": True,
        "broker_connection_retry_on_startup": False,
    }


@pytest.fixture
def fanin_app(fanin_database: str, fanin_celery_config: dict[str, Any]) -> Iterator[Celery]:
    """A Celery app wired with FanIn on the test database; define tasks on it with ``@fanin_app.task``."""
    app = Celery("fanin-tests", set_as_current=False)
    app.conf.update(fanin_celery_config)
    app.conf.fanin_database_url = fanin_database
    fanin = FanIn(app)
    yield app
    fanin.dispose()


@pytest.fixture
def fanin_run() -> Callable[[FanInGroup], EagerFanInResult]:
    """``fanin_run(group)``: run a fan-in to completion in this process, eagerly, and return its handle."""

    def run(group: FanInGroup) -> EagerFanInResult:
        app = group.app
        conf = app.conf
        before = conf.task_always_eager
        conf.task_always_eager = True
        try:
            handle = group.apply_async()
            if isinstance(handle, EagerFanInResult):  # apply_async ran it eagerly itself
                return handle
            return run_eagerly(FanIn.of(app), handle.batch_id)
        finally:
            with contextlib.suppress(Exception):
                conf.task_always_eager = before

    return run
