"""`FanIn(app)`: the app's context (`celery_fanin.context`) with the worker hooks and built-in tasks wired in.

Only the entry points import this module (the package, the CLI, the pytest plugin); the library's own modules
use `celery_fanin.context.FanIn.of(app)`, so nothing below depends on the wiring.
"""

from __future__ import annotations

from . import builtin_tasks, context
from .producer import eager
from .worker import hooks


class FanIn(context.FanIn):
    """The celery-fanin extension of one Celery app.

    ``FanIn(app)`` wires the app's producers and workers; calling it again for the same app returns the same
    object. The engine is created lazily and again in every forked process, since connections must not cross fork.
    """

    def _wire(self) -> None:
        hooks.install(self.app)
        builtin_tasks.register(self.app)
        eager.install()  # task_always_eager: children and successors run inline are counted as on a worker
