"""Shared fixtures: a private, migrated Postgres database for the session and a clean Redis database.

Every test talks to the real services. A service that cannot be reached fails the run (it never skips): the
suite's claims are about Postgres and a real broker, and a skipped claim is an untested one.

Nothing a session uses is shared with another session on the machine (its database, its Redis database number,
its RabbitMQ queues, its roles, its ports), so `make test` runs several side by side: each pytest-xdist worker is a
session of its own.
"""

from __future__ import annotations

import ast
import atexit
import gc
import os
import shutil
import socket
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
import redis
from celery import Celery
from sqlalchemy import Engine

from celery_fanin import FanIn
from tests.store.helpers import Tasks, define_tasks, make_engine

DEFAULT_ADMIN_URL = "postgresql://root@127.0.0.1:5432/postgres"

_ast_parse = ast.parse
# One parse at a time: another thread's must not re-enable the collector mid-parse. Reentrant: a signal handler
# (pytest-timeout's stack dump formats tracebacks) may parse in the thread that holds it.
_parse_lock = threading.RLock()


def _parse_with_the_collector_off(*args: Any, **kwargs: Any) -> Any:
    """`ast.parse` for this test process, the garbage collector held off while it runs.

    CPython 3.11 keeps the AST builder's recursion depth per interpreter (python/cpython gh-106905). A collection
    in the middle of a parse may run a finalizer that parses source too (SQLAlchemy logging an abandoned pooled
    connection's failed reset: 3.11's traceback parses the failing line for its carets), or that waits and lets
    another thread parse; the outer parse then raises "SystemError: AST constructor recursion depth mismatch".
    It failed hypothesis's source digest of the protocol model (CI, 2026-12-02; the connection was one kombu's
    SQLAlchemy channel left checked out in tests/test_embedded.py, closed there now) and test_docs's parses before.
    Every caller goes through here: traceback, inspect, hypothesis, pytest's assertion rewriting."""
    with _parse_lock:
        enabled = gc.isenabled()
        gc.disable()
        try:
            return _ast_parse(*args, **kwargs)
        finally:
            if enabled:
                gc.enable()


ast.parse = _parse_with_the_collector_off


def _admin_url() -> str:
    """`FANIN_TEST_ADMIN_URL`, else the local PostgreSQL; if none is reachable, a private embedded server for the
    session (celery_fanin.embedded), so that the suite runs on a machine without PostgreSQL. CI has one."""
    configured = os.environ.get("FANIN_TEST_ADMIN_URL")
    if configured:
        return configured
    from celery_fanin.embedded import EmbeddedPostgres, EmbeddedPostgresError, reachable

    if reachable(DEFAULT_ADMIN_URL, timeout=3):
        return DEFAULT_ADMIN_URL
    base = tempfile.mkdtemp(prefix="fanin-test-pg-")
    os.chmod(base, 0o755)  # run as root, the server runs as another user, which must reach its data directory
    server = EmbeddedPostgres(os.path.join(base, "pg"), database="postgres", ephemeral=True)
    try:
        server.start()
    except EmbeddedPostgresError as exc:
        print(f"no PostgreSQL at {DEFAULT_ADMIN_URL}, and the embedded server did not start: {exc}")
        return DEFAULT_ADMIN_URL  # the first test that needs it fails with "not reachable"
    atexit.register(lambda: (server.stop(), shutil.rmtree(base, ignore_errors=True)))
    os.environ["FANIN_TEST_ADMIN_URL"] = server.admin_url  # for the processes this session starts
    return server.admin_url


ADMIN_URL = _admin_url()
# A Redis server; each test session claims a database number of its own on it (see `redis_url`).
REDIS_SERVER = os.environ.get("FANIN_TEST_REDIS_SERVER", "redis://127.0.0.1:6379")
REDIS_CLAIM_KEY = "fanin-test-session"
# Emptied before each test that asks for a clean database (saga steps and compensations go with their saga).
TABLES = ("fanin_outbox", "fanin_successors", "fanin_children", "fanin_batches", "fanin_sagas")


def _admin() -> psycopg.Connection:
    try:
        return psycopg.connect(ADMIN_URL, autocommit=True, connect_timeout=5)
    except psycopg.OperationalError as exc:  # a missing service is a failure, not a skip
        pytest.fail(f"PostgreSQL is not reachable at {ADMIN_URL}: {exc}", pytrace=False)


@pytest.fixture(scope="session")
def database_url() -> Iterator[str]:
    """A database of its own for this test session (dropped at the end), migrated once."""
    name = f"fanin_test_{uuid.uuid4().hex[:10]}"
    with _admin() as admin:
        admin.execute(f'CREATE DATABASE "{name}"')  # a generated identifier, not input
    base = ADMIN_URL.rsplit("/", 1)[0]
    url = f"{base}/{name}"
    # Not put in os.environ: a test that needs the database asks for a fixture, and hands the URL to the processes
    # it starts (e2e_env), so that no test passes only because another one ran first.
    app = Celery("fanin-migrate")
    app.conf.fanin_database_url = url
    fanin = FanIn(app)
    fanin.migrate()
    fanin.dispose()
    try:
        yield url
    finally:
        with _admin() as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """A Redis database number no other test session is using (claimed with SET NX), so that sessions running
    side by side never share a queue."""
    token = uuid.uuid4().hex
    for db in range(15, 0, -1):
        client = redis.Redis.from_url(f"{REDIS_SERVER}/{db}")
        try:
            claimed = client.set(REDIS_CLAIM_KEY, token, nx=True, ex=3600)
        except redis.RedisError as exc:
            pytest.fail(f"Redis is not reachable at {REDIS_SERVER}: {exc}", pytrace=False)
        if claimed:
            break
    else:
        pytest.fail("every Redis database from 1 to 15 is claimed by another test session", pytrace=False)
    url = f"{REDIS_SERVER}/{db}"
    _redis_claims[url] = token
    try:
        yield url
    finally:
        if client.get(REDIS_CLAIM_KEY) == token.encode():
            client.delete(REDIS_CLAIM_KEY)


@pytest.fixture
def fresh_db() -> Iterator[Callable[[], str]]:
    """`fresh_db()`: the URL of a new empty database (no schema at all); every one is dropped after the test."""
    names: list[str] = []

    def create() -> str:
        name = f"fanin_fresh_{uuid.uuid4().hex[:10]}"
        with _admin() as admin:
            admin.execute(f'CREATE DATABASE "{name}"')  # a generated identifier, not input
        names.append(name)
        return f"{ADMIN_URL.rsplit('/', 1)[0]}/{name}"

    try:
        yield create
    finally:
        with _admin() as admin:
            for name in names:
                admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def clean_db(database_url: str) -> str:
    """The session database with every celery-fanin table emptied."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("TRUNCATE " + ", ".join(TABLES) + " RESTART IDENTITY CASCADE")
    return database_url


# redis_url -> this session's claim token: the claim is set again if Redis lost it (a Redis restarted without
# persistence forgets every key), so that no other session takes this database number meanwhile.
_redis_claims: dict[str, str] = {}


@pytest.fixture
def clean_redis(redis_url: str) -> str:
    """The session's Redis database, emptied but for its claim (restored if Redis lost it)."""
    client = redis.Redis.from_url(redis_url)
    token = _redis_claims[redis_url]
    client.set(REDIS_CLAIM_KEY, token, nx=True, ex=3600)
    holder = client.get(REDIS_CLAIM_KEY)
    if holder != token.encode():
        pytest.fail(f"Redis database {redis_url} was claimed by another test session meanwhile", pytrace=False)
    client.flushdb()
    client.set(REDIS_CLAIM_KEY, token, ex=3600)
    return redis_url


@pytest.fixture
def app(clean_db: str, clean_redis: str) -> Iterator[Celery]:
    """An in-process Celery app wired with FanIn against the test database and broker (for producer-side tests)."""
    application = Celery("fanin-tests", broker=clean_redis, set_as_current=False)
    application.conf.fanin_database_url = clean_db
    application.conf.broker_connection_retry_on_startup = False
    FanIn(application)
    yield application
    FanIn.of(application).dispose()


@pytest.fixture
def engine(app: Celery) -> Engine:
    return FanIn.of(app).engine


@pytest.fixture
def e2e_env(clean_db: str, clean_redis: str) -> dict[str, str]:
    """The environment worker and relay subprocesses get: the test database and broker, and a clean table in
    which the successor task records its runs."""
    from tests.app import RUNS_TABLE_DDL

    with psycopg.connect(clean_db, autocommit=True) as conn:
        conn.execute(RUNS_TABLE_DDL)
        conn.execute("TRUNCATE e2e_successor_runs")
    return {"FANIN_DATABASE_URL": clean_db, "FANIN_TEST_BROKER": clean_redis}


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("chaos")
    group.addoption("--chaos-scale", type=float, default=1.0, help="chaos suite size and duration multiplier")
    group.addoption("--chaos-seed", type=int, default=None, help="chaos suite random seed (default: new, printed)")
    # Here rather than in tests/model/conftest.py, so that they are known however pytest is called.
    model = parser.getgroup("model")
    model.addoption("--model-examples", type=int, default=None, help="protocol model: cases to run (default: CI's)")
    model.addoption("--model-steps", type=int, default=None, help="protocol model: steps per case")


@pytest.fixture
def direct(clean_db: str) -> Iterator[Engine]:
    """An engine of its own on the test database, beside the app's (whose pool a test may break or proxy)."""
    from tests.store.helpers import make_engine

    engine = make_engine(clean_db)
    yield engine
    engine.dispose()


# --- what the tests below the process packages share: a throwaway database, an engine on the clean test database,
# the broker's Redis, the tasks of tests/store/helpers.py, a dead broker ------------------------------------------


@pytest.fixture
def fresh_db_url(fresh_db: Callable[[], str]) -> str:
    """An empty database of its own (no schema at all), dropped after the test."""
    return fresh_db()


@pytest.fixture
def store_engine(clean_db: str) -> Iterator[Engine]:
    """An engine on the emptied session database, big enough for one connection per racing thread."""
    engine = make_engine(clean_db, pool_size=20)
    yield engine
    engine.dispose()


@pytest.fixture
def broker(clean_redis: str) -> Iterator[redis.Redis]:
    """The (flushed) Redis database the `app` fixture publishes to."""
    client = redis.Redis.from_url(clean_redis)
    yield client
    client.close()


@pytest.fixture
def tasks(app: Celery) -> Tasks:
    return define_tasks(app)


@pytest.fixture
def closed_port() -> Iterator[int]:
    """A local port that is bound but not listening: connecting to it is refused at once, for the whole test."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    yield sock.getsockname()[1]
    sock.close()


@pytest.fixture
def dead_broker_app(clean_db: str, clean_redis: str, closed_port: int) -> Iterator[Celery]:
    """A producer app on the same database whose broker refuses connections; it fails fast instead of retrying."""
    application = Celery("fanin-dead-broker", broker=f"redis://127.0.0.1:{closed_port}/0", set_as_current=False)
    application.conf.fanin_database_url = clean_db
    application.conf.broker_connection_retry = False
    application.conf.broker_connection_retry_on_startup = False
    application.conf.broker_connection_max_retries = 0
    application.conf.broker_connection_timeout = 2
    application.conf.task_publish_retry_policy = {"max_retries": 0}
    FanIn(application)
    yield application
    FanIn.of(application).dispose()
