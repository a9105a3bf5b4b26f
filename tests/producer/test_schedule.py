"""`fan_in_schedule`: a plain-JSON beat entry whose slot key counts from the time beat sent it (no database:
nothing is written)."""

from __future__ import annotations

import json
import pickle
import time
from datetime import timedelta

import pytest
from celery import Celery
from celery.schedules import crontab, schedule

from celery_fanin import FanInGroup, InvalidFanIn, fan_in_group, fan_in_schedule
from celery_fanin.producer.schedule import key_of_slot, slot_key
from celery_fanin.protocol import stamp_slot


@pytest.fixture
def plan() -> FanInGroup:
    app = Celery("schedule-tests", set_as_current=False)
    return fan_in_group([app.signature("t.child", args=(1,))], then=app.signature("t.merge"), app=app)


def test_ticks_in_one_slot_share_a_key_and_the_next_slot_does_not() -> None:
    assert slot_key("beat:n", 300, 1_000_000_200.0) == slot_key("beat:n", 300, 1_000_000_499.9)
    assert slot_key("beat:n", 300, 1_000_000_500.0) != slot_key("beat:n", 300, 1_000_000_499.9)
    assert slot_key("beat:n", None, 120.0) == "beat:n:1970-01-01T00:02:00+00:00"  # a crontab: the minute


def test_the_entry_is_plain_json_and_its_message_is_stamped_with_its_send_time(plan: FanInGroup) -> None:
    plan.freeze()  # a frozen id would make every slot the same batch: the entry drops it
    entry = fan_in_schedule("nightly", plan, timedelta(minutes=5), options={"queue": "q"})
    kwargs = json.loads(json.dumps(entry["kwargs"]))  # as django-celery-beat stores it
    assert entry["task"] == "celery_fanin.run_canvas" and entry["options"] == {"queue": "q"}
    assert kwargs["slot"] == {"prefix": "beat:nightly", "period": 300.0}
    assert "task_id" not in kwargs["canvas"]["options"]
    assert "fanin_batch_id" not in kwargs["canvas"]["options"]
    assert pickle.loads(pickle.dumps(entry))["kwargs"] == entry["kwargs"]  # beat's own shelve pickles it
    # What the publisher's hook does to the message beat sends, and the key the worker reads from it.
    body = ((), kwargs, {})
    before = time.time()
    stamp_slot("celery_fanin.run_canvas", body)
    sent = kwargs["slot"]["sent_at"]
    assert before <= sent <= time.time()
    stamp_slot("celery_fanin.run_canvas", body)
    assert kwargs["slot"]["sent_at"] == sent, "a copy keeps the slot it was sent for"
    assert key_of_slot(kwargs["slot"], now=sent + 3600) == (slot_key("beat:nightly", 300.0, sent), True)
    assert key_of_slot({"prefix": "beat:nightly", "period": 300.0}, now=sent) == (
        slot_key("beat:nightly", 300, sent),
        False,
    )
    keyed = fan_in_schedule("nightly", plan.evolve(key="sync"), schedule(60))
    assert keyed["kwargs"]["slot"] == {"prefix": "sync", "period": 60.0}
    assert fan_in_schedule("cron", plan, crontab(minute="*/5"))["kwargs"]["slot"]["period"] is None  # the minute
    other = ((), {"slot": {"prefix": "x", "period": 1}}, {})
    stamp_slot("tests.other", other)
    assert "sent_at" not in other[1]["slot"], "only run_canvas messages"
    with pytest.raises(InvalidFanIn, match="slot must be"):
        key_of_slot("beat:nightly")
    with pytest.raises(InvalidFanIn, match="positive number of seconds"):
        key_of_slot({"prefix": "p", "period": 0})


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
