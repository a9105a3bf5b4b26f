"""A pytest plugin for applications that use celery-fanin: a migrated database, a wired app, eager fan-ins.

Off unless enabled (``celery_fanin = true`` in the ini file, or ``-p celery_fanin.testing``); the fixtures and
their options are in docs/how-to/testing.md.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import psycopg
import pytest
from celery import Celery
from celery.contrib.testing.worker import TestWorkController, start_worker
from celery.worker import WorkController
from psycopg import sql

from .context import dispose_all
from .embedded import EmbeddedPostgres
from .extension import FanIn
from .producer.eager import run_eagerly
from .producer.group import FanInGroup
from .producer.result import EagerFanInResult
from .relay.loop import Relay
from .store.reports import libpq_conninfo
from .store.urls import sqlalchemy_url
from .worker import guards

CONTRIB_PLUGIN = "celery.contrib.pytest"

PLUGIN_NAME = "celery_fanin.testing"
ENABLE_INI = "celery_fanin"
DATABASE_INI = "fanin_test_database_url"
DATABASE_ENV = "FANIN_TEST_DATABASE_URL"


def _add_ini(parser: pytest.Parser) -> None:
    # addini tolerates a second registration of the same name: the gate and the plugin may both be loaded.
    parser.addini(
        ENABLE_INI, "enable the celery-fanin pytest plugin (fixtures fanin_app, fanin_run, ...)", "bool", default=False
    )
    parser.addini(
        DATABASE_INI,
        "PostgreSQL URL of a test database for the celery-fanin fixtures (emptied before "
        f"each test); default ${DATABASE_ENV}, else an embedded server",
        default="",
    )


class _Gate:
    """What the `pytest11` entry point registers: the ini options, and the plugin itself when they enable it."""

    def pytest_addoption(self, parser: pytest.Parser) -> None:
        _add_ini(parser)

    def pytest_configure(self, config: pytest.Config) -> None:
        if config.getini(ENABLE_INI) and not config.pluginmanager.has_plugin(PLUGIN_NAME):
            config.pluginmanager.import_plugin(PLUGIN_NAME)

    @pytest.hookimpl(wrapper=True)
    def pytest_fixture_setup(self, fixturedef: Any, request: pytest.FixtureRequest) -> Any:
        result = yield
        if fixturedef.argname == "django_db_setup":
            # pytest-django drops its test database when this fixture ends, and PostgreSQL refuses while a session
            # is connected to it: the fan-in connections (`fanin_django_database` follows Django to that database)
            # close first. Finalizers run last added first, so this one runs before the fixture's own teardown.
            fixturedef.addfinalizer(dispose_all)
        return result


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


_MAX_IDENTIFIER = 63  # PostgreSQL's NAMEDATALEN - 1 bytes


def worker_database_name(database: str, worker: str) -> str:
    """The database a pytest-xdist worker uses instead of the configured one: `<database>_<worker>`, cut to fit."""
    suffix = f"_{worker}"
    base = database.encode()[: _MAX_IDENTIFIER - len(suffix.encode())].decode(errors="ignore")
    return base + suffix


@contextlib.contextmanager
def _worker_database(url: str, worker: str) -> Iterator[str]:
    """A database of this pytest-xdist worker's own beside the configured one, created on the same server by the
    same role, and dropped afterwards if it was created here.

    Each test empties the fan-in tables first: workers sharing one database would empty them under each other's
    running tests. A database that already exists (made beforehand by someone allowed to) is used as it is.
    """
    parsed = sqlalchemy_url(url)  # either several-host form too
    name = worker_database_name(parsed.database or "", worker)
    with psycopg.connect(libpq_conninfo(url), autocommit=True) as conn:
        exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone() is not None
        if not exists:
            try:
                conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
            except psycopg.errors.DuplicateDatabase:
                exists = True  # another run made it meanwhile: used, not dropped
            except psycopg.errors.InsufficientPrivilege as exc:
                pytest.fail(
                    f"celery-fanin: pytest-xdist worker {worker} needs a test database of its own, {name!r} beside "
                    f"{parsed.database!r}, and role {parsed.username!r} may not create it ({exc}). Grant the role "
                    f"CREATEDB, create {name!r} (and one per worker) beforehand, or run without -n.",
                    pytrace=False,
                )
    worker_url = parsed.set(database=name).render_as_string(hide_password=False)
    try:
        yield worker_url
    finally:
        if not exists:
            with psycopg.connect(libpq_conninfo(url), autocommit=True) as conn:
                conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


@pytest.fixture(scope="session")
def fanin_database_url(pytestconfig: pytest.Config) -> Iterator[str]:
    """A migrated database for the session: the configured test database (under pytest-xdist, one per worker
    beside it), or an embedded server's (one per worker process anyway)."""
    url = _configured_url(pytestconfig)
    if url is not None:
        # A pytest-xdist worker's config carries its id ("gw0", ...); its environment's PYTEST_XDIST_WORKER would
        # also reach a pytest that a test runs in a subprocess, which is no worker.
        worker = getattr(pytestconfig, "workerinput", {}).get("workerid")
        if not worker:
            _migrate(url)
            yield url
            return
        with _worker_database(url, worker) as worker_url:
            _migrate(worker_url)
            yield worker_url
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
        tables = [
            r[0]
            for r in conn.execute(
                "SELECT tablename FROM pg_tables WHERE schemaname = current_schema() AND tablename LIKE 'fanin\\_%%' "
                "AND tablename <> 'fanin_migrations'"
            )
        ]
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


# --- live workers ------------------------------------------------------------------------------------------------


def _contrib_fixture(request: pytest.FixtureRequest, name: str) -> Any:
    try:
        return request.getfixturevalue(name)
    except pytest.FixtureLookupError:
        pytest.fail(
            f"fanin_worker and fanin_relay run on {CONTRIB_PLUGIN}'s {name}: enable that plugin too "
            f'(-p {CONTRIB_PLUGIN}, or pytest_plugins = ["{CONTRIB_PLUGIN}", "{PLUGIN_NAME}"] in conftest.py)',
            pytrace=False,
        )


@pytest.fixture
def fanin_celery_app(request: pytest.FixtureRequest, fanin_database: str) -> Iterator[Celery]:
    """``celery.contrib.pytest``'s ``celery_app`` (configured by ``celery_config``), wired with FanIn on the test
    database, for ``fanin_worker`` and ``fanin_relay``."""
    celery_app: Celery = _contrib_fixture(request, "celery_app")
    if celery_app.conf.task_always_eager:
        pytest.fail("fanin_worker runs tasks on a worker: remove task_always_eager from celery_config", pytrace=False)
    celery_app.conf.fanin_database_url = fanin_database
    fanin = FanIn(celery_app)
    yield celery_app
    fanin.dispose()


@pytest.fixture
def fanin_worker(request: pytest.FixtureRequest, fanin_celery_app: Celery) -> Iterator[WorkController]:
    """A Celery worker in a thread of this process, consuming from ``celery_app``'s broker, with the fan-in hooks:
    children's outcomes are counted and successors run as on any worker. Stopped when the test ends. Its pool
    and options come from ``celery_worker_pool`` (``solo``) and ``celery_worker_parameters``."""
    pool = _contrib_fixture(request, "celery_worker_pool")
    parameters: Mapping[str, Any] = _contrib_fixture(request, "celery_worker_parameters")

    class FanInTestWorker(TestWorkController):
        def reload(self, modules: Any = None, reload: bool = False, reloader: Any = None) -> None:
            # Tasks defined after the worker started get the successor run guard a worker gives its tasks at start.
            guards.guard_tasks(self.app)
            super().reload(modules, reload=reload, reloader=reloader)

    # No ping task: it needs a result backend, which fan-ins do not (their results are in PostgreSQL).
    options = {"perform_ping_check": False, **parameters}
    with start_worker(fanin_celery_app, pool=pool, WorkController=FanInTestWorker, **options) as worker:
        yield worker


@contextlib.contextmanager
def running_relay(app: Celery, poll_interval: float = 0.1) -> Iterator[Relay]:
    """Run the relay of `app` (wired with FanIn) in a thread of this process until the block ends; yields it (its
    ``stats`` count what it did). For any test setup: `fanin_relay` uses it, and so can a pytest-celery suite."""
    relay = Relay(FanIn.of(app), poll_interval=poll_interval)
    thread = threading.Thread(target=relay.run, name="fanin-relay", daemon=True)
    thread.start()
    try:
        yield relay
    finally:
        relay.stop()
        thread.join(30)
    if thread.is_alive():
        raise RuntimeError("the relay thread did not stop within 30 s")


@pytest.fixture
def fanin_relay(fanin_celery_app: Celery) -> Iterator[Relay]:
    """The relay in a thread of this process, polling every 0.1 s; stopped (and waited for) when the test ends.
    Its ``stats`` count what it did (``successors_published``, ...)."""
    with running_relay(fanin_celery_app) as relay:
        yield relay
