"""The app's own tables (users, sync reports) and every SQL statement the example runs against them.

Plain psycopg with bound parameters only. The tables live in the same database as the fan-in store here, but
nothing requires that: these functions take their own connection.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

import psycopg
from psycopg.rows import dict_row, tuple_row
from sqlalchemy.engine import make_url

SCHEMA = (
    """
    CREATE TABLE IF NOT EXISTS example_users (
        external_id  text        PRIMARY KEY,
        email        text        NOT NULL,
        created_at   timestamptz NOT NULL DEFAULT now()
    )
    """,
    """
    CREATE TABLE IF NOT EXISTS example_sync_reports (
        run_label           text        PRIMARY KEY,
        state               text        NOT NULL,  -- scheduling | running | complete
        batch_id            uuid        UNIQUE,
        scanned             integer,               -- warehouse rows read
        planned             integer,               -- sync_user tasks fanned out (rows whose user exists locally)
        succeeded           integer,               -- synced + discarded
        synced              integer,
        discarded           integer,               -- the partner did not know the user: expected, not an error
        failed              integer,
        failed_external_ids text[]      NOT NULL DEFAULT '{}',
        failure_types       jsonb       NOT NULL DEFAULT '{}',
        scheduled_at        timestamptz NOT NULL DEFAULT now(),
        completed_at        timestamptz
    )
    """,
)


@dataclass(frozen=True)
class SyncReport:
    """One run's report, as `write_report` computes it from the batch outcome."""

    run_label: str
    batch_id: str
    planned: int
    succeeded: int
    synced: int
    discarded: int
    failed: int
    failed_external_ids: list[str] = field(default_factory=list)
    failure_types: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def conninfo(database_url: str) -> str:
    """psycopg wants a libpq URL; the app is configured with SQLAlchemy's (`postgresql+psycopg://`)."""
    return make_url(database_url).set(drivername="postgresql").render_as_string(hide_password=False)


def connect(database_url: str) -> psycopg.Connection[dict[str, Any]]:
    """An autocommit connection: every function below is one statement or opens its own transaction."""
    return psycopg.connect(conninfo(database_url), autocommit=True, row_factory=dict_row, connect_timeout=10)


def setup(conn: psycopg.Connection[Any]) -> None:
    """Create the tables if missing. Idempotent, and serialised so that concurrent callers do not race."""
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(hashtext('example_app.db.setup'))")
        for statement in SCHEMA:
            conn.execute(statement)


def seed_users(conn: psycopg.Connection[Any], users: Iterable[tuple[str, str]]) -> None:
    """Insert users that are not there yet (a rerun of the demo adds nothing)."""
    with conn.transaction(), conn.cursor() as cur:
        cur.executemany(
            "INSERT INTO example_users (external_id, email) VALUES (%s, %s) ON CONFLICT (external_id) DO NOTHING",
            list(users),
        )


def existing_ids(conn: psycopg.Connection[Any], candidate_ids: Sequence[str]) -> set[str]:
    """The candidates the app has: one query for a whole slice, never one per row."""
    with conn.cursor(row_factory=tuple_row) as cur:
        cur.execute("SELECT external_id FROM example_users WHERE external_id = ANY(%s)", (list(candidate_ids),))
        return {r[0] for r in cur}


def claim_run(conn: psycopg.Connection[Any], run_label: str) -> bool:
    """Claim a run label; False if a run with this label was scheduled before (an overlapping cron)."""
    row = conn.execute(
        "INSERT INTO example_sync_reports (run_label, state) VALUES (%s, 'scheduling') "
        "ON CONFLICT (run_label) DO NOTHING RETURNING run_label",
        (run_label,),
    ).fetchone()
    return row is not None


def release_claim(conn: psycopg.Connection[Any], run_label: str) -> None:
    """Give a label back after a fan-out that recorded nothing, so that the run can be tried again."""
    conn.execute("DELETE FROM example_sync_reports WHERE run_label = %s AND state = 'scheduling'", (run_label,))


def mark_scheduled(conn: psycopg.Connection[Any], run_label: str, batch_id: str, scanned: int, planned: int) -> None:
    """Record the batch of a run. A small batch may already be reported, so a 'complete' state is kept."""
    conn.execute(
        """
        UPDATE example_sync_reports
           SET batch_id = %s, scanned = %s, planned = %s,
               state = CASE WHEN state = 'scheduling' THEN 'running' ELSE state END
         WHERE run_label = %s
        """,
        (batch_id, scanned, planned, run_label),
    )


def save_report(conn: psycopg.Connection[Any], report: SyncReport) -> None:
    """Write a run's counts. An upsert, so that a report written twice (or without a claim) is still one row."""
    conn.execute(
        """
        INSERT INTO example_sync_reports
               (run_label, state, batch_id, planned, succeeded, synced, discarded, failed, failed_external_ids,
                failure_types, completed_at)
        VALUES (%(run_label)s, 'complete', %(batch_id)s, %(planned)s, %(succeeded)s, %(synced)s, %(discarded)s,
                %(failed)s, %(failed_external_ids)s, %(failure_types)s, now())
        ON CONFLICT (run_label) DO UPDATE
           SET state = 'complete', batch_id = EXCLUDED.batch_id, planned = EXCLUDED.planned,
               succeeded = EXCLUDED.succeeded, synced = EXCLUDED.synced, discarded = EXCLUDED.discarded,
               failed = EXCLUDED.failed, failed_external_ids = EXCLUDED.failed_external_ids,
               failure_types = EXCLUDED.failure_types, completed_at = EXCLUDED.completed_at
        """,
        {**report.as_dict(), "failure_types": json.dumps(report.failure_types)},
    )


def fetch_report(conn: psycopg.Connection[Any], run_label: str) -> dict[str, Any] | None:
    row: dict[str, Any] | None = conn.execute(
        """
        SELECT run_label, state, batch_id::text AS batch_id, scanned, planned, succeeded, synced, discarded, failed,
               failed_external_ids, failure_types, scheduled_at, completed_at
          FROM example_sync_reports WHERE run_label = %s
        """,
        (run_label,),
    ).fetchone()
    return row


def report_duration(report: Mapping[str, Any]) -> float | None:
    """Seconds from scheduling to the report, or None while the run is not complete."""
    started: datetime | None = report.get("scheduled_at")
    finished: datetime | None = report.get("completed_at")
    return (finished - started).total_seconds() if started and finished else None


# --- the order saga (example_app/saga.py) -------------------------------------------------------------------------

ORDER_LEDGER = """
    CREATE TABLE IF NOT EXISTS example_order_ledger (
        id          bigserial   PRIMARY KEY,
        order_id    text        NOT NULL,
        action      text        NOT NULL,   -- reserve | charge | ship | release | refund
        task_key    text        NOT NULL,   -- the step's task id; for an undo, the task id of what it undoes
        detail      jsonb       NOT NULL DEFAULT '{}',
        at          timestamptz NOT NULL DEFAULT now(),
        UNIQUE (action, task_key)           -- an effect recorded twice is recorded once
    )
"""


def record_order_effect(
    conn: psycopg.Connection[Any], order_id: str, action: str, task_key: str, detail: Mapping[str, Any]
) -> bool:
    """Record one step's (or one undo's) effect under its key; False if it was already there (a rerun)."""
    conn.execute(ORDER_LEDGER)
    row = conn.execute(
        "INSERT INTO example_order_ledger (order_id, action, task_key, detail) VALUES (%s, %s, %s, %s) "
        "ON CONFLICT (action, task_key) DO NOTHING RETURNING id",
        (order_id, action, task_key, json.dumps(dict(detail))),
    ).fetchone()
    return row is not None


def order_ledger(conn: psycopg.Connection[Any], order_id: str) -> list[dict[str, Any]]:
    conn.execute(ORDER_LEDGER)
    rows: list[dict[str, Any]] = conn.execute(
        "SELECT action, task_key, detail, at FROM example_order_ledger WHERE order_id = %s ORDER BY id", (order_id,)
    ).fetchall()
    return rows
