"""The worker's revoked task ids shared with its prefork pool processes (`dispatch.inline.SharedRevoked`): Celery
sends a revoke to the main process only, and a successor run where its batch completed must not run if its id was
revoked. Real forked processes read what the main process writes after the fork."""

from __future__ import annotations

import multiprocessing
import uuid
from typing import Any

import pytest
from celery.utils.collections import LimitedSet

from celery_fanin.dispatch import inline

pytestmark = pytest.mark.timeout(60)


def _seen_in_a_child(shared: inline.SharedRevoked, task_id: str, ready: object, written: object, out: object) -> None:
    ready.set()  # type: ignore[attr-defined]
    written.wait(10)  # type: ignore[attr-defined]
    out.put(task_id in shared)  # type: ignore[attr-defined]


def test_an_id_revoked_after_the_fork_is_seen_by_the_forked_process() -> None:
    shared = inline.SharedRevoked()
    revoked = LimitedSet(maxlen=100)
    shared.track(revoked)
    task_id = str(uuid.uuid4())
    ctx = multiprocessing.get_context("fork")
    ready, written, out = ctx.Event(), ctx.Event(), ctx.Queue()
    child = ctx.Process(target=_seen_in_a_child, args=(shared, task_id, ready, written, out))
    child.start()
    try:
        assert ready.wait(10)
        revoked.add(task_id)  # as Celery's revoke command does, in the main process, after the pool forked
        written.set()
        assert out.get(timeout=10) is True
    finally:
        child.join(10)
    assert child.exitcode == 0


def test_every_way_celery_fills_its_set_is_mirrored() -> None:
    """`add` (a revoke command, a message found revoked), `update` with ids, a dict of stamps (the state db) or
    another set (`merge_revoked`, mingle); and what it held before."""
    revoked = LimitedSet(maxlen=100)
    before, added, listed, stamped, merged = (str(uuid.uuid4()) for _ in range(5))
    revoked.add(before)
    shared = inline.SharedRevoked()
    shared.track(revoked)
    revoked.add(added)
    revoked.update([listed])
    revoked.update({stamped: 1.0})
    other = LimitedSet(maxlen=10)
    other.add(merged)
    revoked.update(other)
    assert all(i in shared for i in (before, added, listed, stamped, merged))
    assert str(uuid.uuid4()) not in shared


def test_a_table_half_full_is_rebuilt_from_celery_s_bounded_set(monkeypatch: pytest.MonkeyPatch) -> None:
    """Never shrunk as ids expire from Celery's set, the table is rebuilt from that set once half full: what the set
    still holds stays revoked, what it dropped does not fill the table forever."""
    monkeypatch.setattr(inline, "_SLOTS", 64)
    revoked = LimitedSet(maxlen=10)  # Celery's own bound (REVOKES_MAX), small here
    monkeypatch.setattr(inline.worker_state, "revoked", revoked)
    shared = inline.SharedRevoked()
    shared.track(revoked)
    ids = [str(uuid.uuid4()) for _ in range(40)]
    for task_id in ids:
        revoked.add(task_id)
    assert all(task_id in shared for task_id in ids[-10:])  # what the set holds now
    assert sum(task_id in shared for task_id in ids) < 33  # rebuilt at least once: not all 40 kept


def test_a_reader_during_a_rebuild_still_sees_what_was_revoked(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rebuild fills a second table and then switches readers to it: a pool process reading while the main
    process refills never finds the table empty (read here from inside the refill, as a racing reader would)."""
    monkeypatch.setattr(inline, "_SLOTS", 64)
    keep = str(uuid.uuid4())
    seen: list[bool] = []
    shared: inline.SharedRevoked

    class Probed(LimitedSet):  # type: ignore[misc]  # Celery's LimitedSet is untyped
        def __iter__(self) -> Any:
            for item in super().__iter__():
                seen.append(keep in shared)
                yield item

    revoked = Probed(maxlen=10)
    monkeypatch.setattr(inline.worker_state, "revoked", revoked)
    shared = inline.SharedRevoked()
    shared.track(revoked)
    revoked.add(keep)
    for _ in range(40):
        revoked.add(str(uuid.uuid4()))
        revoked.add(keep)  # still revoked: Celery keeps it as its newest
    assert seen and all(seen), "a reader during a rebuild missed an id the worker had revoked"
    assert keep in shared


def test_a_pool_process_that_did_not_inherit_the_ids_runs_nothing_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """A spawned pool process (or a worker whose hooks did not share them) cannot tell: the successor is
    published, for the main process to check."""
    monkeypatch.setattr(inline, "_shared", None)
    monkeypatch.setattr(inline, "current_process", lambda: type("P", (), {"name": "ForkPoolWorker-1"})())
    assert inline._revoked(str(uuid.uuid4())) == "this process cannot see the worker's revoked task ids"
    monkeypatch.setattr(inline, "current_process", lambda: type("P", (), {"name": "MainProcess"})())
    assert inline._revoked(str(uuid.uuid4())) is None
