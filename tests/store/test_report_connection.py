"""The workers' report connection (`store.reports.ReportConnection`): a connection per statement in flight, not per
thread, so that pools whose tasks each run in a new thread of control (a gevent or eventlet greenlet) reuse a few
connections instead of opening one per task (found by the review of the store gateway, 2026-12-05)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import pytest

from celery_fanin.store.reports import ReportConnection
from celery_fanin.store.statements import Statement
from tests.sql import BACKEND


@pytest.mark.timeout(60)
def test_short_lived_threads_one_after_another_share_one_connection(clean_db: str) -> None:
    reports = ReportConnection(clean_db)
    pids: list[int] = []
    try:
        for _ in range(30):
            t = threading.Thread(target=lambda: pids.append(reports.one(BACKEND, {})[0]))
            t.start()
            t.join(10)
        assert len(pids) == 30 and len(set(pids)) == 1, f"{len(set(pids))} connections for 30 threads in turn"
    finally:
        reports.reset()


@pytest.mark.timeout(60)
def test_statements_in_flight_together_each_have_a_connection_of_their_own(clean_db: str) -> None:
    """No two statements share a connection at once (psycopg would refuse the second: "another command is already
    in progress"); afterwards the connections are reused, not opened again."""
    reports = ReportConnection(clean_db)
    sleep = Statement("sleep", "a statement that stays in flight", "SELECT pg_backend_pid() FROM pg_sleep(0.3)")
    barrier = threading.Barrier(6)
    pids: list[int] = []
    errors: list[BaseException] = []

    def report() -> None:
        try:
            barrier.wait(10)
            pids.append(reports.one(sleep, {})[0])
        except BaseException as exc:  # noqa: BLE001 - kept for the assertion below
            errors.append(exc)

    try:
        for _ in range(2):
            threads = [threading.Thread(target=report) for _ in range(6)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(20)
        assert not errors, errors
        assert len(pids) == 12 and len(set(pids[:6])) == 6, "two statements in flight shared a connection"
        assert set(pids[6:]) == set(pids[:6]), "the second round opened connections instead of reusing them"
    finally:
        reports.reset()


@pytest.mark.timeout(120)
def test_a_gevent_pool_s_tasks_reuse_a_few_connections(clean_db: str) -> None:
    """Under gevent (as `celery worker -P gevent` patches it), each task is a new greenlet and `threading.local` is
    per greenlet: 100 tasks, 8 at a time, use at most 8 connections (one per task before)."""
    script = textwrap.dedent(
        f"""
        from gevent import monkey; monkey.patch_all()
        import gevent.pool
        from celery_fanin.store.reports import ReportConnection
        from celery_fanin.store.statements import Statement
        reports = ReportConnection({clean_db!r})
        st = Statement("backend", "", "SELECT pg_backend_pid() FROM pg_sleep(0.01)")
        pids = []
        pool = gevent.pool.Pool(8)
        for _ in range(100):
            pool.spawn(lambda: pids.append(reports.one(st, {{}})[0]))
        pool.join()
        reports.reset()
        print(len(pids), len(set(pids)))
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=100, check=False)
    assert done.returncode == 0, done.stderr
    statements, connections = map(int, done.stdout.split())
    assert statements == 100 and 1 <= connections <= 8, f"{connections} connections for 100 greenlet tasks"


@pytest.mark.timeout(60)
def test_after_a_lost_server_the_retry_opens_a_new_connection_instead_of_meeting_each_stale_one(
    clean_db: str,
) -> None:
    """A restart, a failover or a cut kills every idle connection at once: the first statement to meet one fails,
    and the idle ones are dropped with it, so that its retry runs on a new session (review, 2026-12-05)."""
    import psycopg

    reports = ReportConnection(clean_db)
    sleep = Statement("sleep", "a statement that stays in flight", "SELECT pg_backend_pid() FROM pg_sleep(0.2)")
    barrier = threading.Barrier(4)
    pids: list[int] = []

    def report() -> None:
        barrier.wait(10)
        pids.append(reports.one(sleep, {})[0])

    try:
        threads = [threading.Thread(target=report) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        assert len(set(pids)) == 4, "four statements in flight together, four idle connections after"
        with psycopg.connect(clean_db, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(p) FROM unnest(%s::int[]) p", (pids,))
        with pytest.raises(psycopg.OperationalError):
            reports.one(BACKEND, {})
        assert reports.one(BACKEND, {})[0] not in pids, "the retry met another stale connection"
    finally:
        reports.reset()


@pytest.mark.timeout(60)
def test_connections_a_burst_opened_are_closed_once_unused_for_the_idle_time(
    clean_db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A gevent pool's burst opens a connection per statement in flight; a quiet worker must not keep that peak
    until it shuts down (second review, 2026-12-05). Statements one at a time close the stale ones, least recently
    used first, and keep the one they use."""
    import time

    import psycopg

    from celery_fanin.store import reports as reports_module

    reports = ReportConnection(clean_db)
    sleep = Statement("sleep", "a statement that stays in flight", "SELECT pg_backend_pid() FROM pg_sleep(0.2)")
    barrier = threading.Barrier(5)
    burst: list[int] = []

    def report() -> None:
        barrier.wait(10)
        burst.append(reports.one(sleep, {})[0])

    def open_sessions() -> set[int]:
        with psycopg.connect(clean_db, autocommit=True) as admin:
            rows = admin.execute(
                "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
                " AND application_name = 'celery-fanin worker'"
            ).fetchall()
        return {pid for (pid,) in rows}

    try:
        threads = [threading.Thread(target=report) for _ in range(5)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        assert len(set(burst)) == 5 and set(burst) <= open_sessions(), "the burst opened five connections"
        reports.one(BACKEND, {})
        assert set(burst) <= open_sessions(), "a connection closed before it was idle for IDLE_SECONDS"
        monkeypatch.setattr(reports_module, "IDLE_SECONDS", 0.0)  # the minute has passed
        used = {reports.one(BACKEND, {})[0] for _ in range(10)}
        assert len(used) == 1, "statements one at a time used more than one connection"
        deadline = time.monotonic() + 10
        while (still := open_sessions() & set(burst)) != used and time.monotonic() < deadline:
            time.sleep(0.05)  # a closed session leaves pg_stat_activity shortly after
        assert still == used, f"{len(still)} of the burst's connections still open, 1 expected"
    finally:
        reports.reset()
