"""The exceptions celery-fanin raises; all derive from `FanInError`."""

from __future__ import annotations

from .redact import redact


class FanInError(Exception):
    """Base class of every celery-fanin error."""


class FanInNotConfigured(FanInError):
    """The app was not wired with `FanIn(app)`, or has no database URL."""


class InvalidFanIn(FanInError, ValueError):
    """`fan_in_group` was given something it cannot run; raised before anything is written or published."""


class InvalidArguments(InvalidFanIn, TypeError):
    """A child's (or a successor's) arguments do not fit its task, as `Task.apply_async` checks them (for a task
    registered in the producer's app, unless it has `typing=False`); raised before anything is written or
    published. Also a `TypeError`, the error Celery's own check raises."""


class FanInDatabaseError(FanInError):
    """Postgres could not be reached or refused the write; nothing was published."""


class FanInDepthExceeded(FanInError):
    """A fan-in created inside a fan-in child or successor would be nested deeper than `fanin_max_depth`."""


class BatchNotFound(FanInError, LookupError):
    """No batch with that id exists in the store."""


class BatchNotFinished(FanInError):
    """An operation that needs a finished batch (`retry-failed`) was asked of one still open or running."""


class BatchClosed(FanInError):
    """A streaming producer's batch was sealed or cancelled (by an operator, the relay or its deadline) while it
    was still writing children: the chunk it tried to add was not written, and nothing more will be."""


class BatchNotOpen(FanInError):
    """`seal` or `cancel` was asked of a batch that has already ended (or, for `seal`, is no longer open)."""


class InvalidSaga(InvalidFanIn):
    """`saga` was given something it cannot run; raised before anything is written."""


class SagaNotFound(FanInError, LookupError):
    """No saga with that id exists in the store."""


class SagaStateError(FanInError):
    """The saga is not in a state that allows the operation (`resume` of a finished saga, `ack` of a step that
    waits for nothing)."""


def summarise(exc: BaseException) -> str:
    """The first line of a driver error: enough to act on, without SQLAlchemy's multi-line background notes."""
    text = redact(str(getattr(exc, "orig", None) or exc)).strip()
    return text.splitlines()[0] if text else type(exc).__name__
