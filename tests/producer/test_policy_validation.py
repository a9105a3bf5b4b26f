"""Invalid recovery and scale options get a clear error before anything is written or published."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
import redis
from celery import Celery
from sqlalchemy import Engine

from celery_fanin import InvalidFanIn, fan_in_group
from tests.store.helpers import Tasks, row_counts

CASES: list[Any] = [
    pytest.param({"deadline": timedelta(seconds=-1)}, "deadline must be a positive timedelta", id="negative-deadline"),
    pytest.param({"deadline": datetime(2000, 1, 1, tzinfo=timezone.utc)}, "is in the past", id="past-deadline"),
    pytest.param(
        {"deadline": "tomorrow"}, "deadline must be a timedelta, a number of seconds or a datetime", id="deadline-type"
    ),
    pytest.param({"on_deadline": "later"}, "on_deadline must be 'proceed' or 'abandon'", id="on-deadline"),
    pytest.param({"child_timeout": -5}, "child_timeout must not be negative", id="negative-timeout"),
    pytest.param({"child_timeout": "5m"}, "child_timeout must be a timedelta or a number", id="timeout-type"),
    pytest.param({"on_lost": "retry"}, "on_lost must be 'fail' or 'redrive'", id="on-lost"),
    pytest.param({"max_redrives": -1}, "max_redrives must be a whole number", id="max-redrives"),
    pytest.param({"max_failures": -1}, "max_failures must be >= 0", id="negative-max-failures"),
    pytest.param({"max_failures": 1.5}, "ratio must be between 0 and 1", id="ratio-too-big"),
    pytest.param({"max_failures": True}, "max_failures must be a count", id="bool-max-failures"),
    pytest.param({"on_failure": "x"}, "on_failure is not a task signature", id="on-failure-type"),
    pytest.param({"max_width": 0}, "max_width must be a whole number >= 1", id="max-width"),
    pytest.param({"key": ""}, "key must be a non-empty string", id="empty-key"),
]


@pytest.mark.parametrize(("options", "message"), CASES)
def test_invalid_options_write_and_publish_nothing(
    app: Celery, tasks: Tasks, store_engine: Engine, broker: redis.Redis, options: dict[str, Any], message: str
) -> None:
    before = row_counts(store_engine)
    with pytest.raises(InvalidFanIn, match=message):
        fan_in_group([tasks.add.s(1, 1)], then=tasks.collect.s(), **options).apply_async()
    assert row_counts(store_engine) == before
    assert broker.llen("celery") == 0


def test_on_expire_needs_an_abandoning_deadline(app: Celery, tasks: Tasks, store_engine: Engine) -> None:
    with pytest.raises(InvalidFanIn, match="on_expire runs when a deadline abandons the batch"):
        fan_in_group([tasks.add.s(1, 1)], then=tasks.collect.s(), on_expire=tasks.collect.s()).apply_async()
    with pytest.raises(InvalidFanIn, match="on_failure runs when failures pass max_failures"):
        fan_in_group([tasks.add.s(1, 1)], then=tasks.collect.s(), on_failure=tasks.collect.s()).apply_async()
    assert sum(row_counts(store_engine).values()) == 0
