"""Sagas end to end, with real workers and the relay: steps in order, compensations in reverse order exactly once
(a worker SIGKILLed mid-compensation included), a fan-in step whose successor rejects its partial result, a
compensation that fails and is resumed, and a manual step acknowledged by an operator.

"Exactly once" is read from `e2e_saga_effects`, where every step and compensation records its effect under the
original's identity (see the saga tasks in tests/app.py), and `e2e_saga_calls`, where it records every call.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psycopg
import pytest
import redis
from click.testing import CliRunner, Result

from celery_fanin import FanInResult, compensated, fan_in_group, manual, saga
from celery_fanin.cli.saga import saga as saga_cli
from tests import app as tasks
from tests.sql import rows
from tests.workers import ROOT, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


@pytest.fixture
def saga_db(e2e_env: dict[str, str]) -> Iterator[psycopg.Connection]:
    """The tables the saga tasks record their calls and effects in, emptied."""
    with psycopg.connect(e2e_env["FANIN_DATABASE_URL"], autocommit=True) as conn:
        conn.execute(tasks.SAGA_TABLES_DDL)
        conn.execute("TRUNCATE e2e_saga_calls, e2e_saga_effects RESTART IDENTITY")
        conn.execute("TRUNCATE fanin_sagas CASCADE")
        yield conn


def _effects(conn: psycopg.Connection, label: str) -> list[tuple[str, str]]:
    """(action, key) of every effect recorded for `label`, in the order they happened."""
    rows = conn.execute("SELECT action, key FROM e2e_saga_effects WHERE label = %s ORDER BY id", (label,))
    return [(r[0], r[1]) for r in rows]


def _calls(conn: psycopg.Connection, action: str, label: str) -> int:
    row = conn.execute("SELECT count(*) FROM e2e_saga_calls WHERE action = %s AND label = %s", (action, label))
    return int(row.fetchone()[0])  # type: ignore[index]


def _cli(app: Any, *args: str) -> Result:
    return CliRunner().invoke(saga_cli, list(args), obj=SimpleNamespace(app=app))


def test_steps_run_in_order_and_the_saga_succeeds(producer: Any, processes: Any, saga_db: Any) -> None:
    processes.worker()
    processes.relay()
    pieces = [compensated(tasks.saga_piece.s(i), tasks.saga_undo.s("piece", f"ok-{i}")) for i in range(3)]
    steps = (
        compensated(tasks.saga_do.s("reserve", "ok"), tasks.saga_undo.s("reserve", "ok")),
        fan_in_group(pieces, then=tasks.saga_merge.s()),
        tasks.saga_do.s("ship", "ok"),
    )
    handle = saga(*steps, key="order-ok").apply_async()
    again = saga(*steps, key="order-ok").apply_async()  # the same key: the same saga, nothing started twice
    assert again.saga_id == handle.saga_id
    status = handle.wait(timeout=90)
    assert status.state == "succeeded"
    assert [s.state for s in status.steps] == ["succeeded"] * 3
    assert status.compensations == []
    assert [a for a, _ in _effects(saga_db, "ok")] == ["reserve", "ship"]
    step_batches = rows(producer, "SELECT key FROM fanin_batches WHERE key LIKE :k", k=f"saga:{handle.saga_id}:%")
    assert len(step_batches) == 3


def test_third_step_fails_and_the_first_two_are_compensated_in_reverse_order_once(
    producer: Any, processes: Any, saga_db: Any
) -> None:
    processes.worker()
    processes.relay()
    handle = saga(
        compensated(tasks.saga_do.s("reserve", "o1"), tasks.saga_undo.s("reserve", "o1")),
        compensated(tasks.saga_do.s("charge", "o1"), tasks.saga_undo.s("charge", "o1")),
        compensated(tasks.saga_ship_fails.s("o1"), tasks.saga_undo.s("ship", "o1")),
    ).apply_async()
    status = handle.wait(timeout=90)
    assert status.state == "compensated", status
    assert [s.state for s in status.steps] == ["compensated", "compensated", "failed"]
    assert status.failed_step == 3 and status.exc_type == "ConnectionError"
    assert _calls(saga_db, "ship", "o1") == 3  # it failed for good after its two retries
    effects = _effects(saga_db, "o1")
    assert [a for a, _ in effects] == ["reserve", "charge", "undo:charge", "undo:reserve"]
    keys = dict(effects)
    # Each compensation recorded its effect under the identity of what it undid.
    assert keys["undo:charge"] == keys["charge"] and keys["undo:reserve"] == keys["reserve"]
    assert [(c.stage, c.position, c.state, c.attempt) for c in status.compensations] == [
        (0, 2, "succeeded", 1),
        (1, 1, "succeeded", 1),
    ]
    assert [c.undo_of for c in status.compensations] == [keys["charge"], keys["reserve"]]
    assert _calls(saga_db, "undo:charge", "o1") == 1 and _calls(saga_db, "undo:reserve", "o1") == 1


def test_compensation_worker_killed_midway_still_undoes_once(producer: Any, processes: Any, saga_db: Any) -> None:
    first = processes.worker()
    processes.relay()
    handle = saga(
        compensated(tasks.saga_do.s("reserve", "o2"), tasks.saga_undo.s("reserve", "o2")),
        compensated(tasks.saga_do.s("charge", "o2"), tasks.saga_undo.s("charge", "o2", hang_first=60)),
        tasks.saga_ship_fails.s("o2"),
        compensation_timeout=3,  # an undo started and silent for 3 s is published again
    ).apply_async()
    # The refund recorded its effect and hangs: kill the whole worker (main process and pool) right there.
    wait_for(lambda: _calls(saga_db, "undo:charge", "o2") == 1, 60, message="the first undo:charge call")
    first.kill()
    processes.worker()
    status = handle.wait(timeout=120)
    assert status.state == "compensated", status
    assert _calls(saga_db, "undo:charge", "o2") >= 2  # it ran again after the kill ...
    assert [a for a, _ in _effects(saga_db, "o2")] == ["reserve", "charge", "undo:charge", "undo:reserve"]  # ... once
    redriven = rows(
        producer, "SELECT redrives FROM fanin_children WHERE task_id = :t", t=status.compensations[0].task_id
    )
    assert redriven[0].redrives >= 1
    assert _calls(saga_db, "undo:reserve", "o2") == 1


def test_fan_in_step_rejected_by_its_successor_compensates_only_succeeded_children(
    producer: Any, processes: Any, saga_db: Any
) -> None:
    processes.worker()
    processes.relay()
    pieces = [compensated(tasks.saga_piece.s(i, i == 2), tasks.saga_undo.s("piece", str(i))) for i in range(5)]
    handle = saga(
        compensated(tasks.saga_do.s("reserve", "o3"), tasks.saga_undo.s("reserve", "o3")),
        fan_in_group(pieces, then=tasks.saga_merge.s()),  # sees piece 2 failed and calls outcome.compensate()
        compensated(tasks.saga_do.s("charge", "o3"), tasks.saga_undo.s("charge", "o3")),
    ).apply_async()
    status = handle.wait(timeout=90)
    assert status.state == "compensated", status
    assert [s.state for s in status.steps] == ["compensated", "failed", "skipped"]
    assert status.exc_type == "CompensationRequested"
    conn = saga_db
    pieces_done = dict(conn.execute("SELECT label, key FROM e2e_saga_effects WHERE action = 'piece'").fetchall())
    undone = conn.execute("SELECT label, key, id FROM e2e_saga_effects WHERE action = 'undo:piece'").fetchall()
    reserve_undone = conn.execute("SELECT id FROM e2e_saga_effects WHERE action = 'undo:reserve'").fetchall()
    undo_calls = conn.execute("SELECT count(*) FROM e2e_saga_calls WHERE action = 'undo:piece'").fetchone()
    assert sorted(pieces_done) == ["0", "1", "3", "4"]
    assert {label: key for label, key, _ in undone} == pieces_done  # each succeeded piece undone, under its id
    assert undo_calls is not None and undo_calls[0] == 4  # once each; the failed piece never
    assert len(reserve_undone) == 1 and reserve_undone[0][0] > max(i for _, _, i in undone)  # reverse order
    assert _effects(saga_db, "o3")[0][0] == "reserve" and "charge" not in dict(_effects(saga_db, "o3"))
    # The saga waited for the very batch outcome.compensate() had started: one compensation batch for the group.
    stage0 = [c for c in status.compensations if c.stage == 0]
    assert len(stage0) == 4 and {c.batch_id for c in stage0} == {stage0[0].batch_id}
    [group_batch] = rows(producer, "SELECT id FROM fanin_batches WHERE successor_name = 'tests.app.saga_merge'")
    merged = FanInResult(producer, str(group_batch.id)).get(timeout=5)
    assert merged["rejected"] is True and merged["compensation_batch"] == stage0[0].batch_id
    assert len(rows(producer, "SELECT 1 FROM fanin_batches WHERE key = :k", k=f"compensate:{group_batch.id}:1")) == 1


def test_group_undo_runs_before_its_childrens_nested_groups_included(
    producer: Any, processes: Any, saga_db: Any
) -> None:
    processes.worker()
    processes.relay()
    inner = fan_in_group(
        [compensated(tasks.saga_piece.s(i), tasks.saga_undo.s("piece", f"g{i}")) for i in (10, 11)],
        then=tasks.sum_values.s(),
    )
    group = fan_in_group(
        [compensated(tasks.saga_piece.s(0), tasks.saga_undo.s("piece", "g0")), inner], then=tasks.saga_merge.s()
    )
    handle = saga(compensated(group, tasks.saga_undo.s("merge", "g")), tasks.saga_ship_fails.s("g")).apply_async()
    status = handle.wait(timeout=90)
    assert status.state == "compensated", status
    assert [s.state for s in status.steps] == ["compensated", "failed"]
    assert [(c.stage, c.kind) for c in status.compensations] == [(0, "step"), (1, "child"), (1, "child"), (1, "child")]
    undone = saga_db.execute("SELECT action, label, key FROM e2e_saga_effects WHERE action LIKE 'undo:%' ORDER BY id")
    undone = undone.fetchall()
    assert undone[0][:2] == ("undo:merge", "g")  # the group's own undo first, then its children's
    assert sorted(label for _, label, _ in undone[1:]) == ["g0", "g10", "g11"]
    [merge] = rows(
        producer, "SELECT successor_task_id FROM fanin_batches WHERE successor_name = :n", n="tests.app.saga_merge"
    )
    assert undone[0][2] == merge.successor_task_id  # keyed by the identity of the successor it undoes
    pieces = dict(saga_db.execute("SELECT label, key FROM e2e_saga_effects WHERE action = 'piece'").fetchall())
    assert {label: key for _, label, key in undone[1:]} == {f"g{i}": pieces[str(i)] for i in (0, 10, 11)}


def test_outcome_compensate_outside_a_saga(producer: Any, processes: Any, saga_db: Any) -> None:
    processes.worker()
    processes.relay()
    pieces = [compensated(tasks.saga_piece.s(i, i in (1, 3)), tasks.saga_undo.s("piece", f"b{i}")) for i in range(4)]
    handle = fan_in_group(pieces, then=tasks.saga_merge.s()).apply_async()
    result = handle.get(timeout=60)
    assert result["rejected"] is True
    undo_batch = FanInResult(producer, result["compensation_batch"])
    final = undo_batch.wait_batch(timeout=60)
    assert (final.planned, final.succeeded, final.failed) == (2, 2, 0)
    labels = [
        r[0] for r in saga_db.execute("SELECT label FROM e2e_saga_effects WHERE action = 'undo:piece' ORDER BY label")
    ]
    assert labels == ["b0", "b2"]


def test_failing_compensation_stops_the_rollback_until_resumed(
    producer: Any, processes: Any, saga_db: Any, clean_redis: str
) -> None:
    processes.worker()
    processes.relay()
    handle = saga(
        compensated(tasks.saga_do.s("reserve", "o4"), tasks.saga_undo.s("reserve", "o4")),
        compensated(tasks.saga_do.s("charge", "o4"), tasks.saga_undo.s("charge", "o4", needs_flag=True)),
        tasks.saga_ship_fails.s("o4"),
    ).apply_async()
    status = handle.wait(timeout=90)
    assert status.state == "compensation_failed", status
    assert status.failed_compensation is not None
    assert "tests.app.saga_undo" in status.failed_compensation and "RuntimeError" in status.failed_compensation
    assert "step 2" in status.failed_compensation
    assert [s.state for s in status.steps] == ["succeeded", "compensation_failed", "failed"]
    assert [a for a, _ in _effects(saga_db, "o4")] == ["reserve", "charge"]  # nothing undone past the failure
    shown = _cli(producer, "status", handle.saga_id)
    assert shown.exit_code == 0 and "compensation_failed" in shown.output

    redis.Redis.from_url(clean_redis).set("e2e:saga:fixed:o4", "1")  # the operator fixes the refund service
    resumed = _cli(producer, "resume", handle.saga_id)
    assert resumed.exit_code == 0, resumed.output
    status = handle.wait(timeout=60)
    assert status.state == "compensated", status
    assert status.resumes == 1 and status.failed_compensation is None
    assert [a for a, _ in _effects(saga_db, "o4")] == ["reserve", "charge", "undo:charge", "undo:reserve"]
    charge_undo = status.compensations[0]
    assert (charge_undo.position, charge_undo.attempt, charge_undo.state) == (2, 2, "succeeded")
    assert _calls(saga_db, "undo:charge", "o4") == 2  # the failed attempt, then the resumed one
    again = _cli(producer, "resume", handle.saga_id)
    assert again.exit_code != 0 and "nothing to resume" in again.output


def test_manual_step_waits_for_an_operator_ack(producer: Any, processes: Any, saga_db: Any) -> None:
    processes.worker()
    processes.relay()
    text_for_operator = "Email the customer of order o5 that the confirmation mail was sent in error"
    handle = saga(
        compensated(tasks.saga_do.s("reserve", "o5"), tasks.saga_undo.s("reserve", "o5")),
        manual(tasks.saga_do.s("notify", "o5"), text_for_operator),
        tasks.saga_ship_fails.s("o5"),
    ).apply_async()
    status = handle.wait(timeout=90)
    assert status.state == "manual_action_required", status
    assert [s.state for s in status.steps] == ["compensated", "manual_action_required", "failed"]
    # The rollback did not wait for the operator: step 1 was compensated past the manual step.
    assert [a for a, _ in _effects(saga_db, "o5")] == ["reserve", "notify", "undo:reserve"]
    [asked] = [c for c in status.compensations if c.kind == "manual"]
    assert (asked.position, asked.state, asked.manual_text) == (2, "manual_action_required", text_for_operator)
    shown = _cli(producer, "status", handle.saga_id)
    assert shown.exit_code == 0 and "manual_action_required" in shown.output and "o5" in shown.output

    acked = _cli(producer, "ack", handle.saga_id, "2", "--by", "alice")
    assert acked.exit_code == 0, acked.output
    status = handle.status()
    assert status.state == "compensated"
    assert status.step(2).state == "acknowledged"
    [asked] = [c for c in status.compensations if c.kind == "manual"]
    assert asked.state == "acknowledged" and asked.acked_by == "alice" and asked.acked_at is not None
    twice = _cli(producer, "ack", handle.saga_id, "2")
    assert twice.exit_code != 0 and "not waiting for a manual action" in twice.output


def test_example_app_order_saga(clean_db: str, clean_redis: str, tmp_path: Path) -> None:
    """The example in example_app/README.md, as documented: one order ships, one rolls back and asks an operator."""
    env = {
        **os.environ,
        "FANIN_DATABASE_URL": clean_db,
        "FANIN_BROKER_URL": clean_redis,
        "PYTHONPATH": str(ROOT),
        "PYTHONUNBUFFERED": "1",
    }
    celery = [sys.executable, "-m", "celery", "-A", "example_app"]
    commands = {
        "worker": [
            *celery,
            "worker",
            "-P",
            "prefork",
            "-c",
            "2",
            "-Q",
            "celery,partner_sync",
            "-l",
            "INFO",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
            "-n",
            f"saga-{uuid.uuid4().hex}@%h",
        ],
        "relay": [*celery, "fanin", "relay", "--poll-interval", "0.2"],
    }
    procs = []
    for name, cmd in commands.items():
        log = (tmp_path / f"{name}.log").open("w")
        procs.append(
            subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        )
    order = f"order-{uuid.uuid4().hex[:8]}"

    def place(order_id: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "example_app.saga_demo", order_id, "--timeout", "90"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    try:
        shipped = place(order)
        assert ": succeeded" in shipped.splitlines()[0]
        assert [line.split()[1] for line in shipped.splitlines() if "ledger:" in line] == [
            "reserve",
            "charge",
            "email",
            "ship",
        ]
        rolled_back = place(f"{order}-nocarrier")
        assert ": manual_action_required" in rolled_back.splitlines()[0], rolled_back
        assert f"Email the customer that order {order}-nocarrier is cancelled" in rolled_back
        assert [line.split()[1] for line in rolled_back.splitlines() if "ledger:" in line] == [
            "reserve",
            "charge",
            "email",
            "refund",
            "release",
        ]
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
