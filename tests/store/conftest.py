"""Fixtures for the store tests: a throwaway database, an engine on the clean test database, the broker's Redis."""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator

import psycopg
import pytest
import redis
from celery import Celery
from sqlalchemy import Engine

from celery_fanin import FanIn
from tests.conftest import ADMIN_URL

from .helpers import Tasks, define_tasks, make_engine


def _admin() -> psycopg.Connection:
    return psycopg.connect(ADMIN_URL, autocommit=True, connect_timeout=5)


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
