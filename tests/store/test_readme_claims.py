"""README claims no other test pinned: settings read on use (an app configured after `FanIn(app)` works, and
`FanIn(app)` twice is one extension), `max_redrives` bounding the redrives of a lost child, and a streamed batch
reading its input at most about a chunk ahead of what it wrote. Against the real PostgreSQL and Redis."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from celery_fanin import FanIn, fan_in_group
from celery_fanin.relay import maintenance
from tests.e2e import clock
from tests.sql import children as child_rows
from tests.sql import row_count

from .helpers import define_tasks

pytestmark = pytest.mark.timeout(60)


def test_settings_are_read_on_use_so_an_app_configured_after_fanin_works(clean_db: str, clean_redis: str) -> None:
    app = Celery("claims-late-config", broker=clean_redis, set_as_current=False)
    tasks = define_tasks(app)
    fanin = FanIn(app)  # before any fanin_ setting exists
    assert FanIn(app) is fanin  # a second call is the same extension: nothing wired twice
    app.conf.fanin_database_url = clean_db
    app.conf.fanin_chunk_size = 7
    try:
        assert FanIn.of(app).settings.chunk_size == 7
        handle = fan_in_group([tasks.add.s(i, i) for i in range(3)], then=tasks.collect.s(), app=app).apply_async()
        assert handle.batch_status().planned == 3  # written to the database configured after FanIn(app)
    finally:
        fanin.dispose()


def _state_and_redrives(app: Celery, batch_id: str) -> tuple[str, int]:
    [child] = child_rows(app, batch_id, "state", "redrives")
    return child["state"], child["redrives"]


def test_a_lost_child_is_redriven_max_redrives_times_then_counted_lost(app: Celery) -> None:
    tasks = define_tasks(app)
    handle = fan_in_group(
        [tasks.add.s(1, 2).set(queue="claims-nobody")],  # nobody consumes it: each redrive is lost again
        then=tasks.collect.s(),
        child_timeout=clock.LONG,
        on_lost="redrive",
        max_redrives=2,
        app=app,
    ).apply_async()
    for redrives in (1, 2):
        clock.expire_child_timeout(app, handle.batch_id)
        report = maintenance.handle_lost_children(FanIn.of(app))
        assert (len(report.redriven), len(report.failed)) == (1, 0)
        assert _state_and_redrives(app, handle.batch_id) == (
            "pending",
            redrives,
        )
    clock.expire_child_timeout(app, handle.batch_id)
    report = maintenance.handle_lost_children(FanIn.of(app))
    assert (len(report.redriven), len(report.failed)) == (0, 1)  # past max_redrives: lost, not redriven again
    assert _state_and_redrives(app, handle.batch_id) == ("lost", 2)
    status = handle.batch_status()
    assert (status.state, status.failed, status.remaining) == ("complete", 1, 0)


@pytest.fixture
def small_chunks(app: Celery) -> Iterator[int]:
    app.conf.fanin_chunk_size = 10
    yield 10


def test_a_streamed_batch_reads_its_input_at_most_a_chunk_ahead_of_what_it_wrote(
    app: Celery, small_chunks: int
) -> None:
    """The memory a streaming producer holds is bounded by its chunk: the generator is never read further than one
    chunk past the children already committed."""
    tasks = define_tasks(app)
    engine = FanIn.of(app).engine
    ahead: list[int] = []

    def source() -> Iterator[Any]:
        for i in range(200):
            written = row_count(engine, "fanin_children")
            ahead.append(i - written)  # items read before this one, minus those committed
            yield tasks.add.s(i, i)

    handle = fan_in_group(source(), then=tasks.collect.s(), app=app).apply_async()
    assert handle.batch_status().planned == 200
    assert max(ahead) <= small_chunks  # a whole list in memory would be 199 ahead at the end
