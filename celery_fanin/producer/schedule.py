"""A fan-in as a `beat_schedule` entry: `fan_in_schedule(name, fan_in, schedule)`.

Beat sends task messages, so the entry is the built-in `celery_fanin.run_canvas` with the fan-in's plan, as plain
JSON (so that django-celery-beat's `DatabaseScheduler` can store it). Its idempotency key names the schedule slot
the tick belongs to: the entry carries the slot's rule (`slot`: the key's prefix and the interval), and the
publisher's `before_task_publish` hook stamps the send time into it (`protocol.stamp_slot`; beat loads the app,
and so `FanIn(app)`). Two beats ticking the same entry, or a restarted beat ticking it again, send the same key
for the same slot, and the second message finds the first one's batch (the key's usual rule). A message that
waits in a queue keeps the slot it was sent for. Without the stamp (a beat whose app was not wired with `FanIn`),
the worker takes the time it runs the message, and says so.
"""

from __future__ import annotations

import json
import math
import time
from datetime import datetime, timedelta, timezone
from typing import Any

from celery.schedules import schedule as interval_schedule
from kombu.utils.json import dumps

from ..exceptions import InvalidFanIn
from ..protocol import RUN_CANVAS_TASK, SLOT_SENT_AT
from .group import FanInGroup
from .plan import BATCH_ID_OPTION


def fan_in_schedule(name: str, fan_in: FanInGroup, schedule: Any, **entry: Any) -> dict[str, Any]:
    """The `beat_schedule` entry that runs `fan_in` on `schedule` (seconds, a timedelta, `schedule(...)` or
    `crontab(...)`), creating one batch per schedule slot however many beats tick it.

    The batch's key is ``beat:<name>:<slot>`` (or ``<fan_in.key>:<slot>``); the slot is the start of the
    interval the tick falls in (counted from the epoch, so every beat agrees on it), and for a crontab or any
    other schedule the minute of the tick. `entry` is the rest of a beat entry (`options`, `relative`)."""
    if not isinstance(name, str) or not name.strip():
        raise InvalidFanIn("a scheduled fan-in needs a name (its beat_schedule entry's)")
    if not isinstance(fan_in, FanInGroup):
        raise InvalidFanIn(f"fan_in_schedule takes a fan_in_group, not {type(fan_in).__name__}")
    if not isinstance(fan_in.children, (list, tuple)):
        raise InvalidFanIn("a scheduled fan_in_group needs a list of children, not a generator")
    if fan_in.then is None:
        raise InvalidFanIn("fan_in_group needs then=: the signature of the successor to run after the children")
    canvas = json.loads(dumps(fan_in))  # plain data: beat pickles its entries, and the message carries it
    for fixed in ("task_id", BATCH_ID_OPTION):  # each slot is a batch (and a successor) of its own
        canvas["options"].pop(fixed, None)
    prefix = fan_in.key or f"beat:{name}"
    unknown = sorted(set(entry) - {"options", "relative"})
    if unknown:
        raise InvalidFanIn(f"fan_in_schedule() got unknown beat entry fields: {', '.join(unknown)}")
    return {
        "task": RUN_CANVAS_TASK,
        "schedule": schedule,
        "kwargs": {"canvas": canvas, "slot": {"prefix": prefix, "period": _period(schedule)}},
        **entry,
    }


def key_of_slot(slot: Any, now: float | None = None) -> tuple[str, bool]:
    """A scheduled message's key (`slot_key`) from its `slot` argument; and whether it carried its send time
    (False: `now`, the time it runs, stands in)."""
    if not isinstance(slot, dict) or not isinstance(slot.get("prefix"), str):
        raise InvalidFanIn(f"a scheduled fan-in's slot must be {{'prefix': ..., 'period': ...}}, not {slot!r}")
    period = slot.get("period")
    if period is not None and (isinstance(period, bool) or not isinstance(period, (int, float)) or period <= 0):
        raise InvalidFanIn(f"a scheduled fan-in's slot period must be a positive number of seconds, not {period!r}")
    sent = slot.get(SLOT_SENT_AT)
    stamped = isinstance(sent, (int, float)) and not isinstance(sent, bool) and math.isfinite(sent)
    return slot_key(slot["prefix"], float(period) if period is not None else None, sent if stamped else now), stamped


def _period(schedule: Any) -> float | None:
    """The interval in seconds of an interval schedule; None for a crontab or anything else."""
    if isinstance(schedule, interval_schedule):
        schedule = schedule.run_every
    if isinstance(schedule, timedelta):
        schedule = schedule.total_seconds()
    if isinstance(schedule, (int, float)) and not isinstance(schedule, bool):
        if not math.isfinite(schedule) or schedule <= 0:
            raise InvalidFanIn(f"a scheduled fan-in's interval must be a positive number of seconds, not {schedule}")
        return float(schedule)
    return None


def slot_key(prefix: str, period: float | None, now: float | None = None) -> str:
    """The key of the slot `now` (beat's send time) falls in: ``<prefix>:<slot start, UTC ISO 8601>``."""
    now = time.time() if now is None else now
    step = period if period is not None else 60.0
    start = math.floor(now / step) * step
    return f"{prefix}:{datetime.fromtimestamp(start, timezone.utc).isoformat()}"
