"""What Celery stores of a fan-in's handle (`as_tuple`: a task that returns the handle, `GroupResult.save`, a chord
header holding one) is plain data whether or not a result comes before the fan-in in a chain, and a chain walks
its parents through the handle (fresh eyes found the handle unserialisable once its children read as falsy)."""

from __future__ import annotations

import uuid

from celery import Celery
from celery.result import AsyncResult, GroupResult, result_from_tuple
from kombu.serialization import dumps

from celery_fanin import FanIn
from celery_fanin.producer.result import FanInResult


def _app() -> Celery:
    app = Celery("tuple", set_as_current=False)
    FanIn(app)
    return app


def test_a_handle_is_stored_as_plain_data_with_or_without_a_result_before_it() -> None:
    app = _app()
    alone = FanInResult(app, str(uuid.uuid4()), successor_task_id="successor-1")
    assert alone.as_tuple() == (("successor-1", None), None)
    assert not alone.parent and list(alone._parents()) == []  # no chain: nothing to walk
    in_chain = FanInResult(app, str(uuid.uuid4()), successor_task_id="successor-2")
    before = AsyncResult("before-1", app=app)
    in_chain.parent = before
    assert in_chain.as_tuple() == (("successor-2", (("before-1", None), None)), None)
    assert in_chain.parent and list(in_chain._parents())[1] is before
    for handle in (alone, in_chain):
        dumps(handle.as_tuple(), "json")  # raises if anything but plain data is in it
        assert result_from_tuple(handle.as_tuple(), app).id == handle.id
    dumps(GroupResult("group-1", [alone, in_chain], app=app).as_tuple(), "json")
