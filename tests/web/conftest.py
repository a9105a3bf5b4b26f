"""Fixtures for the dashboard's tests: batches and sagas written by the real producer and moved by the workers' own
report functions (in this process: no worker needed to read a page), and the app under Starlette's TestClient."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import pytest
from celery import Celery
from starlette.testclient import TestClient

from celery_fanin import FanIn, fan_in_group, protocol
from celery_fanin.store.batches import Start
from celery_fanin.web import create_app
from celery_fanin.worker import runtime, successor_runs


@dataclass
class Batch:
    id: str
    task_ids: list[str]
    step: str
    app: Celery = field(repr=False)


class Store:
    """Writes batches as a producer does and records their children's outcomes as a worker's hooks do."""

    def __init__(self, app: Celery) -> None:
        self.app = app

    def batch(self, n: int, *, app: Celery | None = None, step: str | None = None, **options: Any) -> Batch:
        app = app or self.app
        prefix = uuid.uuid4().hex[:8]
        task_ids = [f"web-{prefix}-{i}" for i in range(n)]
        children = [
            app.signature("web.child", args=(i,), kwargs={"label": f"item-{i}"}).set(task_id=t)
            for i, t in enumerate(task_ids)
        ]
        if step is not None:
            options["step"] = step
        handle = fan_in_group(children, then=app.signature("web.then"), app=app, **options).apply_async()
        return Batch(handle.batch_id, task_ids, handle.batch_status().step, app)

    def finish(self, batch: Batch, index: int, state: str = "succeeded", message: str = "") -> None:
        fanin = FanIn.of(batch.app)
        exc = None if state == "succeeded" else ValueError(message or f"child {index} failed on purpose")
        start = Start(batch.task_ids[index], 0, "web@test", datetime.now(timezone.utc))  # carried by the report
        rec = runtime.current.reporter.record_child(
            fanin,
            batch.task_ids[index],
            protocol.Marker(batch.id, index, None),
            state,
            value=index,
            has_value=state == "succeeded",
            exc=exc,
            start=start,
        )
        assert rec is not None and rec.counted, (batch.id, index)

    def run_successor(self, batch: Batch) -> None:
        fanin = FanIn.of(batch.app)
        status = fanin_status(batch)
        live = successor_runs.admit(fanin, batch.id, status.step, status.successor_task_id, 0)
        assert live is not None
        assert runtime.current.reporter.record_successor(
            fanin, protocol.Marker(batch.id, None, status.step), "succeeded", value=1, live=live
        )


def fanin_status(batch: Batch) -> Any:
    from celery_fanin.producer.result import read_status

    return read_status(FanIn.of(batch.app), batch.id)


@pytest.fixture
def store(app: Celery) -> Store:
    return Store(app)


@pytest.fixture
def dashboard(app: Celery) -> Iterator[Any]:
    web = create_app(app, page_size=50)
    yield web
    web.state.engine.dispose()


@pytest.fixture
def client(dashboard: Any) -> Iterator[TestClient]:
    with TestClient(dashboard) as c:
        yield c
