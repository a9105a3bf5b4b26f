"""`fan_in_schedule`: the beat entry's slot key, computed when beat sends it (no database: nothing is written)."""

from __future__ import annotations

import pickle
from datetime import timedelta

import pytest
from celery import Celery
from celery.beat import BeatLazyFunc
from celery.schedules import crontab, schedule

from celery_fanin import FanInGroup, InvalidFanIn, fan_in_group, fan_in_schedule
from celery_fanin.producer.schedule import slot_key


@pytest.fixture
def plan() -> FanInGroup:
    app = Celery("schedule-tests", set_as_current=False)
    return fan_in_group([app.signature("t.child", args=(1,))], then=app.signature("t.merge"), app=app)


def test_ticks_in_one_slot_share_a_key_and_the_next_slot_does_not() -> None:
    assert slot_key("beat:n", 300, 1_000_000_200.0) == slot_key("beat:n", 300, 1_000_000_499.9)
    assert slot_key("beat:n", 300, 1_000_000_500.0) != slot_key("beat:n", 300, 1_000_000_499.9)
    assert slot_key("beat:n", None, 120.0) == "beat:n:1970-01-01T00:02:00+00:00"  # a crontab: the minute


def test_the_entry_runs_run_canvas_with_a_lazy_slot_key(plan: FanInGroup) -> None:
    plan.freeze()  # a frozen id would make every slot the same batch: the entry drops it
    entry = pickle.loads(pickle.dumps(fan_in_schedule("nightly", plan, timedelta(minutes=5), options={"queue": "q"})))
    assert entry["task"] == "celery_fanin.run_canvas" and entry["options"] == {"queue": "q"}
    assert isinstance(entry["kwargs"]["key"], BeatLazyFunc) and entry["kwargs"]["key"]().startswith("beat:nightly:")
    assert "task_id" not in entry["kwargs"]["canvas"]["options"]
    assert "fanin_batch_id" not in entry["kwargs"]["canvas"]["options"]
    keyed = fan_in_schedule("nightly", plan.evolve(key="sync"), schedule(60))
    assert keyed["kwargs"]["key"]().startswith("sync:")
    assert fan_in_schedule("cron", plan, crontab(minute="*/5"))["kwargs"]["key"]().endswith(":00+00:00")


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda p: fan_in_schedule("", p, 60), "needs a name"),
        (lambda p: fan_in_schedule("n", p.then, 60), "takes a fan_in_group"),
        (lambda p: fan_in_schedule("n", p.evolve(children=iter([])), 60), "needs a list of children"),
        (lambda p: fan_in_schedule("n", p, -1), "positive number of seconds"),
        (lambda p: fan_in_schedule("n", p, 60, args=(1,)), "unknown beat entry fields: args"),
    ],
)
def test_bad_entries_are_refused(plan: FanInGroup, build: object, message: str) -> None:
    with pytest.raises(InvalidFanIn, match=message):
        build(plan)  # type: ignore[operator]
