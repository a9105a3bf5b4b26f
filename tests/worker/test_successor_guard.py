"""The successor's run guard (`store.successors`): one delivery at a time runs the body, never after a final state.

The guard is the exactly-once half of at-least-once publishing: the relay may publish a successor twice and a broker
may redeliver it. A run is a lease on the successor's row, fenced by its run number: nothing depends on a database
session staying up, so a restart, a failover or a dropped connection neither frees a live run nor lets a dead one
write.
"""

from __future__ import annotations

import dataclasses
import socket
import subprocess
import sys
import threading
import uuid
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from sqlalchemy import Connection, Engine, text
from sqlalchemy.exc import OperationalError

from celery_fanin.context import FanIn
from celery_fanin.store import batches, successors
from celery_fanin.worker import successor_runs
from tests.sql import Held, outbox
from tests.sql import successor as successor_row
from tests.store.helpers import create, fetch_one, new_batch

LIVE = {"lease": 60.0, "grace": 60.0, "owner": "test", "owner_key": "key-of-worker-a"}
DEAD = {"lease": 0.0, "grace": 0.0, "owner": "test"}  # a lease that has lapsed as soon as it is taken
OTHER_WORKER = {**LIVE, "owner_key": "key-of-worker-b"}

# What the run guard moves on a successor's row.
GUARD = ("state", "runs", "duplicates", "attempt")


def _claim(
    engine: Engine,
    batch: batches.NewBatch,
    retries: int = 0,
    task_id: str | None = None,
    carrier: str | None = None,
    **lease: Any,
) -> successors.Run | None:
    """A delivery as the worker's guard makes it: admitted, or refused and counted."""
    with engine.begin() as conn:
        got = successors.claim_run(
            Held(conn),
            batch.id,
            batch.step,
            task_id or batch.successor_task_id,
            retries,
            carrier=carrier,
            **{**LIVE, **lease},
        )
        if isinstance(got, successors.Refusal):
            successors.count_duplicate(Held(conn), batch.id, batch.step)
            return None
        return got


def _in(engine: Engine, fn: Any) -> Any:
    with engine.begin() as conn:
        return fn(conn)


def test_one_delivery_runs_a_duplicate_is_refused_and_counted_and_nothing_runs_after_the_end(
    store_engine: Engine,
) -> None:
    batch, _, _ = create(store_engine, 0)
    run = _claim(store_engine, batch)
    assert run == successors.Run(batch.id, batch.step, 1, 0)
    assert successor_row(store_engine, batch.id, *GUARD) == {
        "state": "running",
        "runs": 1,
        "duplicates": 0,
        "attempt": 0,
    }

    assert _claim(store_engine, batch) is None  # a second delivery while the first run is alive
    assert successor_row(store_engine, batch.id, *GUARD)["duplicates"] == 1

    assert _in(
        store_engine, lambda c: successors.record_state(Held(c), batch.id, batch.step, "succeeded", run=run.number)
    )
    assert _claim(store_engine, batch, **DEAD) is None  # a late copy, even of a dead-looking run: final is final
    assert successor_row(store_engine, batch.id, *GUARD) == {
        "state": "succeeded",
        "runs": 1,
        "duplicates": 2,
        "attempt": 0,
    }
    # ... and a final state is never left or overwritten.
    assert not _in(store_engine, lambda c: successors.record_state(Held(c), batch.id, batch.step, "failed"))


def test_a_live_run_does_not_depend_on_the_session_that_started_it(store_engine: Engine) -> None:
    """The old advisory lock died with its session (restart, failover, dropped TCP): a lease does not."""
    batch, _, _ = create(store_engine, 0)
    conn = store_engine.connect()
    assert isinstance(
        successors.claim_run(Held(conn), batch.id, batch.step, batch.successor_task_id, 0, **LIVE), successors.Run
    )
    conn.commit()
    conn.invalidate()  # the session is gone
    conn.close()
    assert _claim(store_engine, batch) is None
    assert successor_row(store_engine, batch.id, *GUARD)["state"] == "running"


def test_a_dead_run_is_taken_over_and_fenced_off(store_engine: Engine) -> None:
    batch, _, _ = create(store_engine, 0)
    old = _claim(store_engine, batch, **DEAD)
    assert old is not None
    new = _claim(store_engine, batch, grace=0.0)
    assert new is not None and new.number == old.number + 1
    # The old run (its worker was only cut off from the database) can neither renew nor record anything now.
    assert _in(store_engine, lambda c: successors.renew_leases(Held(c), [old, new], 60.0)) == {
        (batch.id, batch.step, new.number)
    }
    assert not _in(
        store_engine, lambda c: successors.record_state(Held(c), batch.id, batch.step, "failed", run=old.number)
    )
    assert not _in(store_engine, lambda c: successors.hand_over(Held(c), old, "retrying"))
    assert _in(
        store_engine, lambda c: successors.record_state(Held(c), batch.id, batch.step, "succeeded", run=new.number)
    )


def test_a_run_renewed_in_time_is_not_taken_over(store_engine: Engine) -> None:
    batch, _, _ = create(store_engine, 0)
    run = _claim(store_engine, batch, lease=0.0, grace=0.0)
    assert run is not None
    assert _in(store_engine, lambda c: successors.renew_leases(Held(c), [run], 60.0)) == {(batch.id, batch.step, 1)}
    assert _claim(store_engine, batch, grace=0.0) is None


def test_a_retry_is_admitted_and_a_republished_copy_resumes_the_retry_count(store_engine: Engine) -> None:
    batch, _, _ = create(store_engine, 0)
    first = _claim(store_engine, batch)
    assert first is not None
    due = datetime.now(timezone.utc) + timedelta(seconds=30)
    assert _in(store_engine, lambda c: successors.hand_over(Held(c), first, "retrying", due))
    assert successor_row(store_engine, batch.id, *GUARD)["attempt"] == 1
    # Celery's retry message (retries=1), delivered before the first attempt's task_postrun: admitted.
    second = _claim(store_engine, batch, retries=1)
    assert second == successors.Run(batch.id, batch.step, 2, 1)
    assert _in(store_engine, lambda c: successors.hand_over(Held(c), second, "retrying", due))
    # The relay republished it (a fresh message, retries=0): admitted at the successor's own count.
    third = _claim(store_engine, batch, retries=0)
    assert third == successors.Run(batch.id, batch.step, 3, 2)
    # A stale copy of an earlier retry while the third attempt runs: a duplicate.
    assert _claim(store_engine, batch, retries=1) is None


def test_a_hand_over_that_published_nothing_is_taken_back(store_engine: Engine) -> None:
    batch, _, _ = create(store_engine, 0)
    run = _claim(store_engine, batch)
    assert run is not None
    assert _in(store_engine, lambda c: successors.hand_over(Held(c), run, "retrying"))
    assert _in(store_engine, lambda c: successors.take_back(Held(c), run, 60.0))
    assert successor_row(store_engine, batch.id, *GUARD) == {
        "state": "running",
        "runs": 1,
        "duplicates": 0,
        "attempt": 0,
    }
    assert _claim(store_engine, batch) is None


@pytest.mark.parametrize("state", ["requeued", "replaced"])
def test_a_requeued_or_replaced_successor_admits_its_next_delivery(store_engine: Engine, state: str) -> None:
    batch, _, _ = create(store_engine, 0)
    run = _claim(store_engine, batch, retries=2)
    assert run is not None
    carrier = "token" if state == "replaced" else None
    assert _in(store_engine, lambda c: successors.hand_over(Held(c), run, state, carrier=carrier))
    nxt = _claim(store_engine, batch, carrier=carrier)
    assert nxt is not None and nxt.number == 2
    # A replacement is a new task: its retries count from zero; a requeued message keeps its count.
    assert nxt.attempt == (0 if state == "replaced" else 2)


@pytest.mark.parametrize("state", sorted(successors.FINAL_STATES))
def test_every_final_state_is_final(store_engine: Engine, state: str) -> None:
    batch, _, _ = create(store_engine, 0)
    run = _claim(store_engine, batch)
    assert run is not None
    assert _in(store_engine, lambda c: successors.record_state(Held(c), batch.id, batch.step, state, run=run.number))
    assert _claim(store_engine, batch, **DEAD) is None
    with store_engine.begin() as conn:
        assert successors.stalled(conn, 0.0, 0.0) == []


def test_only_final_and_hand_over_states_are_accepted(store_engine: Engine) -> None:
    batch, _, _ = create(store_engine, 0)
    run = _claim(store_engine, batch)
    assert run is not None
    with store_engine.begin() as conn, pytest.raises(ValueError):
        successors.record_state(Held(conn), batch.id, batch.step, "retrying")
    with store_engine.begin() as conn, pytest.raises(ValueError):
        successors.hand_over(Held(conn), run, "succeeded")


def test_a_delivery_with_another_task_id_or_for_no_successor_is_refused(store_engine: Engine) -> None:
    batch, _, _ = create(store_engine, 0)
    assert _claim(store_engine, batch, task_id="forged") is None
    assert successor_row(store_engine, batch.id, *GUARD) == {
        "state": "pending",
        "runs": 0,
        "duplicates": 1,
        "attempt": 0,
    }
    with store_engine.begin() as conn:
        assert successors.claim_run(Held(conn), uuid.uuid4(), "merge", "x", 0, **LIVE) == successors.Refusal(None, None)


def test_a_run_whose_holder_is_known_to_be_gone_is_taken_over_at_once(store_engine: Engine) -> None:
    """The worker's guard sees that the process holding a live-looking lease is gone (a killed pool process)."""
    batch, _, _ = create(store_engine, 0)
    assert _claim(store_engine, batch, owner="host:1:42:7") is not None
    with store_engine.begin() as conn:
        refused = successors.claim_run(Held(conn), batch.id, batch.step, batch.successor_task_id, 0, **LIVE)
        assert refused == successors.Refusal("running", "host:1:42:7")
        other = successors.claim_run(
            Held(conn), batch.id, batch.step, batch.successor_task_id, 0, **LIVE, dead_owner="host:1:43:7"
        )
        assert isinstance(other, successors.Refusal), "only the holder named gone is taken over"
        taken = successors.claim_run(
            Held(conn), batch.id, batch.step, batch.successor_task_id, 0, **LIVE, dead_owner="host:1:42:7"
        )
        assert isinstance(taken, successors.Run) and taken.number == 2


def test_another_workers_credential_can_neither_see_nor_take_over_a_live_run(store_engine: Engine) -> None:
    """Issue 38, hole 6: the database, not the caller, decides that a run is dead. A caller without the holding
    worker's key is not told who holds the run, and naming the holder as dead (it can read the row) admits
    nothing while the lease is live; the holder's own worker still can."""
    batch, _, _ = create(store_engine, 0)
    assert _claim(store_engine, batch, owner="host:1:42:7") is not None
    with store_engine.begin() as conn:
        refused = successors.claim_run(Held(conn), batch.id, batch.step, batch.successor_task_id, 0, **OTHER_WORKER)
        assert refused == successors.Refusal("running", None)
        for key in ("key-of-worker-b", None, ""):
            forged = successors.claim_run(
                Held(conn),
                batch.id,
                batch.step,
                batch.successor_task_id,
                0,
                **{**OTHER_WORKER, "owner_key": key},
                dead_owner="host:1:42:7",
            )
            assert isinstance(forged, successors.Refusal), f"key {key!r} took over a live run"
    assert successor_row(store_engine, batch.id, *GUARD)["runs"] == 1
    with store_engine.begin() as conn:
        stored = conn.execute(
            text("SELECT run_owner_key FROM fanin_successors WHERE batch_id = :id"), {"id": batch.id}
        ).scalar_one()
    assert stored and "key-of-worker-a" not in stored, "the row keeps a digest, not the key"


def test_a_replaced_successor_admits_only_its_carrier_and_is_never_republished(store_engine: Engine) -> None:
    """Issue 38, hole 1: once a run hands over to a replacement, a copy of the original message (a redelivery, the
    relay's copy, a stall republish: same task id, no token) is refused and counted, however long the replacement
    takes; the replacement's carrier is admitted; and the stall scan republishes nothing for it."""
    batch, _, _ = create(store_engine, 0)
    run = _claim(store_engine, batch)
    assert run is not None
    assert _in(store_engine, lambda c: successors.hand_over(Held(c), run, "replaced", carrier="carrier-1"))
    assert _claim(store_engine, batch) is None, "a copy of the replaced message was admitted"
    assert _claim(store_engine, batch, carrier="carrier-0") is None, "another token was admitted"
    with store_engine.begin() as conn:
        assert successors.stalled(conn, 0.0, 0.0) == []
        assert not successors.republish(conn, batch.id, batch.step, 0.0, 0.0)
    carried = _claim(store_engine, batch, carrier="carrier-1")
    assert carried is not None and carried.number == 2
    assert _claim(store_engine, batch) is None
    assert _claim(store_engine, batch, carrier="carrier-1") is None, "a second copy of the carrier ran beside it"
    assert successor_row(store_engine, batch.id, *GUARD) == {
        "state": "running",
        "runs": 2,
        "duplicates": 4,
        "attempt": 0,
    }
    # The carrier's run hands over again (a replacement of the replacement): only the newest carrier is admitted.
    assert _in(store_engine, lambda c: successors.hand_over(Held(c), carried, "replaced", carrier="carrier-2"))
    assert _claim(store_engine, batch, carrier="carrier-1") is None
    # A replacement that was never published gives the run back its own delivery's token.
    assert _in(store_engine, lambda c: successors.take_back(Held(c), carried, 60.0, "carrier-1"))
    assert _in(store_engine, lambda c: successors.hand_over(Held(c), carried, "retrying"))
    assert _claim(store_engine, batch) is None, "a retry of the carrier must bring the carrier's token"
    assert _claim(store_engine, batch, carrier="carrier-1") is not None
    with store_engine.begin() as conn, pytest.raises(Exception, match="carrier"):
        successors.hand_over(Held(conn), successors.Run(batch.id, batch.step, 3, 0), "replaced")


def test_a_lost_replacement_is_failed_after_its_bound_and_a_live_carrier_run_never_is(store_engine: Engine) -> None:
    """`fanin_replaced_timeout`: a replaced successor whose carrier did not come, or whose carrier's run died, is
    recorded failed (ReplacementLost) once the bound passed; a live carrier run (its lease renewed) is never; the
    carrier arriving after the bound is refused and counted."""
    message = "lost"

    def lost(timeout: float) -> list[uuid.UUID]:
        with store_engine.begin() as conn:
            return [b for b, _ in successors.lost_replacements(conn, timeout)]

    def fail(batch: batches.NewBatch, timeout: float) -> bool:
        return bool(
            _in(store_engine, lambda c: successors.fail_lost_replacement(c, batch.id, batch.step, timeout, message))
        )

    # Not replaced at all (a plain sent successor): never the bound's.
    plain, _, _ = create(store_engine, 0)
    # Replaced, carrier never came.
    never, _, _ = create(store_engine, 0)
    run = _claim(store_engine, never)
    assert run is not None and _in(store_engine, lambda c: successors.hand_over(Held(c), run, "replaced", carrier="c1"))
    # Replaced, the carrier's run live (lease 60 s), and replaced with the carrier's run dead (lease lapsed).
    live, _, _ = create(store_engine, 0)
    dead, _, _ = create(store_engine, 0)
    for batch, lease in ((live, LIVE), (dead, DEAD)):
        first = _claim(store_engine, batch)
        assert first is not None and _in(
            store_engine, lambda c, r=first: successors.hand_over(Held(c), r, "replaced", carrier="c1")
        )
        assert _claim(store_engine, batch, carrier="c1", **lease) is not None
    assert set(lost(3600.0)) == set(), "nothing is past an hour's bound"
    assert not fail(never, 3600.0)
    assert set(lost(0.0)) == {never.id, dead.id}
    assert plain.id not in lost(0.0) and live.id not in lost(0.0)
    assert not fail(live, 0.0), "a live carrier run was ended"
    assert fail(never, 0.0) and fail(dead, 0.0)
    assert not fail(never, 0.0), "recorded twice"
    with store_engine.connect() as conn:
        row = fetch_one(
            conn, "SELECT state, exc_type, exc_message FROM fanin_successors WHERE batch_id = :id", id=never.id
        )
    assert row == {"state": "failed", "exc_type": "ReplacementLost", "exc_message": message}
    assert _claim(store_engine, never, carrier="c1") is None, "the carrier after the bound was admitted"
    assert successor_row(store_engine, never.id, *GUARD)["duplicates"] == 1
    assert lost(0.0) == []

    # Nested: the inner batch's lost replacement counts its outer child failed, and the outer batch completes.
    outer, (outer_child,), _ = create(store_engine, 1)
    inner, _ = new_batch(0)
    inner = dataclasses.replace(inner, parent_task_id=outer_child.task_id)
    with store_engine.begin() as conn:
        batches.create_batch(conn, inner, [])
    first = _claim(store_engine, inner)
    assert first is not None and _in(
        store_engine, lambda c: successors.hand_over(Held(c), first, "replaced", carrier="c1")
    )
    assert fail(inner, 0.0)
    with store_engine.connect() as conn:
        child = fetch_one(conn, "SELECT state, exc_type FROM fanin_children WHERE task_id = :t", t=outer_child.task_id)
        counts = fetch_one(conn, "SELECT failed, succeeded FROM fanin_batches WHERE id = :id", id=outer.id)
    assert child == {"state": "failed", "exc_type": "ReplacementLost"}
    assert counts == {"failed": 1, "succeeded": 0}
    assert successor_row(store_engine, outer.id, *GUARD)["state"] in ("pending", "sent")


def test_an_event_about_a_copy_never_admitted_ends_no_live_run(store_engine: Engine) -> None:
    """Issue 38, hole 3: a worker's main process reports the end of a copy by task id (an expired or unknown copy,
    a time limit or a lost process). A copy that never ran ends nothing while a run is live, and one that ran in
    a process that does not hold the run ends nothing either; each is counted as a duplicate. The copy that did
    run, in the process holding the run, of that worker, ends it."""
    batch, _, _ = create(store_engine, 0)
    assert _claim(store_engine, batch, owner="host:m:42:7") is not None
    tid = batch.successor_task_id

    def event(state: str, **fence: Any) -> bool:
        return bool(
            _in(
                store_engine,
                lambda c: successors.record_state(Held(c), batch.id, batch.step, state, task_id=tid, **fence),
            )
        )

    assert not event("revoked"), "an expired copy ended the live run"
    assert not event("failed", ran_in="host:m:43:", owner_key="key-of-worker-a"), "another process's time limit"
    assert not event("failed", ran_in="host:m:42:", owner_key="key-of-worker-b"), "another worker's event"
    assert successor_row(store_engine, batch.id, *GUARD) == {
        "state": "running",
        "runs": 1,
        "duplicates": 3,
        "attempt": 0,
    }
    assert event("failed", ran_in="host:m:42:", owner_key="key-of-worker-a")
    assert successor_row(store_engine, batch.id, *GUARD)["state"] == "failed"


def test_an_event_about_a_copy_never_run_ends_a_successor_no_run_holds(store_engine: Engine) -> None:
    """The successor's only message expired in the queue: nothing else will run it, so its expiry ends it (as
    before); a copy of a replaced message, or one older than a scheduled retry, does not."""
    batch, _, _ = create(store_engine, 0)
    tid = batch.successor_task_id

    def event(b: batches.NewBatch, **copy: Any) -> bool:
        return bool(
            _in(store_engine, lambda c: successors.record_state(Held(c), b.id, b.step, "revoked", task_id=tid, **copy))
        )

    assert event(batch)
    replaced, _, _ = create(store_engine, 0)
    tid = replaced.successor_task_id
    run = _claim(store_engine, replaced)
    assert run is not None
    assert _in(store_engine, lambda c: successors.hand_over(Held(c), run, "replaced", carrier="c1"))
    assert not event(replaced), "an expired copy of the replaced message ended the replacement's successor"
    assert event(replaced, carrier="c1")
    retried, _, _ = create(store_engine, 0)
    tid = retried.successor_task_id
    run = _claim(store_engine, retried)
    assert run is not None
    assert _in(store_engine, lambda c: successors.hand_over(Held(c), run, "retrying"))
    assert not event(retried, retries=0), "a stale copy ended a successor whose retry is scheduled"
    assert event(retried, retries=1)


def test_a_failed_part_of_a_replacement_ends_only_a_successor_waiting_for_its_carrier(store_engine: Engine) -> None:
    """`fanin_end_replacement`: a task of the replacement before its carrier failed, so the carrier will not come:
    the successor ends, but only while it is `replaced` with that carrier token; never once the carrier's run holds
    it, after a later replacement took it over (another token), under another task id, or with a state that is not
    a part's end."""

    def end(b: batches.NewBatch, carrier: str, state: str = "failed", task_id: str | None = None) -> bool:
        tid = task_id or b.successor_task_id
        return bool(
            _in(
                store_engine,
                lambda c: successors.end_replacement(Held(c), b.id, b.step, tid, carrier, state, "ValueError", "boom"),
            )
        )

    def replaced(carrier: str = "c1") -> tuple[batches.NewBatch, successors.Run]:
        batch, _, _ = create(store_engine, 0)
        run = _claim(store_engine, batch)
        assert run is not None
        assert _in(store_engine, lambda c: successors.hand_over(Held(c), run, "replaced", carrier=carrier))
        return batch, run

    waiting, _ = replaced()
    assert not end(waiting, "c0"), "another replacement's part ended it"
    assert not end(waiting, "c1", task_id="someone-else")
    assert end(waiting, "c1")
    row = successor_row(store_engine, waiting.id, *GUARD)
    assert row["state"] == "failed"
    assert not end(waiting, "c1"), "ended twice"
    assert _claim(store_engine, waiting, carrier="c1") is None, "the carrier ran after its part ended it"

    carried, _ = replaced()
    assert _claim(store_engine, carried, carrier="c1") is not None
    assert not end(carried, "c1"), "a late part's failure ended the run its carrier holds"
    assert successor_row(store_engine, carried.id, *GUARD)["state"] == "running"

    again, _ = replaced()
    second = _claim(store_engine, again, carrier="c1")
    assert second is not None
    assert _in(store_engine, lambda c: successors.hand_over(Held(c), second, "requeued"))
    assert not end(again, "c1"), "a part ended a successor whose carrier's message is requeued"
    assert _in(
        store_engine,
        lambda c: successors.hand_over(Held(c), _claim(store_engine, again, carrier="c1"), "replaced", carrier="c2"),
    )
    assert not end(again, "c1"), "the first replacement's part ended the second replacement's successor"
    assert end(again, "c2", state="revoked")
    assert successor_row(store_engine, again.id, *GUARD)["state"] == "revoked"

    refused, _ = replaced()
    with pytest.raises(Exception, match="not a state a part ends it with"):
        end(refused, "c1", state="succeeded")


def test_racing_deliveries_admit_exactly_one(store_engine: Engine) -> None:
    batch, _, _ = create(store_engine, 0)
    barrier = threading.Barrier(8)
    admitted: list[successors.Run] = []

    def deliver() -> None:
        with store_engine.begin() as conn:
            barrier.wait()
            run = successors.claim_run(Held(conn), batch.id, batch.step, batch.successor_task_id, 0, **LIVE)
            if isinstance(run, successors.Refusal):
                successors.count_duplicate(Held(conn), batch.id, batch.step)
        if isinstance(run, successors.Run):
            admitted.append(run)

    threads = [threading.Thread(target=deliver) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(admitted) == 1
    assert successor_row(store_engine, batch.id, *GUARD) == {
        "state": "running",
        "runs": 1,
        "duplicates": 7,
        "attempt": 0,
    }


def _stalled(conn: Connection, timeout: float = 0.0, grace: float = 0.0) -> list[tuple[uuid.UUID, str]]:
    return successors.stalled(conn, timeout, grace)


def test_stalled_successors_are_lost_messages_and_dead_runs_only(store_engine: Engine) -> None:
    sent, _, _ = create(store_engine, 0)
    with store_engine.begin() as conn:
        conn.execute(text("UPDATE fanin_successors SET state = 'sent' WHERE batch_id = :id"), {"id": sent.id})
    live, _, _ = create(store_engine, 0)
    assert _claim(store_engine, live) is not None
    dead, _, _ = create(store_engine, 0)
    assert _claim(store_engine, dead, **DEAD) is not None
    later, _, _ = create(store_engine, 0)  # a retry due in an hour is not late
    later_run = _claim(store_engine, later)
    assert later_run is not None
    due = datetime.now(timezone.utc) + timedelta(hours=1)
    assert _in(store_engine, lambda c: successors.hand_over(Held(c), later_run, "retrying", due))

    with store_engine.begin() as conn:
        found = set(_stalled(conn))
        assert found == {(sent.id, sent.step), (dead.id, dead.step)}
        assert _stalled(conn, timeout=3600.0, grace=0.0) == [(dead.id, dead.step)]
        assert _stalled(conn, timeout=3600.0, grace=3600.0) == []
        # Republishing a dead run's successor puts it back to `sent`, so one of the copies is admitted.
        assert successors.republish(conn, dead.id, dead.step, 0.0, 0.0)
        assert not successors.republish(conn, live.id, live.step, 0.0, 0.0), "a live run is left alone"
        assert outbox(conn, dead.id, "sent_at") == [{"sent_at": None}]
    assert successor_row(store_engine, dead.id, *GUARD)["state"] == "sent"
    assert _claim(store_engine, dead) is not None


def test_a_guard_that_cannot_get_the_row_raises_the_stores_error(store_engine: Engine) -> None:
    """The hooks retry on the store's errors; a failed claim changes nothing."""
    batch, _, _ = create(store_engine, 0)
    with store_engine.connect() as holder, holder.begin():
        holder.execute(text("SELECT 1 FROM fanin_successors WHERE batch_id = :id FOR UPDATE"), {"id": batch.id})
        with store_engine.connect() as conn:
            conn.execute(text("SET lock_timeout = '200ms'"))
            conn.commit()
            with pytest.raises(OperationalError, match="lock timeout"):
                successors.claim_run(Held(conn), batch.id, batch.step, batch.successor_task_id, 0, **LIVE)
            conn.rollback()
    assert successor_row(store_engine, batch.id, *GUARD) == {
        "state": "pending",
        "runs": 0,
        "duplicates": 0,
        "attempt": 0,
    }


def test_the_worker_admits_on_its_report_connection_without_a_pool_checkout(app: Any, store_engine: Engine) -> None:
    """`successor_runs.admit`, between a successor's delivery and its first line, is one statement on the pool
    process's report connection: no checkout of the engine's pool (whose pre-ping is a round trip more). It admits
    once, refuses and counts a second delivery, and its admission is committed (seen from another session)."""
    from sqlalchemy import event

    from celery_fanin import FanIn
    from celery_fanin.worker import successor_runs

    fanin = FanIn.of(app)
    batch, _, _ = create(store_engine, 0)
    checkouts: list[object] = []
    event.listen(fanin.engine, "checkout", lambda *args: checkouts.append(args))
    live = successor_runs.admit(fanin, str(batch.id), batch.step, batch.successor_task_id, 0)
    assert live is not None and live.run == successors.Run(batch.id, batch.step, 1, 0)
    assert successor_runs.admit(fanin, str(batch.id), batch.step, batch.successor_task_id, 0) is None
    assert checkouts == []
    assert successor_row(store_engine, batch.id, *GUARD) == {
        "state": "running",
        "runs": 1,
        "duplicates": 1,
        "attempt": 0,
    }
    successor_runs.abandon(live)


def _dead_pid() -> int:
    """The pid of a process of this machine that has exited (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=30)
    return proc.pid


def test_a_holder_on_another_machine_with_this_hostname_is_never_judged_gone(
    store_engine: Engine, app: Any, tmp_path: Any
) -> None:
    """Issue 38, hole 2: two hosts with one hostname (VMs from one image, containers in the host's PID namespace)
    share the init PID namespace's inode, so hostname and namespace could not tell their processes apart: a live
    run on the other host whose pid is free here was taken over at once. The machine's identity now includes the
    kernel's boot id. Two owners with one hostname: the other machine's run is refused even when its worker's key
    is the caller's (the worst case); this machine's dead process is taken over."""
    here = successor_runs.machine_id()
    assert here, "this machine's boot id and PID namespace are readable"
    boot = tmp_path / "boot_id"
    boot.write_text(str(uuid.uuid4()) + "\n")
    elsewhere = successor_runs.machine_id(boot_id=str(boot))
    assert elsewhere != here and elsewhere.split("/")[1] == here.split("/")[1], "same namespace inode, other boot"
    pid = _dead_pid()
    host = socket.gethostname()
    other_machines_holder = f"{host}:{elsewhere}:{pid}:1"
    assert not successor_runs._gone(other_machines_holder)
    assert successor_runs._gone(successor_runs.process_prefix(pid) + "1")
    fanin = FanIn.of(app)
    for holder, taken in ((other_machines_holder, False), (successor_runs.process_prefix(pid) + "1", True)):
        batch, _, _ = create(store_engine, 0)
        assert _claim(store_engine, batch, owner=holder, owner_key=successor_runs.worker_key()) is not None
        live = successor_runs.admit(fanin, str(batch.id), batch.step, batch.successor_task_id, 0)
        assert (live is not None) is taken, holder
        if live is not None:
            successor_runs.abandon(live)
