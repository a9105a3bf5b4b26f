"""`FanInGroup` is a plan, immutable once built: a retry round or a nested batch is a changed copy (`evolve`)."""

from __future__ import annotations

import json
import uuid

import pytest
from celery import Celery, chain, group, signature
from celery.canvas import Signature, _chain

from celery_fanin import FanInGroup, FanInResult, fan_in_group


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


def test_a_fan_in_is_a_registered_signature_that_travels_in_messages(plan: FanInGroup) -> None:
    """Registered with `Signature.register_type`: a message's dict comes back as a FanInGroup with its plan."""
    assert Signature.TYPES["fan_in_group"] is FanInGroup and isinstance(plan, Signature)
    carried = json.loads(json.dumps({"chain": [plan]}))["chain"][0]
    back = signature(carried, app=plan.app)
    assert isinstance(back, FanInGroup) and json.loads(json.dumps(back.to_spec("t"))) == json.loads(
        json.dumps(plan.to_spec("t"))
    )
    assert [c.task for c in back.children] == ["t.child"] * 3 and back.then.task == "t.merge"


def test_signature_methods_mean_what_they_mean_for_a_signature(plan: FanInGroup) -> None:
    partial = plan.s(7, x=1)
    assert isinstance(partial, FanInGroup) and partial.args == (7,) and partial.kwargs == {"x": 1}
    assert plan.args == () and not plan.immutable  # s() made a copy
    assert [c.args for c in partial._partial_children(partial.args, partial.kwargs)] == [(7, 0), (7, 1), (7, 2)]
    assert plan.si(3).immutable and plan.si(3).args == (3,)
    assert plan.clone().set(queue="q") is not plan and "queue" not in plan.options
    # Signature.replace is Celery's (args, kwargs, options), not the plan's evolve: it must not be shadowed.
    replaced = plan.replace(options={"priority": 3})
    assert isinstance(replaced, FanInGroup) and replaced.options == {"priority": 3} and replaced.then == plan.then
    chained = plan.app.signature("t.a") | plan | plan.app.signature("t.c")
    assert isinstance(chained, _chain) and isinstance(chained.tasks[1], FanInGroup)
    assert isinstance(group([plan, plan.app.signature("t.a")]).tasks[0], FanInGroup)


def test_freeze_fixes_both_ids_before_anything_is_written(plan: FanInGroup) -> None:
    """No database is configured for this app: freeze touches none."""
    frozen = plan.clone()
    handle = frozen.freeze()
    assert isinstance(handle, FanInResult) and handle.id == frozen.options["task_id"]
    assert uuid.UUID(handle.batch_id) and frozen.freeze().batch_id == handle.batch_id
    assert frozen.freeze().id == handle.id and "task_id" not in plan.options


def test_then_accepts_a_chain_or_a_group(plan: FanInGroup) -> None:
    app = plan.app
    for then in (chain(app.signature("t.a"), app.signature("t.b")), group(app.signature("t.a"))):
        successor, _ = plan.evolve(then=then)._successor(app)
        assert successor.task == "celery_fanin.then_canvas" and successor.kwargs["canvas"] == dict(then)


def test_a_nested_fan_in_is_told_by_its_class_not_by_a_copy_of_its_type(plan: FanInGroup) -> None:
    """The encoder's check (`plan.is_fan_in`) is `isinstance(value, FanInGroup)` without importing it: a fan-in,
    a chord, and one rebuilt from its dict are; a plain `Signature` copy of one (none of the plan's attributes), a
    bare dict and a task are not, as before the split."""
    from celery_fanin import chord
    from celery_fanin.producer.plan import is_fan_in

    rebuilt = signature(json.loads(json.dumps(plan)), app=plan.app)
    assert is_fan_in(plan) and is_fan_in(rebuilt)
    assert is_fan_in(chord([plan.app.signature("t.child", args=(1,))], plan.app.signature("t.merge")))
    assert not is_fan_in(Signature(plan)) and not is_fan_in(dict(plan)) and not is_fan_in(plan.app.signature("t.a"))
