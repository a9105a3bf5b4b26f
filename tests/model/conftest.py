"""The protocol model's databases and settings; its options (`--model-examples N`, `--model-steps N`, for a long
run) are registered in tests/conftest.py.

Scratch databases, each migrated when made and dropped when the test that made it ends (with its engine: a
session that kept them all ran out of PostgreSQL's 100 connections in CI's `make breakages`, 2026-12-04): the model
runs in one, and each breakage (test_breakages.py) alters the functions of one of its own.
"""

from __future__ import annotations

import sys
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

from celery_fanin.store import migrate
from tests.conftest import ADMIN_URL, _admin

from .machine import dispose_engine, engine_for

if sys.version_info < (3, 11):  # builtin from 3.11; hypothesis depends on the backport before
    from exceptiongroup import BaseExceptionGroup


@pytest.fixture
def scratch_db() -> Iterator[Callable[[], str]]:
    """`scratch_db()`: the URL of a new database with the whole schema migrated; each is dropped at the test's end."""
    names: list[str] = []

    def create() -> str:
        names.append(f"fanin_model_{uuid.uuid4().hex[:10]}")
        with _admin() as admin:
            admin.execute(f'CREATE DATABASE "{names[-1]}"')  # a generated identifier, not input
        url = f"{ADMIN_URL.rsplit('/', 1)[0]}/{names[-1]}"
        migrate.migrate(engine_for(url))
        return url

    try:
        yield create
    finally:
        for name in names:
            dispose_engine(f"{ADMIN_URL.rsplit('/', 1)[0]}/{name}")
        with _admin() as admin:
            for name in names:
                admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def model_settings(examples: int, steps: int, **extra: Any) -> settings:
    """The hypothesis settings of a model run: no deadline (a step waits on locks), no example database (a
    case replays against a database that no longer exists), every health check off (steps are slow by design)."""
    return settings(
        max_examples=examples,
        stateful_step_count=steps,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        database=None,
        **extra,
    )


def model_budget(config: pytest.Config, examples: int, steps: int) -> tuple[int, int]:
    """(examples, steps per example): the CI budget given, or the command line's."""
    given = config.getoption("--model-examples", default=None)
    given_steps = config.getoption("--model-steps", default=None)
    return (given if given is not None else examples, given_steps if given_steps is not None else steps)


# A breakage's search that missed is run again, with a seed of its own, at most this many times in all. Each search
# is randomized on purpose: hypothesis's `ci` profile (loaded when CI is set) derandomizes, so that every search of a
# test would repeat the first one exactly (CI of 92f00d0 ran one case's three searches step for step alike).
SEARCHES = 5


def leaves(exc: BaseException) -> list[BaseException]:
    """The errors an exception group (hypothesis's several distinct failures, or a `FlakyFailure`) holds, flattened."""
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in leaves(inner)]
    return [exc]
