"""A worker on another database than the producer's (a wrong fanin_database_url) cannot count the children it
runs: each report is a WARNING naming that likely cause, not the INFO line of a late report."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from celery import Celery

from celery_fanin import FanIn, fan_in_group
from tests.workers import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(90)]


def test_a_worker_on_another_database_warns_that_it_does_not_know_the_batch(
    processes: Any, producer: Celery, fresh_db: Callable[[], str]
) -> None:
    other = fresh_db()
    app = Celery("migrate-other", set_as_current=False)
    app.conf.fanin_database_url = other
    FanIn(app).migrate()
    FanIn.of(app).dispose()
    worker = processes.worker({"FANIN_DATABASE_URL": other})
    tasks = producer.tasks
    ok = tasks["tests.app.ok"]
    handle = fan_in_group([ok.s(i) for i in range(2)], then=ok.s(), app=producer, child_timeout=None).apply_async()
    batch_id = str(handle.batch_id)

    def warned() -> list[str]:
        return [line for line in worker.output().splitlines() if "WARNING" in line and batch_id in line]

    wait_for(lambda: len(warned()) == 2, 30, 0.2, "a WARNING for each of the two children")
    assert all("this database does not know" in line for line in warned()), warned()
    assert all("Is this worker on the producer's database" in line for line in warned()), warned()
    assert "late or repeated report" not in worker.output()
