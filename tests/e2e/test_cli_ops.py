"""The operator commands end to end: `status` (tree, rounds), `watch`, `ls`, `failures`, `retry-failed` and `prune`,
against batches that real workers and a relay ran. Each command runs as a `celery -A tests.app fanin ...`
subprocess at least once (its entry point, its exit code, its output); its other cases run the same click command
in this process (`fanin`), which saves a new interpreter per call."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest

from celery_fanin import FanInResult, builtin_tasks, fan_in_group, protocol
from tests import app as tasks
from tests.e2e import clock
from tests.e2e.test_cli import celery, fanin
from tests.sql import child_ids, rows
from tests.workers import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(150)]

Runs = Callable[[str], list[dict[str, Any]]]
NOBODY = "cli-ops-nobody"  # a queue no worker consumes: its children stay pending


def _json(app: Any, *args: str) -> Any:
    result = fanin(app, *args, "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def _backdate(app: Any, batch_id: str, days: float) -> None:
    """Move a batch (and its leaves) back in time, as if it had been created and finished `days` ago."""
    rows(
        app,
        "UPDATE fanin_batches SET created_at = created_at - make_interval(days => :d), completed_at = "
        "completed_at - make_interval(days => :d) WHERE id = :b OR parent_id = :b",
        b=batch_id,
        d=days,
    )


def _ids(rows: list[dict[str, Any]]) -> set[str]:
    return {r["batch_id"] for r in rows}


# --- status -------------------------------------------------------------------------------------------------------


def test_status_tree_of_a_tree_a_nested_batch_and_a_pipeline(
    e2e_env: dict[str, str], producer: Any, processes: Any
) -> None:
    processes.worker()
    processes.relay()
    tree = fan_in_group([tasks.ok.s(i) for i in range(5)], then=tasks.record_run.s("tree"), max_width=2).apply_async()
    outer = fan_in_group(
        [tasks.ok.s(1), fan_in_group([tasks.ok.s(2), tasks.ok.s(3)], then=tasks.sum_values.s())],
        then=tasks.record_run.s("outer"),
    ).apply_async()
    first = fan_in_group([tasks.ok.s(1)], then=fan_in_group([tasks.ok.s(2)], then=tasks.sum_values.s())).apply_async()
    tree.wait_batch(timeout=60)
    outer.wait_batch(timeout=60)
    assert first.final(timeout=60) == 20

    data = _json(producer, "status", tree.batch_id)
    assert (data["planned"], data["succeeded"], data["remaining"], data["running"], data["pending"]) == (5, 5, 0, 0, 0)
    assert data["tree"]["kind"] == "root" and data["tree"]["batch_id"] == tree.batch_id
    leaves = data["tree"]["children"]
    assert [leaf["kind"] for leaf in leaves] == ["leaf"] * 3
    assert sorted(leaf["planned"] for leaf in leaves) == [1, 2, 2]
    assert {leaf["state"] for leaf in leaves} == {"complete"} and sum(leaf["succeeded"] for leaf in leaves) == 5
    assert data["rounds"] == [] and data["round"] == 1 and not data["tree_truncated"]
    assert data["age_seconds"] >= 0 and data["deadline_at"] is None
    leaf_view = _json(producer, "status", leaves[0]["batch_id"])
    assert leaf_view["leaf_of"] == tree.batch_id
    truncated = _json(producer, "status", tree.batch_id, "--tree-limit", "1")
    assert len(truncated["tree"]["children"]) == 1 and truncated["tree_truncated"]
    shown = celery(e2e_env, "status", tree.batch_id)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.count("leaf ") == 3 and "5/5" in shown.stdout

    data = _json(producer, "status", outer.batch_id)
    (nested,) = data["tree"]["children"]
    assert (nested["kind"], nested["child_index"], nested["planned"], nested["succeeded"]) == ("nested", 1, 2, 2)
    assert nested["successor_state"] == "succeeded" and nested["children"] == []
    inner = _json(producer, "status", nested["batch_id"])
    assert inner["nested_in"] == {"batch_id": outer.batch_id, "child_index": 1}
    shown = fanin(producer, "status", outer.batch_id)
    assert "child 1 → nested batch" in shown.stdout and nested["batch_id"] in shown.stdout

    data = _json(producer, "status", first.batch_id)
    (stage,) = data["tree"]["children"]
    following = first.next_stage()
    assert following is not None
    assert (stage["kind"], stage["batch_id"], stage["successor_state"]) == ("stage", following.batch_id, "succeeded")


def test_status_shows_deadline_and_running_children(e2e_env: dict[str, str], producer: Any, processes: Any) -> None:
    processes.worker()
    handle = fan_in_group(
        [tasks.sleepy.s(8), tasks.ok.s(1).set(queue=NOBODY)], then=tasks.record_run.s("dl"), deadline=timedelta(hours=1)
    ).apply_async()
    data = wait_for(
        lambda: (d := _json(producer, "status", handle.batch_id))["running"] == 1 and d,
        30,
        interval=0.3,
        message="the sleepy child to start",
    )
    assert (data["state"], data["running"], data["pending"], data["remaining"]) == ("running", 1, 1, 2)
    assert 3500 < data["deadline_in_seconds"] <= 3600 and data["deadline_at"]
    shown = fanin(producer, "status", handle.batch_id)
    assert shown.returncode == 0, shown.stderr
    # "in 59m" a minute after creation, "in 5Xm" on a machine slow enough to take longer to get here
    assert "deadline" in shown.stdout and re.search(r"in 5\dm", shown.stdout) and "1 (pending: 1)" in shown.stdout


# --- watch --------------------------------------------------------------------------------------------------------


def test_watch_exits_when_the_successor_finishes(e2e_env: dict[str, str], producer: Any, processes: Any) -> None:
    processes.worker()
    processes.relay()
    handle = fan_in_group([tasks.sleepy.s(0.4) for _ in range(6)], then=tasks.record_run.s("watch")).apply_async()
    watched = celery(e2e_env, "watch", handle.batch_id, "--interval", "0.2", "--timeout", "60")
    assert watched.returncode == 0, watched.stderr
    assert f"batch {handle.batch_id}: complete, 6 succeeded, 0 failed; successor succeeded" in watched.stdout
    assert handle.batch_status().finished

    failing = fan_in_group([tasks.ok.s(1)], then=tasks.failing_successor.s("watch-fails")).apply_async()
    watched = fanin(producer, "watch", failing.batch_id, "--interval", "0.2", "--timeout", "60")
    assert watched.returncode == 1 and "successor failed" in watched.stderr

    stuck = fan_in_group([tasks.ok.s(1).set(queue=NOBODY)], then=tasks.record_run.s("never")).apply_async()
    watched = fanin(producer, "watch", stuck.batch_id, "--interval", "0.2", "--timeout", "1")
    assert watched.returncode == 1
    assert f"batch {stuck.batch_id} not finished after 1.0s" in watched.stderr and "Traceback" not in watched.stderr


# --- ls -----------------------------------------------------------------------------------------------------------


def test_ls_filters_by_state_stuck_age_and_step(e2e_env: dict[str, str], producer: Any, processes: Any) -> None:
    processes.worker()
    processes.relay()
    done = fan_in_group([tasks.ok.s(1)], then=tasks.record_run.s("done"), step="ls-done").apply_async()
    done.wait_batch(timeout=30)
    # No child_timeout on the batches moved back in time: the relay would count their children as lost.
    stuck = fan_in_group(
        [tasks.ok.s(2).set(queue=NOBODY)], then=tasks.record_run.s("x"), step="ls-stuck", child_timeout=None
    ).apply_async()
    _backdate(producer, stuck.batch_id, days=1)
    idle = fan_in_group([tasks.ok.s(3).set(queue=NOBODY)], then=tasks.record_run.s("y"), step="ls-idle").apply_async()
    tree = fan_in_group(
        [tasks.ok.s(i) for i in range(4)], then=tasks.record_run.s("t"), step="ls-tree", max_width=2
    ).apply_async()
    tree.wait_batch(timeout=30)
    # A running batch that progressed an hour ago: old, but not stuck for --stuck-after 2h. The thresholds are hours
    # and half hours, so that the young `idle` batch is never stuck because the machine is slow.
    moving = fan_in_group(
        [tasks.ok.s(4), tasks.ok.s(5).set(queue=NOBODY)],
        then=tasks.record_run.s("m"),
        step="ls-moving",
        child_timeout=None,
    ).apply_async()
    wait_for(lambda: moving.batch_status().succeeded == 1, 30, message="the first child of ls-moving")
    _backdate(producer, moving.batch_id, days=1)
    rows(
        producer,
        "UPDATE fanin_children SET finished_at = now() - interval '1 hour' WHERE batch_id = :b AND state = 'succeeded'",
        b=moving.batch_id,
    )

    everything = _json(producer, "ls")  # newest first, roots only (no leaves)
    newest_first = [tree.batch_id, idle.batch_id, done.batch_id, moving.batch_id, stuck.batch_id]
    assert [r["batch_id"] for r in everything] == newest_first
    assert _ids(_json(producer, "ls", "--state", "complete")) == {done.batch_id, tree.batch_id}
    assert _ids(_json(producer, "ls", "--state", "running")) == {stuck.batch_id, idle.batch_id, moving.batch_id}
    stuck_rows = _json(producer, "ls", "--state", "stuck", "--stuck-after", "2h")
    assert _ids(stuck_rows) == {stuck.batch_id} and stuck_rows[0]["stuck"] is True
    assert _ids(_json(producer, "ls", "--state", "stuck", "--stuck-after", "30m")) == {stuck.batch_id, moving.batch_id}
    assert _ids(_json(producer, "ls", "--state", "stuck", "--state", "complete")) == {  # stuck: the default 10m
        stuck.batch_id,
        moving.batch_id,
        done.batch_id,
        tree.batch_id,
    }
    assert _ids(_json(producer, "ls", "--older-than", "12h")) == {stuck.batch_id, moving.batch_id}
    assert _ids(_json(producer, "ls", "--newer-than", "1h")) == {done.batch_id, idle.batch_id, tree.batch_id}
    assert _ids(_json(producer, "ls", "--step", "ls-idle")) == {idle.batch_id}
    assert _ids(_json(producer, "ls", "--limit", "1")) == {tree.batch_id}
    assert _json(producer, "ls", "--state", "expired") == []
    row = next(r for r in everything if r["batch_id"] == tree.batch_id)
    assert (row["planned"], row["succeeded"], row["successor_state"], row["round"]) == (4, 4, "succeeded", 1)

    shown = celery(e2e_env, "ls", "--state", "running")
    assert shown.returncode == 0, shown.stderr
    assert stuck.batch_id in shown.stdout and "(stuck)" in shown.stdout and done.batch_id not in shown.stdout
    bad = fanin(producer, "ls", "--state", "sleeping")
    assert bad.returncode == 2 and "sleeping" in bad.stderr
    bad = fanin(producer, "ls", "--older-than", "soon")
    assert bad.returncode == 2 and "not a duration" in bad.stderr


# --- failures -----------------------------------------------------------------------------------------------------


def test_failures_lists_failed_and_lost_children(e2e_env: dict[str, str], producer: Any, processes: Any) -> None:
    processes.worker()
    processes.relay()
    handle = fan_in_group(
        [tasks.ok.s(0), tasks.fail.s(1), tasks.ok.s(2).set(queue=NOBODY), tasks.fail.s(3)],
        then=tasks.record_run.s("failures"),
        child_timeout=clock.LONG,
    ).apply_async()
    clock.wait_finished(producer, handle.batch_id, {0, 1, 3})  # child 2 is lost, and only it
    clock.expire_child_timeout(producer, handle.batch_id)
    handle.wait_batch(timeout=60)

    data = _json(producer, "failures", handle.batch_id)
    assert (data["batch_id"], data["total"], data["state"]) == (handle.batch_id, 3, "complete")
    by_index = {f["index"]: f for f in data["failures"]}
    assert sorted(by_index) == [1, 2, 3]
    failed = by_index[1]
    assert (failed["task_name"], failed["state"], failed["exc_type"], failed["attempts"]) == (
        "tests.app.fail",
        "failed",
        "ValueError",
        1,
    )
    assert failed["exc_message"] == "child 1 failed on purpose" and failed["args"] == [1]
    lost = by_index[2]
    assert (lost["task_name"], lost["state"], lost["exc_type"], lost["attempts"]) == (
        "tests.app.ok",
        "lost",
        "ChildLost",
        0,
    )
    limited = _json(producer, "failures", handle.batch_id, "--limit", "1")
    assert limited["total"] == 3 and [f["index"] for f in limited["failures"]] == [1]

    shown = celery(e2e_env, "failures", handle.batch_id)
    assert shown.returncode == 0, shown.stderr
    assert "3 failed children" in shown.stdout and "child 1 failed on purpose" in shown.stdout
    assert "lost" in shown.stdout and "ChildLost" in shown.stdout
    clean = fan_in_group([tasks.ok.s(1)], then=tasks.record_run.s("clean")).apply_async()
    clean.wait_batch(timeout=30)
    shown = fanin(producer, "failures", clean.batch_id)
    assert shown.returncode == 0 and "has no failed children" in shown.stdout


# --- retry-failed -------------------------------------------------------------------------------------------------


def test_retry_failed_runs_the_failed_children_and_the_successor_again_as_round_2(
    e2e_env: dict[str, str], producer: Any, processes: Any, successor_runs: Runs
) -> None:
    processes.worker()
    processes.relay()
    key = uuid.uuid4().hex[:8]
    first = fan_in_group(
        [tasks.ok.s(1), tasks.fail_first_time.s(f"{key}-a"), tasks.ok.s(3), tasks.fail_first_time.s(f"{key}-b")],
        then=tasks.record_run.s("rounds", with_values=True),
        step="rounds",
    ).apply_async()
    first.wait_batch(timeout=30)
    (run1,) = successor_runs(first.batch_id)
    assert (run1["outcome"]["round"], run1["outcome"]["retry_of"], run1["outcome"]["failed"]) == (1, None, 2)

    started = _json(producer, "retry-failed", first.batch_id)
    assert (started["original"], started["retried"], started["round"], started["children"]) == (
        first.batch_id,
        first.batch_id,
        2,
        2,
    )
    second = FanInResult(producer, started["batch_id"])
    second.wait_batch(timeout=30)

    (run2,) = successor_runs(second.batch_id)  # the successor ran again, once, with the retried children's counts
    outcome = run2["outcome"]
    assert (outcome["round"], outcome["retry_of"], outcome["step"]) == (2, first.batch_id, "rounds")
    assert (outcome["planned"], outcome["succeeded"], outcome["failed"]) == (2, 2, 0)
    # ... and every child's last outcome across the rounds, in round 1's order (issue 40, item 4)
    assert run2["values"] == [10, f"{key}-a", 30, f"{key}-b"] and run2["label"] == "rounds"
    # The first handle answers with the last round's successor, as Celery users read the chord they started.
    assert first.get(timeout=30) == second.get(timeout=5) == {"label": "rounds", "succeeded": 2, "failed": 0}
    assert len(successor_runs(first.batch_id)) == 1  # round 1's successor did not run again
    old_ids, new_ids = set(child_ids(producer, first.batch_id)), set(child_ids(producer, second.batch_id))
    assert len(new_ids) == 2 and not old_ids & new_ids
    assert second.batch_status().successor_task_id != first.batch_status().successor_task_id

    for shown_id in (first.batch_id, second.batch_id):  # either round's status shows both rounds
        data = _json(producer, "status", shown_id)
        assert [(r["round"], r["batch_id"], r["state"], r["failed"]) for r in data["rounds"]] == [
            (1, first.batch_id, "complete", 2),
            (2, second.batch_id, "complete", 0),
        ]
    data = _json(producer, "status", second.batch_id)
    assert (data["round"], data["retry_of"]) == (2, first.batch_id)
    shown = fanin(producer, "status", first.batch_id)
    assert "rounds" in shown.stdout and second.batch_id in shown.stdout and "2 (this)" not in shown.stdout

    again = celery(e2e_env, "retry-failed", first.batch_id)  # round 2 left nothing to retry
    assert again.returncode == 0, again.stderr
    assert f"nothing to retry: batch {second.batch_id} (round 2) has no failed children" in again.stdout
    rounds = rows(producer, "SELECT count(*) AS n FROM fanin_batches WHERE retry_of = :b", b=first.batch_id)
    assert rounds[0].n == 1


def test_retry_failed_is_refused_while_the_batch_runs(e2e_env: dict[str, str], producer: Any, processes: Any) -> None:
    processes.worker()
    handle = fan_in_group(
        [tasks.fail.s(1), tasks.ok.s(2).set(queue=NOBODY)], then=tasks.record_run.s("running")
    ).apply_async()
    wait_for(lambda: handle.batch_status().failed == 1, 30, message="the failing child")
    refused = fanin(producer, "retry-failed", handle.batch_id)
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    assert f"batch {handle.batch_id} is still running (1 of 2 children unfinished)" in refused.stderr
    assert rows(producer, "SELECT count(*) AS n FROM fanin_batches WHERE retry_of = :b", b=handle.batch_id)[0].n == 0


# --- prune --------------------------------------------------------------------------------------------------------


def test_prune_deletes_old_finished_batches_only(e2e_env: dict[str, str], producer: Any, processes: Any) -> None:
    processes.worker()
    processes.relay()
    old = fan_in_group([tasks.ok.s(1), tasks.fail.s(2)], then=tasks.record_run.s("old")).apply_async()
    old_tree = fan_in_group(
        [tasks.ok.s(i) for i in range(5)], then=tasks.record_run.s("old-tree"), max_width=2
    ).apply_async()
    recent = fan_in_group([tasks.ok.s(1)], then=tasks.record_run.s("recent")).apply_async()
    old_running = fan_in_group(
        [tasks.ok.s(1).set(queue=NOBODY)], then=tasks.record_run.s("x"), child_timeout=None
    ).apply_async()
    for handle in (old, old_tree, recent):
        handle.wait_batch(timeout=30)
    for handle in (old, old_tree, old_running):
        _backdate(producer, handle.batch_id, days=40)
    _backdate(producer, recent.batch_id, days=2)
    old_ids = [old.batch_id, old_tree.batch_id]

    def counts_of(ids: list[str]) -> tuple[int, int, int, int]:
        counts = rows(
            producer,
            """
            SELECT (SELECT count(*) FROM fanin_batches WHERE id = ANY(CAST(:ids AS uuid[]))
                                                          OR parent_id = ANY(CAST(:ids AS uuid[]))) AS batches,
                   (SELECT count(*) FROM fanin_children c JOIN fanin_batches b ON b.id = c.batch_id
                     WHERE b.id = ANY(CAST(:ids AS uuid[])) OR b.parent_id = ANY(CAST(:ids AS uuid[]))) AS children,
                   (SELECT count(*) FROM fanin_successors WHERE batch_id = ANY(CAST(:ids AS uuid[]))) AS successors,
                   (SELECT count(*) FROM fanin_outbox WHERE batch_id = ANY(CAST(:ids AS uuid[]))) AS outbox
            """,
            ids=ids,
        )[0]
        return counts.batches, counts.children, counts.successors, counts.outbox

    assert counts_of(old_ids) == (5, 7, 2, 2)  # two roots and three leaves; 2 + 5 children
    dry = _json(producer, "prune", "--older-than", "30d", "--dry-run")
    assert (dry["batches"], dry["children"], dry["dry_run"]) == (2, 7, True)
    assert counts_of(old_ids) == (5, 7, 2, 2)
    shown = celery(e2e_env, "prune", "--older-than", "30d", "--dry-run")
    assert "would delete 2 batches (7 children) and 0 sagas finished more than 30d ago" in shown.stdout

    report = _json(producer, "prune", "--older-than", "30d", "--chunk", "1", "--max-children", "2")
    assert (report["batches"], report["leaves"], report["children"], report["complete"]) == (2, 3, 7, True)
    assert report["transactions"] >= 4  # at most 2 children per transaction: the tree went leaf by leaf
    assert counts_of(old_ids) == (0, 0, 0, 0)
    assert old_running.batch_status().state == "running"
    assert counts_of([recent.batch_id]) == (1, 1, 1, 1) and counts_of([old_running.batch_id])[:2] == (1, 1)
    assert _json(producer, "prune", "--older-than", "30d")["batches"] == 0

    # The periodic task (`celery_fanin.prune`, for celery beat), run in this process.
    builtin_tasks.register(producer)
    done = producer.tasks[protocol.PRUNE_TASK].apply(kwargs={"older_than": "1d"}).get()
    assert (done["batches"], done["children"]) == (1, 1)
    assert counts_of([recent.batch_id]) == (0, 0, 0, 0) and counts_of([old_running.batch_id])[:2] == (1, 1)
    shown = fanin(producer, "prune", "--older-than", "1d")
    assert shown.returncode == 0 and "deleted 0 batches" in shown.stdout


# --- errors -------------------------------------------------------------------------------------------------------


COMMANDS_WITH_A_BATCH = (("status",), ("watch", "--timeout", "1"), ("failures",), ("retry-failed",))


@pytest.mark.parametrize("command", COMMANDS_WITH_A_BATCH, ids=lambda c: c[0])
def test_unknown_batch_exits_non_zero(producer: Any, command: tuple[str, ...]) -> None:
    missing = str(uuid.uuid4())
    result = fanin(producer, command[0], missing, *command[1:])
    assert result.returncode == 1 and f"no fan-in batch with id {missing}" in result.stderr
    assert "Traceback" not in result.stderr
    garbage = fanin(producer, command[0], "not-a-uuid", *command[1:])
    assert garbage.returncode == 1 and "is not a batch id" in garbage.stderr


@pytest.mark.parametrize(
    "args",
    [
        ("ls",),
        ("prune", "--older-than", "30d"),
        ("failures", str(uuid.uuid4())),
        ("retry-failed", str(uuid.uuid4())),
        ("watch", str(uuid.uuid4())),
        ("status", str(uuid.uuid4())),
    ],
    ids=lambda a: a[0],
)
def test_unreachable_database_exits_non_zero(e2e_env: dict[str, str], args: tuple[str, ...]) -> None:
    env = {**e2e_env, "FANIN_DATABASE_URL": "postgresql://root@127.0.0.1:1/nowhere"}
    result = celery(env, *args)
    assert result.returncode == 1, result.stdout
    assert "Traceback" not in result.stderr and "127.0.0.1" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
