"""`FanInGroup` is a plan, immutable once built: a retry round or a nested batch is a changed copy (`evolve`)."""

from __future__ import annotations

import uuid

import pytest
from celery import Celery

from celery_fanin import FanInGroup, fan_in_group


@pytest.fixture
def plan() -> FanInGroup:
    app = Celery("group-tests", set_as_current=False)
    return fan_in_group([app.signature("t.child", args=(i,)) for i in range(3)], then=app.signature("t.merge"), app=app)


def test_a_built_group_refuses_changes(plan: FanInGroup) -> None:
    for name, value in (("round", 2), ("retry_of", uuid.uuid4()), ("parent_task_id", "outer"), ("key", "k")):
        with pytest.raises(AttributeError, match="immutable"):
            setattr(plan, name, value)
    with pytest.raises(TypeError):
        plan.policy_options["on_lost"] = "redrive"  # type: ignore[index]
    assert (plan.round, plan.retry_of, plan.parent_task_id, plan.key) == (1, None, None, None)


def test_evolve_makes_a_changed_copy_and_leaves_the_original(plan: FanInGroup) -> None:
    original = uuid.uuid4()
    retry = plan.evolve(round=2, retry_of=original, key=f"retry:{original}:2")
    assert (retry.round, retry.retry_of, retry.key) == (2, original, f"retry:{original}:2")
    assert (plan.round, plan.retry_of, plan.key) == (1, None, None)
    assert retry.children is plan.children and retry.then is plan.then and retry.app is plan.app
    nested = plan.evolve(parent_task_id="outer-task")
    assert nested.parent_task_id == "outer-task" and plan.parent_task_id is None
    with pytest.raises(AttributeError):
        retry.round = 3
    with pytest.raises(TypeError, match="on_lost"):
        plan.evolve(on_lost="redrive")


def test_a_nested_spec_round_trips(plan: FanInGroup) -> None:
    outer = fan_in_group([plan], then=plan.then, app=plan.app, max_width=50)
    back = FanInGroup.from_spec(plan.app, outer.to_spec("test"))
    assert back.to_spec("test") == outer.to_spec("test")
    assert isinstance(back.children, list) and isinstance(back.children[0], FanInGroup)
