"""Sagas against Postgres and the broker, without workers: each child's and compensation's outcome is recorded
here as a worker's hooks would, and the internal tasks' bodies (`settle_step`/`settle_stage` then `kick`) are
called directly, twice where a redelivery could run them twice."""

from __future__ import annotations

import json
import uuid
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery
from celery.canvas import Signature, chain
from click.testing import CliRunner
from sqlalchemy import text

from celery_fanin import BatchOutcome, FanIn, compensated, fan_in_group, manual, saga, sagas
from celery_fanin.cli.saga import saga as saga_cli
from celery_fanin.sagas import driver as saga_driver
from celery_fanin.store import sagas as store
from celery_fanin.store.reports import record_terminal
from tests.sql import Held, rows


@pytest.fixture(autouse=True)
def _no_sagas(app: Celery) -> None:
    """`clean_db` empties the fan-in tables; the saga tables reference none of them, so empty them here."""
    with FanIn.of(app).engine.begin() as conn:
        conn.execute(text("TRUNCATE fanin_sagas CASCADE"))


def _sig(app: Celery, name: str, *args: Any) -> Signature:
    return app.signature(name, args=args)


def _finish_children(app: Celery, batch_id: str, states: dict[int, str]) -> list[str]:
    """Record the terminal outcome of the batch's children (by index) as the worker hooks would."""
    found = rows(app, "SELECT task_id, idx FROM fanin_children WHERE batch_id = :b ORDER BY idx", b=batch_id)
    with FanIn.of(app).engine.begin() as conn:
        for r in found:
            if r.idx in states:
                exc = None if states[r.idx] == "succeeded" else "RuntimeError"
                record_terminal(Held(conn), r.task_id, states[r.idx], exc_type=exc, exc_message=exc and "boom")
    return [r.task_id for r in found]


def _step_done(app: Celery, saga_id: str, position: int) -> None:
    """What `celery_fanin.saga_step_done` does, twice over (a redelivered successor, a racing `kick`)."""
    fanin = FanIn.of(app)
    for _ in range(2):
        saga_driver.settle_step(fanin, uuid.UUID(saga_id), position)
        saga_driver.kick(fanin, uuid.UUID(saga_id))


def _stage_done(app: Celery, saga_id: str, stage: int) -> None:
    fanin = FanIn.of(app)
    for _ in range(2):
        saga_driver.settle_stage(fanin, uuid.UUID(saga_id), stage)
        saga_driver.kick(fanin, uuid.UUID(saga_id))


def test_rollback_is_generated_once_stops_on_a_failed_compensation_and_resumes(app: Celery) -> None:
    handle = saga(
        compensated(_sig(app, "t.reserve", "o"), _sig(app, "t.unreserve", "o")),
        compensated(_sig(app, "t.charge", "o"), _sig(app, "t.refund", "o")),
        _sig(app, "t.ship", "o"),
    ).apply_async()
    sid = handle.saga_id
    status = handle.status()
    assert (status.state, status.current_step, [s.state for s in status.steps]) == (
        "running",
        1,
        ["running", "pending", "pending"],
    )
    [step1] = rows(app, "SELECT id, key FROM fanin_batches WHERE key = :k", k=f"saga:{sid}:step:1")
    assert status.step(1).batch_id == str(step1.id)

    reserve_id = _finish_children(app, status.step(1).batch_id, {0: "succeeded"})[0]  # type: ignore[arg-type]
    _step_done(app, sid, 1)
    status = handle.status()
    assert status.current_step == 2 and status.step(1).state == "succeeded"
    charge_id = _finish_children(app, status.step(2).batch_id, {0: "succeeded"})[0]  # type: ignore[arg-type]
    _step_done(app, sid, 2)
    _finish_children(app, handle.status().step(3).batch_id, {0: "failed"})  # type: ignore[arg-type]
    _step_done(app, sid, 3)

    status = handle.status()
    assert status.state == "compensating" and status.failed_step == 3 and status.exc_type == "RuntimeError"
    assert [(c.stage, c.position, c.undo_of, c.task_id) for c in status.compensations] == [
        (0, 2, charge_id, saga_driver.compensation_task_id(charge_id, 1)),
        (1, 1, reserve_id, saga_driver.compensation_task_id(reserve_id, 1)),
    ]
    step_batches = rows(app, "SELECT key FROM fanin_batches WHERE key LIKE :k", k=f"saga:{sid}:%")
    assert len(step_batches) == 3  # each step's batch once, whatever ran twice

    # Generating the same compensations again creates nothing (the key is the original's identity).
    with FanIn.of(app).engine.begin() as conn:
        again = [store.NewCompensation(c.undo_of, c.position, 9, 0, "child") for c in status.compensations]
        store.start_rollback(conn, uuid.UUID(sid), 3, "X", "again", again)
    assert [c.stage for c in handle.status().compensations] == [0, 1]

    # Stage 0, the refund: its compensation batch carries the original's identity; it fails for good.
    refund = status.compensations[0]
    [child] = rows(
        app,
        "SELECT c.message, b.key FROM fanin_children c JOIN fanin_batches b ON b.id = c.batch_id WHERE c.task_id = :t",
        t=refund.task_id,
    )
    assert child.key == f"compensate:{status.step(2).batch_id}:1"
    message = json.loads(bytes(child.message))
    assert message["task"] == "t.refund" and message["options"]["headers"] == {"fanin_undo_of": charge_id}
    _finish_children(app, refund.batch_id, {0: "failed"})  # type: ignore[arg-type]
    _stage_done(app, sid, 0)
    status = handle.status()
    assert status.state == "compensation_failed"
    assert status.failed_compensation and "step 2: t.refund" in status.failed_compensation
    assert [c.state for c in status.compensations] == ["failed", "pending"]
    assert [s.state for s in status.steps] == ["succeeded", "compensation_failed", "failed"]

    # Resume: a new attempt of the refund only, with its own task id and batch, then the rest of the rollback.
    status = saga_driver.resume(FanIn.of(app), sid)
    refund2 = status.compensations[0]
    assert (status.state, status.resumes, refund2.attempt) == ("compensating", 1, 2)
    assert refund2.task_id == saga_driver.compensation_task_id(charge_id, 2) != refund.task_id
    [key] = rows(app, "SELECT key FROM fanin_batches WHERE id = :b", b=refund2.batch_id)
    assert key.key == f"compensate:{status.step(2).batch_id}:2"
    _finish_children(app, refund2.batch_id, {0: "succeeded"})  # type: ignore[arg-type]
    _stage_done(app, sid, 0)
    unreserve = handle.status().compensations[1]
    _finish_children(app, unreserve.batch_id, {0: "succeeded"})  # type: ignore[arg-type]
    _stage_done(app, sid, 1)
    status = handle.status()
    assert status.state == "compensated" and status.finished_at is not None
    assert [s.state for s in status.steps] == ["compensated", "compensated", "failed"]
    assert [c.state for c in status.compensations] == ["succeeded", "succeeded"]
    with pytest.raises(sagas.SagaStateError, match="nothing to resume"):
        saga_driver.resume(FanIn.of(app), sid)


def test_manual_steps_are_asked_for_not_waited_for_and_acked(app: Celery) -> None:
    handle = saga(
        compensated(_sig(app, "t.reserve", "m"), _sig(app, "t.unreserve", "m")),
        manual(_sig(app, "t.email", "m"), "Tell the customer the email was a mistake"),
        _sig(app, "t.ship", "m"),
    ).apply_async()
    sid = handle.saga_id
    for position, state in ((1, "succeeded"), (2, "succeeded"), (3, "failed")):
        _finish_children(app, handle.status().step(position).batch_id, {0: state})  # type: ignore[arg-type]
        _step_done(app, sid, position)
    status = handle.status()
    assert [(c.stage, c.kind, c.state) for c in status.compensations] == [
        (0, "manual", "manual_action_required"),
        (1, "child", "running"),
    ]
    assert status.step(2).state == "manual_action_required"
    with pytest.raises(sagas.SagaStateError, match="not waiting for a manual action"):
        saga_driver.acknowledge(FanIn.of(app), sid, 1)
    _finish_children(app, status.compensations[1].batch_id, {0: "succeeded"})  # type: ignore[arg-type]
    _stage_done(app, sid, 1)
    assert handle.status().state == "manual_action_required"
    status = saga_driver.acknowledge(FanIn.of(app), sid, "t.email", by="bob")  # by name as well as by number
    assert status.state == "compensated" and status.step(2).state == "acknowledged"
    assert status.compensations[0].acked_by == "bob"


def test_outcome_compensate_undoes_succeeded_children_once(app: Celery) -> None:
    children = [compensated(_sig(app, "t.piece", i), _sig(app, "t.unpiece", i)) for i in range(4)]
    children.append(_sig(app, "t.piece", 4))  # no undo
    handle = fan_in_group(children, then=_sig(app, "t.merge")).apply_async()
    ids = _finish_children(
        app, handle.batch_id, {0: "succeeded", 1: "failed", 2: "succeeded", 3: "revoked", 4: "succeeded"}
    )
    outcome = BatchOutcome.from_message(
        {"batch_id": handle.batch_id, "step": "t.merge", "planned": 5, "succeeded": 3, "failed": 2}, app=app
    )
    first = outcome.compensate()
    assert outcome.compensate().batch_id == first.batch_id  # once, however often it is called
    undos = rows(app, "SELECT task_id, message FROM fanin_children WHERE batch_id = :b ORDER BY idx", b=first.batch_id)
    assert [u.task_id for u in undos] == [saga_driver.compensation_task_id(ids[i], 1) for i in (2, 0)]  # latest first
    assert [json.loads(bytes(u.message))["args"] for u in undos] == [[2], [0]]
    assert rows(app, "SELECT count(*) AS n FROM fanin_batches WHERE key LIKE 'compensate:%'")[0].n == 1


def test_outcome_compensate_finds_children_in_the_leaves_of_a_wide_batch(app: Celery) -> None:
    children = [compensated(_sig(app, "t.piece", i), _sig(app, "t.unpiece", i)) for i in range(7)]
    handle = fan_in_group(children, then=_sig(app, "t.merge"), max_width=3).apply_async()
    leaves = rows(app, "SELECT id FROM fanin_batches WHERE parent_id = :b", b=handle.batch_id)
    assert len(leaves) >= 2
    succeeded = {0, 3, 4, 6}
    with FanIn.of(app).engine.begin() as conn:
        for r in rows(
            app,
            "SELECT task_id, idx FROM fanin_children WHERE batch_id = ANY(CAST(:l AS uuid[]))",
            l=[leaf.id for leaf in leaves],
        ):
            record_terminal(Held(conn), r.task_id, "succeeded" if r.idx in succeeded else "failed")
    outcome = BatchOutcome.from_message(
        {"batch_id": handle.batch_id, "step": "t.merge", "planned": 7, "succeeded": 4, "failed": 3}, app=app
    )
    undos = rows(
        app, "SELECT message FROM fanin_children WHERE batch_id = :b ORDER BY idx", b=outcome.compensate().batch_id
    )
    assert [json.loads(bytes(u.message))["args"] for u in undos] == [[6], [4], [3], [0]]


def test_saga_key_returns_the_same_saga(app: Celery) -> None:
    steps = (_sig(app, "t.a"), _sig(app, "t.b"))
    first = saga(*steps, key="order-1").apply_async()
    assert saga(*steps, key="order-1").apply_async().saga_id == first.saga_id
    assert rows(app, "SELECT count(*) AS n FROM fanin_sagas WHERE key = 'order-1'")[0].n == 1
    with pytest.raises(sagas.InvalidSaga, match="taken by saga"):
        saga(_sig(app, "t.a"), key="order-1").apply_async()


def test_invalid_sagas_are_refused_before_anything_is_written(app: Celery) -> None:
    a, b = _sig(app, "t.a"), _sig(app, "t.b")
    with pytest.raises(sagas.InvalidSaga, match="at least one step"):
        saga(app=app).apply_async()
    with pytest.raises(sagas.InvalidSaga, match="step 2 must be"):
        saga(a, "t.b", app=app).apply_async()
    with pytest.raises(sagas.InvalidSaga, match="plain task signature"):
        saga(a, chain(a, b)).apply_async()
    with pytest.raises(sagas.InvalidSaga, match="compensated\\(\\) or manual\\(\\), not both"):
        manual(compensated(a, b), "call someone")
    with pytest.raises(sagas.InvalidSaga, match="needs the text"):
        manual(a, " ")
    with pytest.raises(sagas.InvalidSaga, match="not compensated"):
        compensated(a, compensated(b, a))
    with pytest.raises(sagas.InvalidSaga, match="a list of children"):
        saga(fan_in_group((x for x in [a]), then=b)).apply_async()
    assert rows(app, "SELECT count(*) AS n FROM fanin_sagas")[0].n == 0


def test_cli_unknown_ids_and_unreachable_database_exit_non_zero(app: Celery, closed_port: int) -> None:
    runner = CliRunner()
    obj = SimpleNamespace(app=app)
    unknown = str(uuid.uuid4())
    for args in (["status", unknown], ["resume", unknown], ["ack", unknown, "1"]):
        result = runner.invoke(saga_cli, args, obj=obj)
        assert result.exit_code == 1 and f"no saga with id {unknown}" in result.output, result.output
    result = runner.invoke(saga_cli, ["status", "not-a-saga"], obj=obj)
    assert result.exit_code == 1 and "is not a saga id" in result.output
    handle = saga(_sig(app, "t.a")).apply_async()
    result = runner.invoke(saga_cli, ["ack", handle.saga_id, "7"], obj=obj)
    assert result.exit_code == 1 and "has steps 1 to 1, not 7" in result.output
    shown = runner.invoke(saga_cli, ["status", handle.saga_id, "--json"], obj=obj)
    assert shown.exit_code == 0 and json.loads(shown.output)["steps"][0]["state"] == "running"

    down = Celery("fanin-down", broker="memory://", set_as_current=False)
    down.conf.fanin_database_url = f"postgresql+psycopg://root@127.0.0.1:{closed_port}/nowhere"
    FanIn(down)
    result = runner.invoke(saga_cli, ["status", handle.saga_id], obj=SimpleNamespace(app=down))
    assert result.exit_code == 1 and "could not read saga" in result.output and "Traceback" not in result.output
