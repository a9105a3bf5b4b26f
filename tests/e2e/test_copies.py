"""The chaos suite's two copy faults (tests/chaos/copies.py) against real workers and a relay, outside the chaos
suite: the effect it requires of them, a late report for a child published twice and a refused duplicate for a
successor sent again, is what the system does."""

from __future__ import annotations

from collections import Counter
from typing import Any

import psycopg
import pytest

from celery_fanin import fan_in_group
from tests import app as tasks
from tests.chaos import copies
from tests.workers import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


def test_second_copies_take_the_effect_the_chaos_suite_requires(
    producer: Any, processes: Any, e2e_env: dict[str, str]
) -> None:
    url = e2e_env["FANIN_DATABASE_URL"]
    ledger = copies.Ledger(lambda made: copies.read_counts(url, made))
    handle = fan_in_group([tasks.ok.s(i) for i in range(3)], then=tasks.record_run.s("copies")).apply_async()
    with psycopg.connect(url, autocommit=True) as conn:  # no worker yet: all three unfinished
        rows = copies.unfinished_children(conn, handle.batch_id)
    assert len(rows) == 3
    ledger.add(copies.publish_children_again(producer, rows))
    processes.worker()
    processes.relay()
    status = handle.wait_batch(timeout=60)
    assert (status.succeeded, status.successor_state) == (3, "succeeded")
    wait_for(lambda: _seen(ledger)[copies.CHILDREN] == 1, 30, message="a late report of a child published twice")
    with psycopg.connect(url, autocommit=True) as conn:
        again = copies.send_successors_again(conn, 3)
    assert again is not None and set(again.before) == {status.successor_task_id}
    ledger.add(again)
    wait_for(lambda: _seen(ledger)[copies.SUCCESSORS] == 1, 30, message="the successor sent again refused")
    assert handle.batch_status().successor_runs == 1


def _seen(ledger: copies.Ledger) -> Counter[str]:
    ledger.refresh()
    return ledger.seen()
