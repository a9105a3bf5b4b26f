"""The model's sessions: `settle` returns only once a released transaction has ended and handed back its
completion, however long its commit takes (otherwise the invariants can see a commit the model has not had)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from sqlalchemy import event, text

from tests.workers import wait_for

from .machine import engine_for
from .sessions import Op, Session, Shared, settle

pytestmark = pytest.mark.timeout(60)


def test_settle_waits_for_a_released_transaction_to_commit(scratch_db: Callable[[], str]) -> None:
    url = scratch_db()
    engine = engine_for(url)
    shared = Shared()
    session = Session(engine, "s0", shared)
    monitor = psycopg.connect(url, autocommit=True)
    try:
        session.submit(Op("hold", lambda conn: conn.execute(text("SELECT 1")).scalar_one()), hold=True)
        wait_for(lambda: session.holding, 10, message="the held operation to run")

        def slow_commit(*_: Any) -> None:  # a commit that takes a while to land, as on a busy machine
            time.sleep(0.5)

        event.listen(session.conn, "commit", slow_commit)
        session.release(commit=True)
        settle([session], monitor)
        assert [(c.op.label, c.committed) for c in shared.completions] == [("hold", True)]
        assert not session.busy
    finally:
        session.close()
        monitor.close()
