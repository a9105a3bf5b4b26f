"""Tasks for tests/broker/test_publish.py: children that report what their worker received.

Loaded into the test worker with ``-I tests.publish_tasks`` (registered on `tests.app.app`), and registered on the
test's own producer app with `register`, so both sides agree on names and task-level options.
"""

from __future__ import annotations

import time
from typing import Any

from celery import Celery

from tests.app import app as worker_app

ECHO = "tests.publish_tasks.echo"
ROUTED = "tests.publish_tasks.routed"
LIMITED = "tests.publish_tasks.limited"


def _describe(task: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """What the worker made of the message: the arguments, the headers and the options that reached the task."""
    request = task.request
    delivery = request.delivery_info or {}
    return {
        "args": list(args),
        "kwargs": kwargs,
        "fanin_batch": getattr(request, "fanin_batch", None),
        "fanin_index": getattr(request, "fanin_index", None),
        "custom": getattr(request, "x_custom", None),
        "timelimit": list(request.timelimit or (None, None)),
        "eta": request.eta,
        "expires": request.expires,
        "routing_key": delivery.get("routing_key"),
        "ran_at": time.time(),
    }


def register(app: Celery) -> None:
    @app.task(name=ECHO, bind=True, shared=False)
    def echo(self: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return _describe(self, args, kwargs)

    @app.task(name=ROUTED, bind=True, shared=False)  # routed to another queue by the producer's task_routes
    def routed(self: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return _describe(self, args, kwargs)

    @app.task(name=LIMITED, bind=True, shared=False, soft_time_limit=30, time_limit=40)  # task-level options
    def limited(self: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return _describe(self, args, kwargs)


register(worker_app)
