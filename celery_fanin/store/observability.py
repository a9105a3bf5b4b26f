"""Read-only statements for metrics: open and stuck batches, children finished and successor latency over time."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import Connection, text


def open_and_stuck(conn: Connection, stuck_after: float) -> tuple[int, int]:
    """Unfinished root batches, and how many of them had no child start or finish for `stuck_after` seconds."""
    row = conn.execute(
        text(
            """
            SELECT count(*),
                   count(*) FILTER (WHERE b.created_at < now() - make_interval(secs => :stuck) AND NOT EXISTS (
                       SELECT 1 FROM fanin_children c
                        WHERE c.batch_id IN (SELECT id FROM fanin_batches WHERE id = b.id OR parent_id = b.id)
                          AND greatest(c.started_at, c.finished_at) >= now() - make_interval(secs => :stuck)))
              FROM fanin_batches b
             WHERE b.parent_id IS NULL AND b.state IN ('open', 'running')
            """
        ),
        {"stuck": stuck_after},
    ).one()
    return int(row[0]), int(row[1])


def database_now(conn: Connection, lag_seconds: float) -> datetime:
    """The database's clock, less a lag (rows committed late still land in the next window)."""
    value: datetime = conn.execute(
        text("SELECT now() - make_interval(secs => :lag)"), {"lag": lag_seconds}
    ).scalar_one()
    return value


def finished_by_state(conn: Connection, since: datetime, until: datetime) -> list[tuple[str, int]]:
    rows = conn.execute(
        text(
            """
            SELECT c.state, count(*) FROM fanin_batches b JOIN fanin_children c ON c.batch_id = b.id
             WHERE (b.state IN ('open', 'running') OR b.completed_at >= :since)
               AND c.finished_at >= :since AND c.finished_at < :until
             GROUP BY c.state
            """
        ),
        {"since": since, "until": until},
    )
    return [(str(r[0]), int(r[1])) for r in rows]


def successor_latencies(conn: Connection, since: datetime, until: datetime) -> list[float]:
    """Seconds from each batch's completion to its successor's start, for successors started in the window."""
    rows = conn.execute(
        text(
            """
            SELECT extract(epoch FROM s.started_at - b.completed_at)
              FROM fanin_successors s JOIN fanin_batches b ON b.id = s.batch_id
             WHERE s.started_at >= :since AND s.started_at < :until AND b.completed_at IS NOT NULL
            """
        ),
        {"since": since, "until": until},
    )
    return [float(r[0]) for r in rows]


def successors_finished_by_state(conn: Connection, since: datetime, until: datetime) -> list[tuple[str, int]]:
    """Successors that reached a final state in the window, by state."""
    rows = conn.execute(
        text(
            """
            SELECT state, count(*) FROM fanin_successors
             WHERE finished_at >= :since AND finished_at < :until
             GROUP BY state
            """
        ),
        {"since": since, "until": until},
    )
    return [(str(r[0]), int(r[1])) for r in rows]
