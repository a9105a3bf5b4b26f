"""The successor's start guard (`batches.claim_successor_run`): one delivery runs the body, every other is refused
and counted, and the connection it leaves behind holds the run's lock and is transactional again.

The guard is the exactly-once half of at-least-once publishing: the relay may publish a successor twice and a broker
may redeliver it, and only the delivery that takes the advisory lock and moves the row to `running` runs.
"""

from __future__ import annotations

import uuid
from typing import Any

import psycopg.pq
import pytest
from sqlalchemy import Connection, Engine, text
from sqlalchemy.exc import OperationalError

from celery_fanin.store import batches

from .helpers import create, fetch_one


def _successor(engine: Engine, batch_id: uuid.UUID) -> dict[str, Any]:
    with engine.connect() as conn:
        return fetch_one(conn, "SELECT state, runs, duplicates FROM fanin_successors WHERE batch_id = :id", id=batch_id)


def _run_locks(conn: Connection) -> int:
    """Advisory locks of the run-lock class held by the session of `conn`."""
    return int(
        conn.execute(
            text(
                "SELECT count(*) FROM pg_locks"
                " WHERE locktype = 'advisory' AND classid = :cls AND pid = pg_backend_pid()"
            ),
            {"cls": batches.RUN_LOCK_CLASS},
        ).scalar_one()
    )


def _in_transaction(conn: Connection) -> bool:
    """Whether the server has a transaction open on `conn`'s session (psycopg's view of it)."""
    raw = conn.connection.dbapi_connection
    assert raw is not None
    return raw.info.transaction_status != psycopg.pq.TransactionStatus.IDLE  # type: ignore[attr-defined]


def test_one_delivery_runs_and_a_concurrent_duplicate_is_refused_and_counted(store_engine: Engine) -> None:
    batch, _, _ = create(store_engine, 0)
    with store_engine.connect() as first, store_engine.connect() as second:
        assert batches.claim_successor_run(first, batch.id, batch.step, 0) is True
        assert _successor(store_engine, batch.id) == {"state": "running", "runs": 1, "duplicates": 0}
        assert _run_locks(first) == 1
        first.rollback()

        # A second delivery while the first is alive: the lock is taken, so it never touches the row's state.
        assert batches.claim_successor_run(second, batch.id, batch.step, 0) is False
        assert _successor(store_engine, batch.id) == {"state": "running", "runs": 1, "duplicates": 1}
        assert _run_locks(second) == 0
        second.rollback()

        batches.record_successor_state(first, batch.id, batch.step, "succeeded")
        first.commit()
        batches.release_successor_run(first, batch.id, batch.step)
        assert _run_locks(first) == 0
        first.rollback()

        # After the run finished, a late copy takes the lock but finds nothing to run: refused, lock let go.
        assert batches.claim_successor_run(second, batch.id, batch.step, 0) is False
        assert _run_locks(second) == 0
        second.rollback()
    assert _successor(store_engine, batch.id) == {"state": "succeeded", "runs": 1, "duplicates": 2}


def test_a_run_whose_process_died_is_taken_over(store_engine: Engine) -> None:
    batch, _, _ = create(store_engine, 0)
    dead = store_engine.connect()
    assert batches.claim_successor_run(dead, batch.id, batch.step, 0) is True
    dead.invalidate()  # the process died: its session, and so its lock, are gone
    dead.close()
    with store_engine.connect() as conn:
        assert batches.claim_successor_run(conn, batch.id, batch.step, 0) is True
        assert _run_locks(conn) == 1
        conn.rollback()
    assert _successor(store_engine, batch.id) == {"state": "running", "runs": 2, "duplicates": 0}


def test_a_retry_runs_only_while_its_retries_allow(store_engine: Engine) -> None:
    batch, _, _ = create(store_engine, 0)
    with store_engine.connect() as conn:
        for retries in (0, 1):  # the first run, then Celery's retry number 1
            assert batches.claim_successor_run(conn, batch.id, batch.step, retries) is True
            batches.record_successor_state(conn, batch.id, batch.step, "retrying")
            conn.commit()
            batches.release_successor_run(conn, batch.id, batch.step)
        # A stale copy of the first retry's message, delivered after the second run was recorded: refused.
        assert batches.claim_successor_run(conn, batch.id, batch.step, 1) is False
        assert _run_locks(conn) == 0
        conn.rollback()
    assert _successor(store_engine, batch.id) == {"state": "retrying", "runs": 2, "duplicates": 1}


def test_the_guards_connection_is_transactional_again_for_the_successors_state(store_engine: Engine) -> None:
    """The guard runs in autocommit; what the hooks write on the same connection afterwards must not."""
    batch, _, _ = create(store_engine, 0)
    with store_engine.connect() as conn:
        assert batches.claim_successor_run(conn, batch.id, batch.step, 0) is True
        assert not _in_transaction(conn)  # the guard's own writes are committed
        batches.record_successor_state(conn, batch.id, batch.step, "failed", exc_type="ValueError", exc_message="x")
        assert _in_transaction(conn)
        conn.rollback()  # the hooks' transaction failed: nothing of it stays
        assert _successor(store_engine, batch.id)["state"] == "running"
        assert _run_locks(conn) == 1  # the session's lock outlives both transactions
        conn.rollback()


def test_a_missing_successor_is_refused_and_leaves_no_lock(store_engine: Engine) -> None:
    with store_engine.connect() as conn:
        assert batches.claim_successor_run(conn, uuid.uuid4(), "merge", 0) is False
        assert _run_locks(conn) == 0
        conn.rollback()


def test_a_guard_that_cannot_get_the_row_raises_the_stores_error(store_engine: Engine) -> None:
    """The hooks retry on the store's errors (on a fresh connection: the failed one may hold the run lock)."""
    batch, _, _ = create(store_engine, 0)
    with store_engine.connect() as holder, holder.begin():
        holder.execute(text("SELECT 1 FROM fanin_successors WHERE batch_id = :id FOR UPDATE"), {"id": batch.id})
        with store_engine.connect() as conn:
            conn.execute(text("SET lock_timeout = '200ms'"))
            conn.commit()
            with pytest.raises(OperationalError, match="lock timeout"):
                batches.claim_successor_run(conn, batch.id, batch.step, 0)
            assert not conn.in_transaction() and not _in_transaction(conn)
            conn.invalidate()
    assert _successor(store_engine, batch.id) == {"state": "pending", "runs": 0, "duplicates": 0}
