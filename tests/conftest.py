"""Shared fixtures: a private, migrated Postgres database for the session and a clean Redis database.

Every test talks to the real services. A service that cannot be reached fails the run (it never skips): the
suite's claims are about Postgres and a real broker, and a skipped claim is an untested one.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import psycopg
import pytest
import redis
from celery import Celery
from sqlalchemy import Engine

from celery_fanin import FanIn

ADMIN_URL = os.environ.get("FANIN_TEST_ADMIN_URL", "postgresql://root@127.0.0.1:5432/postgres")
REDIS_URL = os.environ.get("FANIN_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
TABLES = ("fanin_outbox", "fanin_successors", "fanin_children", "fanin_batches")


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
    os.environ["FANIN_DATABASE_URL"] = url
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
def redis_url() -> str:
    client = redis.Redis.from_url(REDIS_URL)
    try:
        client.ping()
    except redis.RedisError as exc:
        pytest.fail(f"Redis is not reachable at {REDIS_URL}: {exc}", pytrace=False)
    return REDIS_URL


@pytest.fixture
def clean_db(database_url: str) -> str:
    """The session database with every celery-fanin table emptied."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("TRUNCATE " + ", ".join(TABLES) + " RESTART IDENTITY CASCADE")
    return database_url


@pytest.fixture
def clean_redis(redis_url: str) -> str:
    redis.Redis.from_url(redis_url).flushdb()
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
