"""A nightly partner sync in Celery: one scheduler task fans out one task per user, and a report runs after all.

`celery -A example_app worker|beat|fanin ...` finds `app` here; importing `tasks` registers them with it.
"""

from . import saga, tasks  # noqa: F401  registers the tasks, so every `celery -A example_app` process knows them
from .celeryapp import app

__all__ = ["app"]
