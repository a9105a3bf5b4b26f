"""`celery -A proj fanin saga status|resume|ack`: thin commands over `celery_fanin.sagas`."""

from __future__ import annotations

import json

import click
from rich.console import Console
from rich.table import Table

from ..sagas import driver
from ..sagas import status as saga_status
from .support import _errors_as_exit, _fanin


@click.group(name="saga")
def saga() -> None:
    """Sagas: their steps, their compensations, and the operator's part in a rollback."""


def _render(status: saga_status.SagaStatus) -> None:
    console = Console()
    head = Table(show_header=False, box=None)
    rows: list[tuple[str, str]] = [("saga", status.saga_id), ("state", status.state)]
    if status.failed_step is not None:
        rows.append(("failed step", f"{status.failed_step}: {status.exc_type}: {status.exc_message}"))
    if status.failed_compensation:
        rows.append(("failed compensation", status.failed_compensation))
    if status.resumes:
        rows.append(("resumed", f"{status.resumes} times"))
    rows.append(("created", status.created_at.isoformat(timespec="seconds")))
    rows.append(("finished", status.finished_at.isoformat(timespec="seconds") if status.finished_at else "-"))
    for key, value in rows:
        head.add_row(f"[bold]{key}[/bold]", value)
    console.print(head)

    steps = Table("step", "name", "state", "batch", "detail", title="steps", title_justify="left")
    for s in status.steps:
        detail = f"{s.exc_type}: {s.exc_message}" if s.exc_type else (f"manual: {s.manual_text}" if s.manual_text
                                                                        else "")  # fmt: skip
        steps.add_row(str(s.position), s.name, s.state, s.batch_id or "-", detail)
    console.print(steps)
    if not status.compensations:
        return
    comps = Table("stage", "step", "compensation", "state", "attempt", "undoes", "detail", title="compensations",
                  title_justify="left")  # fmt: skip
    for c in status.compensations:
        if c.kind == "manual":
            what = "manual action"
            detail = c.manual_text or ""
            if c.acked_at:
                detail += f" (acknowledged {c.acked_at.isoformat(timespec='seconds')} by {c.acked_by or '-'})"
        else:
            what = f"{c.task_name} [{c.task_id}]"
            detail = f"{c.exc_type}: {c.exc_message}" if c.exc_type else ""
        comps.add_row(str(c.stage), str(c.position), what, c.state, str(c.attempt) if c.kind != "manual" else "-",
                      c.undo_of if c.kind != "manual" else "-", detail)  # fmt: skip
    console.print(comps)


@saga.command()
@click.argument("saga_id")
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON.")
@click.pass_context
@_errors_as_exit
def status(ctx: click.Context, saga_id: str, as_json: bool) -> None:
    """Show a saga's steps, their states and its compensations."""
    st = saga_status.read_status(_fanin(ctx), saga_id)
    if as_json:
        click.echo(json.dumps(st.as_dict(), indent=2))
    else:
        _render(st)


@saga.command()
@click.argument("saga_id")
@click.pass_context
@_errors_as_exit
def resume(ctx: click.Context, saga_id: str) -> None:
    """Retry a stopped rollback from the compensation that failed (fix its cause first)."""
    st = driver.resume(_fanin(ctx), saga_id)
    click.echo(f"saga {st.saga_id}: {st.state}")


@saga.command()
@click.argument("saga_id")
@click.argument("step")
@click.option("--by", default=None, help="Who did the manual action (recorded with it).")
@click.pass_context
@_errors_as_exit
def ack(ctx: click.Context, saga_id: str, step: str, by: str | None) -> None:
    """Record that the manual action of STEP (its number, or its task name) was done."""
    st = driver.acknowledge(_fanin(ctx), saga_id, step, by)
    click.echo(f"saga {st.saga_id}: step {step} acknowledged; saga {st.state}")
