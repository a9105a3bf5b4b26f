"""Helpers the end-to-end tests share: a signature of the test app's tasks, and a batch whose successor ran once."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from celery import Celery

Runs = Callable[[str], list[dict[str, Any]]]


def sig(app: Celery, name: str, *args: Any, **kwargs: Any) -> Any:
    """A signature of `tests.app.<name>`, by name (the producer need not import the worker's module)."""
    return app.signature(f"tests.app.{name}", args=args, kwargs=kwargs)


def finished(handle: Any, successor_runs: Runs, timeout: float = 60) -> dict[str, Any]:
    """Wait for the batch to finish; its successor succeeded, its body ran exactly once, and the outcome it got
    agrees with the batch's counters. Returns that one run (`label`, `outcome`, `values`)."""
    status = handle.wait_batch(timeout=timeout)
    assert status.successor_state == "succeeded", status
    runs = successor_runs(handle.batch_id)
    assert len(runs) == 1, f"successor body ran {len(runs)} times"
    outcome: dict[str, Any] = runs[0]["outcome"]
    assert outcome["batch_id"] == handle.batch_id
    assert outcome["succeeded"] + outcome["failed"] == outcome["planned"]
    assert (status.planned, status.succeeded, status.failed, status.remaining) == (
        outcome["planned"],
        outcome["succeeded"],
        outcome["failed"],
        0,
    )
    return runs[0]
