"""`celery -A proj fanin ...`: thin commands over the modules above, plugged in through `celery.commands`."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import click
from celery import Celery
from sqlalchemy.exc import SQLAlchemyError

from .canvas import BatchStatus, read_status
from .exceptions import FanInError, summarise
from .extension import FanIn

F = TypeVar("F", bound=Callable[..., Any])


def _fanin(ctx: click.Context) -> FanIn:
    obj = ctx.find_root().obj
    app: Celery | None = getattr(obj, "app", None)
    if app is None:
        raise click.ClickException("no Celery app: run as `celery -A proj fanin ...`")
    return FanIn(app)


def _errors_as_exit(fn: F) -> F:
    """Turn celery-fanin and database errors into a one-line message and exit status 1."""
    import functools

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except FanInError as exc:
            raise click.ClickException(str(exc)) from exc
        except SQLAlchemyError as exc:
            raise click.ClickException(f"database error: {summarise(exc)}") from exc

    return wrapper  # type: ignore[return-value]


@click.group(name="fanin")
@click.pass_context
def fanin(ctx: click.Context) -> None:
    """celery-fanin: fan-in batches recorded in Postgres."""


@fanin.command()
@click.pass_context
@_errors_as_exit
def migrate(ctx: click.Context) -> None:
    """Create or upgrade the schema (safe to run twice or concurrently)."""
    applied = _fanin(ctx).migrate()
    if applied:
        for name in applied:
            click.echo(f"applied {name}")
    else:
        click.echo("schema is up to date")


@fanin.command()
@click.option(
    "--poll-interval", type=float, default=None, help="Seconds between polls (default fanin_relay_poll_interval)."
)
@click.option("--once", is_flag=True, help="Run one round and exit.")
@click.option("-l", "--loglevel", default="INFO", show_default=True)
@click.pass_context
@_errors_as_exit
def relay(ctx: click.Context, poll_interval: float | None, once: bool, loglevel: str) -> None:
    """Run the relay sidecar: publish successors from the outbox, and children no producer published."""
    from .relay import Relay

    logging.basicConfig(
        level=loglevel.upper(), stream=sys.stderr, format="[%(asctime)s: %(levelname)s/%(name)s] %(message)s"
    )
    r = Relay(_fanin(ctx), poll_interval=poll_interval)
    if once:
        n = r.run_once()
        click.echo(f"published {n} messages")
        return
    r.install_signal_handlers()
    r.run()


def _render(status: BatchStatus) -> None:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn
    from rich.table import Table

    console = Console()
    table = Table(show_header=False, box=None)
    for key, value in (
        ("batch", status.batch_id),
        ("step", status.step),
        ("state", status.state),
        ("planned", status.planned),
        ("remaining", status.remaining),
        ("succeeded", status.succeeded),
        ("failed", status.failed),
        ("published", status.published),
        ("created", status.created_at.isoformat(timespec="seconds")),
        ("completed", status.completed_at.isoformat(timespec="seconds") if status.completed_at else "-"),
        ("successor", f"{status.successor_state or 'not created'} ({status.successor_task_id})"),
        ("duplicate deliveries", status.successor_duplicates),
    ):
        table.add_row(f"[bold]{key}[/bold]", str(value))
    console.print(table)
    with Progress(TextColumn("children"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  console=console, auto_refresh=False) as progress:  # fmt: skip
        progress.add_task("children", total=max(status.planned, 1), completed=status.planned - status.remaining)
        progress.refresh()


@fanin.command()
@click.argument("batch_id")
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON.")
@click.pass_context
@_errors_as_exit
def status(ctx: click.Context, batch_id: str, as_json: bool) -> None:
    """Show a batch's counts, state and successor."""
    st = read_status(_fanin(ctx), batch_id)
    if as_json:
        click.echo(json.dumps(st.as_dict(), indent=2))
    else:
        _render(st)


@fanin.command()
@click.option("--json", "as_json", is_flag=True, help="Print the repairs as JSON.")
@click.pass_context
@_errors_as_exit
def reconcile(ctx: click.Context, as_json: bool) -> None:
    """Recompute open batches' counters from their child rows; repair and finish what disagrees."""
    from . import maintenance

    fanin_ext = _fanin(ctx)
    repairs = maintenance.reconcile(fanin_ext)
    expired = maintenance.apply_deadlines(fanin_ext)
    if as_json:
        click.echo(json.dumps({"repairs": [r.as_dict() for r in repairs],
                               "deadlines": [str(e.batch_id) for e in expired]}, indent=2))  # fmt: skip
        return
    if not repairs and not expired:
        click.echo("all batches agree with their child rows")
        return
    from rich.console import Console
    from rich.table import Table

    table = Table("batch", "found", "done")
    for r in repairs:
        table.add_row(str(r.batch_id), "\n".join(r.problems), "\n".join(r.actions) or "reported only")
    for e in expired:
        table.add_row(str(e.batch_id), "deadline passed", f"on_deadline={e.on_deadline}, {len(e.abandoned)} abandoned")
    Console().print(table)
