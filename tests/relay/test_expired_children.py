"""`recovery.expired_children` / `revoke_expired`: a child whose `expires` passed unconsumed is counted once.

The relay counts a still-pending child as revoked (expired) past its expiry plus a grace; a child that started
is left to its worker, and a worker's report racing the relay's counts once (the other is late). The relay's grace
is `fanin_expires_grace` + `fanin_report_timeout`: a worker that took the child retries its start that long.
"""

from __future__ import annotations

import dataclasses
from datetime import datetime, timedelta, timezone

import pytest
from celery import Celery
from sqlalchemy import Engine, text

from celery_fanin import FanIn, FanInNotConfigured
from celery_fanin.context import Settings
from celery_fanin.relay import maintenance
from celery_fanin.store import batches, recovery
from celery_fanin.store.reports import record_terminal
from tests.sql import Held
from tests.store.helpers import new_batch


def _create(engine: Engine, expires: list[datetime | None]) -> tuple[batches.NewBatch, list[batches.NewChild]]:
    batch, children = new_batch(len(expires))
    children = [dataclasses.replace(c, expires_at=e) for c, e in zip(children, expires, strict=True)]
    with engine.begin() as conn:
        batches.create_batch(conn, batch, children)
    return batch, children


def test_only_pending_children_past_expiry_and_grace_are_counted_revoked(engine: Engine) -> None:
    now = datetime.now(timezone.utc)
    past, recent, future = now - timedelta(seconds=60), now - timedelta(seconds=5), now + timedelta(seconds=60)
    batch, children = _create(engine, [past, past, recent, future, None])
    with engine.begin() as conn:  # child 1 started before it expired: its worker reports it
        conn.execute(text("UPDATE fanin_children SET state = 'started' WHERE task_id = :t"), {"t": children[1].task_id})
    with engine.begin() as conn:
        due = recovery.expired_children(conn, grace_seconds=30)
    assert [task_id for task_id, _, _ in due] == [children[0].task_id]
    with engine.begin() as conn:
        assert recovery.revoke_expired(conn, children[0].task_id, 30)
    with engine.begin() as conn:
        assert not recovery.revoke_expired(conn, children[0].task_id, 30), "counted once"
        assert not recovery.revoke_expired(conn, children[1].task_id, 30), "a started child is its worker's"
        assert not recovery.revoke_expired(conn, children[2].task_id, 30), "within the grace"
        # The worker's own report (Redis delivers the expired message and the worker revokes it) comes late.
        late = record_terminal(Held(conn), children[0].task_id, "revoked", exc_type="_Revoked", exc_message="expired")
        assert (late.counted, late.late) == (False, True)
        row = conn.execute(
            text("SELECT state, exc_message FROM fanin_children WHERE task_id = :t"), {"t": children[0].task_id}
        ).one()
        counts = conn.execute(
            text("SELECT remaining, failed FROM fanin_batches WHERE id = :id"), {"id": batch.id}
        ).one()
    assert tuple(row) == ("revoked", "expired")
    assert tuple(counts) == (4, 1)


def test_the_sweep_waits_for_a_start_retried_through_an_outage(app: Celery, engine: Engine) -> None:
    """Issue 38, hole 4: past `fanin_expires_grace` but within `fanin_report_timeout` a pending child may be one a
    worker took whose start is still being retried: the relay's sweep leaves it; past both, it counts it."""
    app.conf.update(fanin_expires_grace=1, fanin_report_timeout=60)
    fanin = FanIn.of(app)
    assert maintenance.expiry_grace(fanin) == 61
    now = datetime.now(timezone.utc)
    batch, children = _create(engine, [now - timedelta(seconds=30), now - timedelta(seconds=120)])
    assert maintenance.revoke_expired_children(fanin) == [children[1].task_id]
    with engine.connect() as conn:
        states = conn.execute(
            text("SELECT state FROM fanin_children WHERE batch_id = :b ORDER BY idx"), {"b": batch.id}
        ).scalars()
        assert list(states) == ["pending", "revoked"]


@pytest.mark.parametrize("name", ["expires_grace", "report_timeout"])
@pytest.mark.parametrize("value", [-1, "soon", float("nan"), True])
def test_a_bad_expiry_grace_is_refused(app: Celery, name: str, value: object) -> None:
    app.conf[f"fanin_{name}"] = value
    with pytest.raises(FanInNotConfigured, match=f"fanin_{name} must be a number of seconds >= 0"):
        getattr(FanIn.of(app).settings, name)  # checked when read
    with pytest.raises(FanInNotConfigured, match=f"fanin_{name} must be a number of seconds >= 0"):
        Settings.from_conf(app.conf)  # and when all are read at once
