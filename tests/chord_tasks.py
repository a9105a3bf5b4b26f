"""The tasks of Celery's own chord integration cases (celery's t/integration/tasks.py), on the e2e app, for
tests/e2e/test_chord_celery_cases.py: the same names, arguments and bodies, so that each ported case reads as
Celery's does. Celery's tasks talk to a Redis of their own; these use the test session's (the broker's database),
and `chord_add` builds `celery_fanin.chord` where Celery's builds `celery.chord`.

Imported at the end of tests/app.py, so that every worker subprocess registers them.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import chain, group

from tests.app import _redis, app

logger = logging.getLogger(__name__)


class ExpectedException(Exception):
    """Sentinel exception for tests (Celery's, with its equality)."""

    def __eq__(self, other: object) -> bool:
        return other is not None and isinstance(other, ExpectedException) and self.args == other.args

    def __hash__(self) -> int:
        return hash(self.args)


@app.task
def identity(x: Any) -> Any:
    """Return the argument."""
    return x


@app.task
def add(x: Any, y: Any, z: Any = None) -> Any:
    """Add two or three numbers (or lists)."""
    if z:
        return x + y + z
    return x + y


@app.task
def tsum(nums: list[int]) -> int:
    """Sum an iterable of numbers."""
    return sum(nums)


@app.task
def write_to_file_and_return_int(file_name: str, i: int) -> int:
    with open(file_name, mode="a", buffering=1) as file_handle:
        file_handle.write(str(i) + "\n")
    return i


@app.task(bind=True)
def add_replaced(self: Any, x: Any, y: Any) -> Any:
    """Add two numbers (via the add task)."""
    raise self.replace(add.s(x, y))


@app.task(bind=True)
def add_to_all(self: Any, nums: list[Any], val: Any) -> Any:
    """Add the given value to all supplied numbers: replaces itself with a group (Celery makes that a chord of the
    group and `celery.accumulate`, which needs a result backend)."""
    subtasks = [add.s(num, val) for num in nums]
    raise self.replace(group(*subtasks))


@app.task(bind=True)
def replace_with_chain(self: Any, *args: Any, link_msg: Any = None) -> Any:
    c = chain(identity.s(*args), identity.s())
    link_sig = redis_echo.s()
    if link_msg is not None:
        link_sig.args = (link_msg,)
        link_sig.set(immutable=True)
    c.link(link_sig)
    return self.replace(c)


@app.task
def chord_add(x: int, y: int) -> None:
    """Celery's, with `celery_fanin.chord` (imported here: tests/app.py imports this module), its header a list:
    `celery_fanin.chord` refuses a single signature as header, which Celery takes as a header of one task."""
    from celery_fanin import chord

    chord([add.s(x, x)], add.s(y)).apply_async()


@app.task
def print_unicode(log_message: str = "håå®ƒ valmuefrø", print_message: str = "hiöäüß") -> None:
    """Task that both logs and print strings containing funny characters."""
    logger.warning(log_message)
    print(print_message)


@app.task(bind=True)
def ids(self: Any, i: int) -> tuple[Any, Any, int]:
    """Returns a tuple of ``root_id``, ``parent_id`` and the argument passed as ``i``."""
    return self.request.root_id, self.request.parent_id, i


@app.task(bind=True)
def collect_ids(self: Any, res: Any, i: int) -> tuple[Any, tuple[Any, Any, int]]:
    """``(previous_result, (root_id, parent_id, i))``."""
    return res, (self.request.root_id, self.request.parent_id, i)


@app.task
def redis_echo(message: Any, redis_key: str = "redis-echo") -> None:
    """Task that appends the message to a redis list."""
    _redis().rpush(redis_key, message if isinstance(message, (str, bytes, int, float)) else repr(message))


@app.task
def redis_count(redis_key: str = "redis-count") -> None:
    """Task that increments a specified or well-known redis key."""
    _redis().incr(redis_key)


@app.task
def fail(*args: Any) -> None:
    """Task that simply raises ExpectedException."""
    raise ExpectedException("Task expected to fail", *args)


@app.task
def errback_old_style(request_id: str) -> str:
    redis_count(request_id)
    return request_id


@app.task
def errback_new_style(request: Any, exc: BaseException, tb: Any) -> str:
    redis_count(request.id)
    return str(request.id)
