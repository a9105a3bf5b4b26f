"""Durations as documented (docs/reference/settings.md, the API reference): every duration option and setting takes
seconds as well as a timedelta, and `fanin_child_timeout = None` means no timeout, not the 6-hour default."""

from __future__ import annotations

import dataclasses
import uuid
from datetime import timedelta
from typing import Any

import pytest
from celery import Celery
from sqlalchemy import Engine, text

from celery_fanin import FanIn, InvalidFanIn, fan_in_group, saga
from celery_fanin.context import DURATIONS, NONE_ALLOWED, Settings
from tests.store.helpers import Tasks


def _stored_timeouts(engine: Engine, batch_id: str) -> tuple[Any, Any]:
    with engine.connect() as conn:
        row = conn.execute(
            text("SELECT child_timeout, deadline_at - created_at AS left FROM fanin_batches WHERE id = :id"),
            {"id": uuid.UUID(batch_id)},
        ).one()
    return row.child_timeout, row.left


def test_child_timeout_setting_none_means_no_timeout(app: Celery, tasks: Tasks, store_engine: Engine) -> None:
    app.conf.fanin_child_timeout = None
    assert FanIn.of(app).settings.child_timeout is None
    assert Settings.from_conf(app.conf).child_timeout is None
    handle = fan_in_group([tasks.add.s(1, 1)], then=tasks.collect.s()).apply_async()
    assert _stored_timeouts(store_engine, handle.batch_id)[0] is None  # the relay's reaper skips NULL timeouts


def test_child_timeout_setting_unset_keeps_the_default(app: Celery, tasks: Tasks, store_engine: Engine) -> None:
    handle = fan_in_group([tasks.add.s(1, 1)], then=tasks.collect.s()).apply_async()
    assert _stored_timeouts(store_engine, handle.batch_id)[0] == timedelta(hours=6)


@pytest.mark.parametrize("value", [timedelta(minutes=5), 300, 300.0], ids=["timedelta", "int", "float"])
def test_child_timeout_setting_takes_seconds_or_a_timedelta(
    app: Celery, tasks: Tasks, store_engine: Engine, value: Any
) -> None:
    app.conf.fanin_child_timeout = value
    handle = fan_in_group([tasks.add.s(1, 1)], then=tasks.collect.s()).apply_async()
    assert _stored_timeouts(store_engine, handle.batch_id)[0] == timedelta(minutes=5)


@pytest.mark.parametrize("value", [timedelta(hours=1), 3600, 3600.0], ids=["timedelta", "int", "float"])
def test_deadline_takes_seconds_or_a_timedelta(app: Celery, tasks: Tasks, store_engine: Engine, value: Any) -> None:
    group = fan_in_group([tasks.add.s(1, 1)], then=tasks.collect.s(), deadline=value)
    assert group._policy(FanIn.of(app)).deadline == timedelta(hours=1)
    handle = group.apply_async()
    _, left = _stored_timeouts(store_engine, handle.batch_id)
    # deadline_at is taken before the batch's transaction starts: within the hour of created_at, and not far.
    assert timedelta(minutes=59) < left <= timedelta(hours=1)


@pytest.mark.parametrize("value", [0, -1, float("nan"), float("inf"), 1e300, True])
def test_a_bad_deadline_in_seconds_is_refused(app: Celery, tasks: Tasks, value: Any) -> None:
    with pytest.raises(InvalidFanIn, match="deadline must be a"):
        fan_in_group([tasks.add.s(1, 1)], then=tasks.collect.s(), deadline=value).apply_async()


def test_a_nested_deadline_in_seconds_travels_as_seconds(app: Celery, tasks: Tasks) -> None:
    inner = fan_in_group([tasks.add.s(1, 1)], then=tasks.collect.s(), deadline=90)
    spec = inner.to_spec("child 0")
    assert spec["options"]["deadline"] == 90
    assert type(inner).from_spec(app, spec)._policy(FanIn.of(app)).deadline == timedelta(seconds=90)


def test_saga_compensation_timeout_takes_seconds_or_a_timedelta(app: Celery, tasks: Tasks) -> None:
    for value in (timedelta(minutes=2), 120, 120.0):
        _, timeout = saga(tasks.add.s(1, 1), compensation_timeout=value)._validate(app)
        assert timeout == timedelta(minutes=2)


@pytest.mark.parametrize("name", sorted(DURATIONS))
def test_every_duration_setting_takes_a_timedelta(app: Celery, name: str) -> None:
    app.conf[f"fanin_{name}"] = timedelta(seconds=42)
    fanin = FanIn.of(app)
    assert getattr(fanin.settings, name) == 42.0
    assert getattr(Settings.from_conf(app.conf), name) == 42.0


def test_the_duration_settings_are_the_float_settings() -> None:
    """A new float setting is a duration (and takes a timedelta) unless it is added here on purpose."""
    floats = {f.name for f in dataclasses.fields(Settings) if "float" in str(f.type)}
    assert floats == DURATIONS
    assert NONE_ALLOWED <= DURATIONS
