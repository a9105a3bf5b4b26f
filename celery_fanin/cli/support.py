"""What every `celery fanin` command shares: the app from Celery's CLI context, and errors as one-line exits."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import click
from celery import Celery
from sqlalchemy.exc import SQLAlchemyError

from ..exceptions import FanInError, summarise
from ..extension import FanIn
from ..ops.inspection import parse_seconds
from ..redact import redact

F = TypeVar("F", bound=Callable[..., Any])


def _fanin(ctx: click.Context) -> FanIn:
    obj = ctx.find_root().obj
    app: Celery | None = getattr(obj, "app", None)
    if app is None:
        raise click.ClickException("no Celery app: run as `celery -A proj fanin ...`")
    return FanIn(app)


def _errors_as_exit(fn: F) -> F:
    """Turn celery-fanin and database errors into a one-line message and exit status 1."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except FanInError as exc:
            raise click.ClickException(redact(str(exc))) from exc
        except SQLAlchemyError as exc:
            raise click.ClickException(f"database error: {summarise(exc)}") from exc

    return wrapper  # type: ignore[return-value]


class Seconds(click.ParamType):
    """A finite number of seconds, at least `minimum` (click's FloatRange takes nan and inf)."""

    name = "seconds"

    def __init__(self, minimum: float) -> None:
        self.minimum = minimum

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        try:
            return parse_seconds(value, self.minimum)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)
