"""`fan_in_group` composes where a chord does: the composition cases of Celery's own chord integration tests
(celery/t/integration/test_canvas.py), restated for a fan-in and run against real `celery worker` processes.

Celery's case each test restates is named in its docstring. A chord needs a result backend, so these workers and
the producer have one (Redis, the broker's database); the fan-in's own handle reads PostgreSQL either way.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from celery import chain, chord, group

from celery_fanin import FanInGroup, FanInResult, fan_in_group
from celery_fanin.producer.group import _RUN_CANVAS_IDS
from tests.app import (
    NOTES_TABLE_DDL,
    add,
    fail,
    identity,
    note,
    ok,
    raise_value_error,
    record_run,
    replacing_child_failing,
    replacing_child_frozen,
    replacing_child_with_group,
    sum_values,
    tsum,
)
from tests.app import values as collect
from tests.sql import notes
from tests.workers import wait_for

TIMEOUT = 60


@pytest.fixture
def canvas(e2e_env: dict[str, str], producer: Any, processes: Any) -> Iterator[dict[str, str]]:
    """Two workers and a relay, all with the result backend a chord needs; the producer app too."""
    backend = e2e_env["FANIN_TEST_BROKER"]
    with psycopg.connect(e2e_env["FANIN_DATABASE_URL"], autocommit=True) as conn:
        conn.execute(NOTES_TABLE_DDL)
        conn.execute("TRUNCATE e2e_notes")
    before = producer.conf.result_backend
    producer.conf.result_backend = backend
    producer._local.__dict__.pop("backend", None)  # the app caches its backend per thread
    processes.worker(extra_env={"FANIN_TEST_RESULT_BACKEND": backend}, concurrency=4)
    processes.relay()
    yield e2e_env
    producer._local.__dict__.pop("backend", None)
    producer.conf.result_backend = before


def _batches(env: dict[str, str]) -> list[tuple[str, str]]:
    with psycopg.connect(env["FANIN_DATABASE_URL"], autocommit=True) as conn:
        rows = conn.execute("SELECT id::text, step FROM fanin_batches WHERE parent_id IS NULL ORDER BY created_at")
        return [(r[0], r[1]) for r in rows]


def test_a_fan_in_in_a_chain_first_middle_and_last(canvas: dict[str, str], producer: Any) -> None:
    """Celery's test_chain_chord_chain_chord and test_chord_in_chain_with_args: the previous result reaches the
    children as a chord's header gets it (prepended to each child's arguments), and the next task gets the
    successor's return value."""
    middle = add.s(1, 2) | fan_in_group([add.s(10), add.s(20)], then=collect.s()) | identity.s()
    assert middle.apply_async().get(timeout=TIMEOUT) == [13, 23]

    first = fan_in_group([add.s(1), add.s(2)], then=collect.s()) | identity.s()
    assert first.apply_async((5,)).get(timeout=TIMEOUT) == [6, 7]

    last = identity.s(2) | fan_in_group([add.s(1), add.s(2)], then=collect.s())
    handle = last.apply_async()
    assert isinstance(handle, FanInResult)  # the chain's result is the fan-in's: its successor's
    assert handle.get(timeout=TIMEOUT) == [3, 4]
    assert handle.successful() and handle.state == "SUCCESS" and handle.batch_status().succeeded == 2

    immutable = identity.s(2) | fan_in_group([ok.s(1)], then=collect.s()).si() | identity.s()
    assert immutable.apply_async().get(timeout=TIMEOUT) == [10]


def test_a_fan_in_sent_twice_with_its_frozen_id_is_one_batch(
    canvas: dict[str, str], producer: Any, processes: Any
) -> None:
    """A fan-in reached from a message is written by `celery_fanin.run_canvas`; a second delivery of it (the
    task before redelivered, the message sent again) carries the same frozen batch id and finds the first one's
    batch: both runs succeed (neither fails on the taken id, nor retries), one batch, one successor run."""
    plan = fan_in_group([ok.s(1), ok.s(2)], then=record_run.s("once"), app=producer)
    frozen = plan.freeze()
    from_message = FanInGroup.from_dict(json.loads(json.dumps(plan)), app=producer)
    first = from_message.apply_async()
    second = from_message.apply_async()
    sent = uuid.uuid5(_RUN_CANVAS_IDS, frozen.batch_id)  # the message's task id: the same for both
    assert first.batch_id == second.batch_id == frozen.batch_id and first.id == frozen.id
    frozen.wait_batch(timeout=TIMEOUT)
    wait_for(lambda: len(_batches(canvas)) == 1, TIMEOUT, message="the batch")
    assert _batches(canvas) == [(frozen.batch_id, "tests.app.record_run")]
    with psycopg.connect(canvas["FANIN_DATABASE_URL"], autocommit=True) as conn:
        runs = conn.execute("SELECT count(*) FROM e2e_successor_runs WHERE label = 'once'").fetchone()
    assert runs is not None and runs[0] == 1
    worker = processes.started[0]
    wait_for(
        lambda: worker.output().count(f"celery_fanin.run_canvas[{sent}] succeeded") == 2,
        TIMEOUT,
        message="both run_canvas runs succeeded",
    )
    assert "run_canvas" not in "".join(line for line in worker.output().splitlines() if "ERROR" in line)


def test_fan_ins_and_a_chain_in_a_chord_header(canvas: dict[str, str], producer: Any) -> None:
    """Celery's test_chord_in_chords_with_chains and test_nested_chord_group: a fan-in in a chord's header is one
    of its members (its successor's value is the member's result), alone or at the end of a chain."""
    header = [
        chain(identity.si(1), fan_in_group([add.s(1), add.s(2)], then=collect.s())),
        fan_in_group([add.si(3, 4)], then=collect.s()),
        identity.si(9),
    ]
    res = chord(header, identity.s()).apply_async()
    assert res.get(timeout=TIMEOUT) == [[2, 3], [7], 9]


def test_a_fan_in_as_a_group_member(canvas: dict[str, str], producer: Any) -> None:
    """Celery's test_nested_group / test_nested_chord (the group form): a fan-in in a group stands where its
    successor's result does."""
    res = group([fan_in_group([ok.s(1), ok.s(2)], then=sum_values.s()), identity.si(5)]).apply_async()
    assert res.get(timeout=TIMEOUT) == [30, 5]


def test_a_fan_in_as_a_chords_body_and_nested_fan_ins(canvas: dict[str, str], producer: Any) -> None:
    """Celery's test_nested_chord: the header's results reach a fan-in body's children; fan-ins nest in fan-ins."""
    body = fan_in_group([tsum.s(100), tsum.s(200)], then=collect.s())
    res = chord([add.s(1, 2), add.s(3, 4)], body).apply_async()
    assert res.get(timeout=TIMEOUT) == [110, 210]

    nested = fan_in_group(
        [fan_in_group([ok.s(1), ok.s(2)], then=sum_values.s()), fan_in_group([ok.s(3)], then=sum_values.s())],
        then=collect.s(),
    )
    assert nested.apply_async().get(timeout=TIMEOUT) == [30, 30]


def test_then_may_be_a_chain_or_a_group(canvas: dict[str, str], producer: Any) -> None:
    """A chord's body may be any canvas: `then=chain(...)` ends with its last task's value, `then=group(...)`
    with the list of its members' (each gets the outcome first)."""
    chained = fan_in_group([ok.s(1), ok.s(2)], then=chain(collect.s(), identity.s())).apply_async()
    assert chained.get(timeout=TIMEOUT) == [10, 20]
    grouped = fan_in_group([ok.s(1), ok.s(2)], then=group(collect.s(), sum_values.s())).apply_async()
    assert grouped.get(timeout=TIMEOUT) == [[10, 20], 30]


def test_a_nested_fan_ins_group_is_left_to_celery(canvas: dict[str, str], producer: Any) -> None:
    """`then=group(...)` of a nested fan-in (a fan-in among another's children): `then_canvas` leaves it to Celery's
    `replace` (a chord of Celery's, on the result backend), so that the outer child is counted with the group's
    values once all are in, not with the id of a stage written for it."""
    nested = fan_in_group([ok.s(1), ok.s(2)], then=group(sum_values.s(), collect.s()))
    handle = fan_in_group([nested, ok.s(3)], then=collect.s()).apply_async()
    assert handle.get(timeout=TIMEOUT) == [[30, [10, 20]], 30]
    assert [key for _, key in _keys(canvas) if key.startswith("then:")] == [], "no stage written"


def _keys(env: dict[str, str]) -> list[tuple[str, str]]:
    with psycopg.connect(env["FANIN_DATABASE_URL"], autocommit=True) as conn:
        rows = conn.execute("SELECT id::text, key FROM fanin_batches WHERE key IS NOT NULL ORDER BY created_at")
        return [(r[0], r[1]) for r in rows]


def test_a_failing_task_inside_a_replacement_ends_what_it_replaced(canvas: dict[str, str], producer: Any) -> None:
    """A chain or group that replaced a child or a successor, whose task before the carrier (the task that takes
    the replaced task's id) fails: Celery publishes no carrier, so that task's failure ends the child (counted
    failed) or the successor (failed with its error), at once and not at `fanin_replaced_timeout` (unset here)."""
    body = fan_in_group([ok.s(1)], then=chain(collect.s(), fail.si(7), identity.s())).apply_async()
    with pytest.raises(ValueError, match="child 7 failed on purpose"):
        body.get(timeout=TIMEOUT)
    assert _successor_end(canvas, body.batch_id) == ("failed", "ValueError", "child 7 failed on purpose")
    with psycopg.connect(canvas["FANIN_DATABASE_URL"], autocommit=True) as conn:
        [trace] = conn.execute(
            "SELECT traceback FROM fanin_successors WHERE batch_id = %s", (body.batch_id,)
        ).fetchone()
    assert trace is not None and "ValueError: child 7 failed on purpose" in trace, "the part's traceback is kept"

    children = fan_in_group(
        [ok.s(1), replacing_child_failing.s(2), replacing_child_failing.s(3, as_group=True)], then=collect.s()
    ).apply_async()
    children.wait_batch(TIMEOUT)
    with psycopg.connect(canvas["FANIN_DATABASE_URL"], autocommit=True) as conn:
        rows = conn.execute(
            "SELECT idx, state, exc_message FROM fanin_children WHERE batch_id = %s ORDER BY idx", (children.batch_id,)
        ).fetchall()
    assert rows == [
        (0, "succeeded", None),
        (1, "failed", "child 2 failed on purpose"),
        (2, "failed", "child 3 failed on purpose"),
    ]
    assert _successor_end(canvas, children.batch_id)[0] == "succeeded"


def test_a_child_replaced_by_a_group_finishes_on_a_database_result_backend(
    e2e_env: dict[str, str], producer: Any, processes: Any
) -> None:
    """Celery upgrades a group replacement to a chord, whose header results a database result backend keeps (Redis
    counts them its own way): only the carrier goes without its result, so the chord's body runs and the child is
    counted (fresh eyes found the header results dropped, and the child never counted)."""
    backend = "db+" + e2e_env["FANIN_DATABASE_URL"].replace("postgresql://", "postgresql+psycopg://", 1)
    processes.worker(extra_env={"FANIN_TEST_RESULT_BACKEND": backend}, concurrency=4)
    processes.relay()
    handle = fan_in_group([replacing_child_with_group.s(1), ok.s(2)], then=collect.s()).apply_async()
    status = handle.wait_batch(TIMEOUT)
    assert (status.succeeded, status.failed) == (2, 0)


def test_a_replacements_carrier_with_a_task_id_of_its_own_reports_for_the_child(
    canvas: dict[str, str], producer: Any
) -> None:
    """`self.replace(chain(a, b))` with `b` frozen beforehand: Celery keeps b's id, and b reports for the child it
    stands for (before, b's report named a task id no child has, and the child was never counted)."""
    handle = fan_in_group([replacing_child_frozen.s(3), ok.s(4)], then=collect.s()).apply_async()
    assert handle.get(timeout=TIMEOUT) == [30, 40]


def _successor_end(env: dict[str, str], batch_id: str) -> tuple[str, str | None, str | None]:
    with psycopg.connect(env["FANIN_DATABASE_URL"], autocommit=True) as conn:
        row = conn.execute(
            "SELECT state, exc_type, exc_message FROM fanin_successors WHERE batch_id = %s", (batch_id,)
        ).fetchone()
    assert row is not None
    return (row[0], row[1], row[2])


def test_link_and_link_error(canvas: dict[str, str], producer: Any) -> None:
    """Celery's test_chord_on_error and the errback tests: a fan-in's `link_error` runs when its successor fails
    (whose error `get()` raises), a fan-in's `link` gets the successor's value, and a fan-in may itself be a
    task's `link` or `link_error`."""
    failing = fan_in_group([ok.s(1)], then=raise_value_error.s())
    failing.link_error(note.si("fan-in failed", "errback"))
    handle = failing.apply_async()
    with pytest.raises(ValueError, match="failed on purpose"):
        handle.get(timeout=TIMEOUT)
    assert handle.failed() and handle.state == "FAILURE"
    assert isinstance(handle.get(timeout=TIMEOUT, propagate=False), ValueError)

    linked = fan_in_group([ok.s(1), ok.s(2)], then=collect.s())
    linked.link(note.s("link"))
    linked.apply_async().get(timeout=TIMEOUT)

    on_success = identity.s(4)
    on_success.link(fan_in_group([add.s(1)], then=record_run.s("as-link", with_values=True)))
    on_success.apply_async()
    on_failure = fail.s(1)
    on_failure.link_error(fan_in_group([ok.si(7)], then=record_run.s("as-errback", with_values=True)))
    on_failure.apply_async()

    noted = wait_for(lambda: len(notes(canvas)) >= 2 and notes(canvas), TIMEOUT, message="the callbacks")
    assert sorted(noted, key=lambda n: str(n[0])) == [("errback", "fan-in failed"), ("link", [10, 20])]

    def runs() -> dict[str, Any]:
        with psycopg.connect(canvas["FANIN_DATABASE_URL"], autocommit=True) as conn:
            rows = conn.execute("SELECT label, values FROM e2e_successor_runs WHERE label LIKE 'as-%'").fetchall()
        return {r[0]: r[1] for r in rows}

    assert wait_for(lambda: len(runs()) == 2 and runs(), TIMEOUT, message="both fan-ins") == {
        "as-link": [5],
        "as-errback": [70],
    }


def test_restore_and_eager_apply(canvas: dict[str, str], producer: Any) -> None:
    """`FanInResult.restore(batch_id, app)` rebuilds the handle from the store, as `GroupResult.restore` does;
    `.apply()` runs a fan-in in this process, and `.delay()` is `apply_async` with partial arguments."""
    handle = fan_in_group([add.s(1), add.s(2)], then=collect.s()).delay(10)
    again = FanInResult.restore(handle.batch_id, producer)
    assert again.id == handle.id and again.get(timeout=TIMEOUT) == [11, 12]
    eager = fan_in_group([add.s(1), add.s(2)], then=collect.s()).apply((20,))
    assert eager.get(timeout=5) == [21, 22]
