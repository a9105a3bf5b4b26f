"""The exceptions celery-fanin raises; all derive from `FanInError`."""

from __future__ import annotations

from typing import Any

from celery.exceptions import ChordError

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


class SuccessorNotRerunnable(FanInError):
    """`rerun` was asked of a successor that did not fail and was not revoked (it succeeded, or has not finished),
    or of a batch with no such successor."""


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


class ChordHeaderFailed(FanInError, ChordError):
    """A `celery_fanin.chord`'s header did not all succeed, so its body did not run (as Celery's chord fails its
    body with a `ChordError`); raised by the body's handle (`get()`), and the error the body's `link_error`
    callbacks receive. `failures`: the failed children as the outcome lists them (index, task id and name, state,
    error), at most `fanin_outcome_failures_limit` of them; `batch_id` is the chord's batch."""

    def __init__(self, message: str, failures: list[dict[str, Any]] | None = None, batch_id: str | None = None):
        super().__init__(message)
        self.failures = list(failures or [])
        self.batch_id = batch_id

    def __reduce__(self) -> Any:  # pickled with its fields (a result backend, a pickle-serialised errback)
        return (type(self), (str(self), self.failures, self.batch_id))

    @classmethod
    def from_outcome(cls, outcome: dict[str, Any], why: str | None = None) -> ChordHeaderFailed:
        """The error for a chord whose batch ended with this outcome (`store.outcomes.build_outcome`)."""
        failures = list(outcome.get("failures") or [])
        batch_id = outcome.get("batch_id")
        if why == "too_large":
            return cls(
                f"the results of chord {batch_id} are more than fanin_chord_max_bytes: its body gets them all in one "
                "message; use fan_in_group(children, then=...), whose successor streams them from PostgreSQL "
                "(BatchOutcome.values())",
                failures,
                batch_id,
            )
        if why == "unencodable":
            return cls(
                f"the results of chord {batch_id} cannot be encoded with its body's serializer, so its body did not "
                "run: use a task serializer that carries what the header tasks return (their result serializer "
                "does), or fan_in_group(children, then=...), whose successor reads them from PostgreSQL",
                failures,
                batch_id,
            )
        planned, succeeded = outcome.get("planned"), outcome.get("succeeded")
        named = "; ".join(_failure_text(f) for f in failures)
        missing = sum(int(outcome.get(name) or 0) for name in ("failed", "abandoned", "unfinished"))
        more = missing - len(failures)
        if more > 0:
            named += f"{'; ' if named else ''}and {more} more (celery -A proj fanin failures {batch_id})"
        state = outcome.get("state")
        ended = "" if state in (None, "complete", "failed_threshold") else f" (the batch ended {state})"
        return cls(
            f"chord {batch_id}: {succeeded} of {planned} header tasks succeeded{ended}, so its body did not run: "
            + named,
            failures,
            batch_id,
        )


def _failure_text(entry: dict[str, Any]) -> str:
    error = entry.get("exc_type") or entry.get("state")
    if entry.get("exc_message"):
        error = f"{error}({entry['exc_message']!r})"
    return f"#{entry.get('index')} {entry.get('task_name')}[{entry.get('task_id')}] {entry.get('state')}: {error}"
