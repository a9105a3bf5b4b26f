"""The example's Celery app: broker and database from the environment, the partner queue, the nightly schedule.

Everything is read from the environment at import time so that the worker, the relay, beat and the demo (which
starts the first two as subprocesses) all agree on where the broker and the database are.
"""

from __future__ import annotations

import os

from celery import Celery
from celery.schedules import crontab

from celery_fanin import FanIn

DEFAULT_DATABASE_URL = "postgresql+psycopg://root@127.0.0.1/test"
DEFAULT_BROKER_URL = "redis://127.0.0.1:6379/0"

# The partner API is the bottleneck, so its calls get a queue of their own: a worker consuming only this queue
# with a small `-c` is the concurrency limit (Solid Queue's dedicated queue + thread count, in Celery terms).
PARTNER_QUEUE = "partner_sync"

# Rows the simulated warehouse returns for the nightly run; the demo passes its own `--records`.
NIGHTLY_RECORDS = int(os.environ.get("EXAMPLE_NIGHTLY_RECORDS") or 2_000)

app = Celery("example_app")
app.conf.update(
    broker_url=os.environ.get("FANIN_BROKER_URL") or DEFAULT_BROKER_URL,
    fanin_database_url=os.environ.get("FANIN_DATABASE_URL") or DEFAULT_DATABASE_URL,
    # Failures listed inline in the outcome the report receives (the rest stay in Postgres; see write_report).
    fanin_outcome_failures_limit=int(os.environ.get("FANIN_OUTCOME_FAILURES_LIMIT") or 100),
    broker_connection_retry_on_startup=True,
    # No result backend: children's results live in the fan-in store, the report in the app's own table.
    task_ignore_result=True,
    task_routes={"example_app.tasks.sync_user": {"queue": PARTNER_QUEUE}},
    timezone="UTC",
    beat_schedule={
        "partner-sync-daily": {
            "task": "example_app.tasks.partner_sync",
            "schedule": crontab(hour=3, minute=0),
            # No run label: the task derives one from the date, which makes overlapping cron runs no-ops.
            "kwargs": {"total": NIGHTLY_RECORDS},
        },
    },
)

FanIn(app)
