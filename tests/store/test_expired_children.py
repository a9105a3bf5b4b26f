"""`recovery.expired_children` / `revoke_expired`: a child whose `expires` passed unconsumed is counted once.

The relay counts a still-pending child as revoked (expired) past its expiry plus a grace; a child that started
is left to its worker, and a worker's report racing the relay's counts once (the other is late).
"""

from __future__ import annotations

import dataclasses
from datetime import datetime, timedelta, timezone

from sqlalchemy import Engine, text

from celery_fanin.store import batches, recovery

from .helpers import new_batch


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
        late = batches.record_terminal(conn, children[0].task_id, "revoked", exc_type="_Revoked", exc_message="expired")
        assert (late.counted, late.late) == (False, True)
        row = conn.execute(
            text("SELECT state, exc_message FROM fanin_children WHERE task_id = :t"), {"t": children[0].task_id}
        ).one()
        counts = conn.execute(
            text("SELECT remaining, failed FROM fanin_batches WHERE id = :id"), {"id": batch.id}
        ).one()
    assert tuple(row) == ("revoked", "expired")
    assert tuple(counts) == (4, 1)
