"""Read-only statements for metrics: open and stuck batches, children finished and successor latency over time."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import Connection

from .statements import q


def open_and_stuck(conn: Connection, stuck_after: float) -> tuple[int, int]:
    """Unfinished root batches, and how many of them had no child start or finish for `stuck_after` seconds."""
    row = conn.execute(
        q("open_and_stuck").text,
        {"stuck": stuck_after},
    ).one()
    return int(row[0]), int(row[1])


def database_now(conn: Connection, lag_seconds: float) -> datetime:
    """The database's clock, less a lag (rows committed late still land in the next window)."""
    value: datetime = conn.execute(q("database_now").text, {"lag": lag_seconds}).scalar_one()
    return value


def finished_by_state(conn: Connection, since: datetime, until: datetime) -> list[tuple[str, int]]:
    rows = conn.execute(
        q("finished_by_state").text,
        {"since": since, "until": until},
    )
    return [(str(r[0]), int(r[1])) for r in rows]


def successor_latencies(conn: Connection, since: datetime, until: datetime) -> list[float]:
    """Seconds from each batch's completion to its successor's start, for successors started in the window."""
    rows = conn.execute(
        q("successor_latencies").text,
        {"since": since, "until": until},
    )
    return [float(r[0]) for r in rows]


def successors_finished_by_state(conn: Connection, since: datetime, until: datetime) -> list[tuple[str, int]]:
    """Successors that reached a final state in the window, by state."""
    rows = conn.execute(
        q("successors_finished_by_state").text,
        {"since": since, "until": until},
    )
    return [(str(r[0]), int(r[1])) for r in rows]
