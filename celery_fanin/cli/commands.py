"""`celery -A proj fanin ...`: thin commands over the library's modules, plugged in through `celery.commands`."""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import click
from celery import Celery
from pythonjsonlogger.json import JsonFormatter
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    Task,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table
from rich.text import Text
from rich.tree import Tree

from ..exceptions import FanInDatabaseError
from ..ops import schema
from ..ops.inspection import MAX_COUNT, describe, list_batches, parse_duration
from ..ops.inspection import failures as read_failures
from ..ops.retention import prune as run_prune
from ..ops.rounds import retry_failed as start_round
from ..producer import actions
from ..producer.result import BatchStatus, parse_batch_id, read_status
from ..protocol import BatchState, SuccessorState
from ..relay import maintenance
from ..relay.loop import Relay
from ..relay.metrics import serve
from ..relay.reruns import rerun as start_rerun
from ..web.cli import command as dashboard_command
from .saga import saga
from .support import Seconds, _errors_as_exit, _fanin


@click.group(name="fanin")
@click.pass_context
def fanin(ctx: click.Context) -> None:
    """celery-fanin: fan-in batches recorded in Postgres."""


@fanin.command()
@click.option("--check", is_flag=True, help="Apply nothing; exit 1 if migrations are pending, 0 if none.")
@click.option("--sql", "show_sql", is_flag=True, help="Apply nothing; print the SQL that migrate would run.")
@click.pass_context
@_errors_as_exit
def migrate(ctx: click.Context, check: bool, show_sql: bool) -> None:
    """Create or upgrade the schema (safe to run twice or concurrently).

    With --check or --sql nothing is applied: --check exits 1 when migrations are pending (the schema is behind
    this celery-fanin) and 0 when it is current; --sql prints the SQL `migrate` would run.
    """
    if check or show_sql:
        todo = schema.pending(_fanin(ctx))
        if show_sql:
            click.echo(schema.script(todo), nl=False)
        report = click.echo if not show_sql else lambda text: click.echo(text, err=True)
        if todo:
            report(f"schema is behind: {len(todo)} pending migration(s): {', '.join(map(schema.name, todo))}")
            if check:
                ctx.exit(1)
        else:
            report("schema is up to date")
        return
    applied = _fanin(ctx).migrate()
    if applied:
        for name in applied:
            click.echo(f"applied {name}")
    else:
        click.echo("schema is up to date")


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def configure_logging(app: Celery, loglevel: str, logfile: str | None, log_format: str) -> None:
    """The relay's log, set up by Celery as a worker's is (`app.log.setup`): the `setup_logging` signal, Django's
    `LOGGING`, `worker_hijack_root_logger` and `worker_log_format` apply; without any of them, stderr or `logfile`.

    `--log-format json` then writes one JSON object per line on every root handler (python-json-logger: the time,
    level, logger and message, plus a line's `batch_id`, `step` or `saga_id`, and the traceback as `exc_info`). A
    file is reopened when logrotate moves it away (Celery's WatchedFileHandler), so no copytruncate is needed."""
    app.log.setup(loglevel=loglevel.upper(), logfile=logfile, redirect_stdouts=False, colorize=False)
    if log_format != "json":
        return
    for handler in logging.getLogger().handlers:
        handler.setFormatter(
            JsonFormatter(
                "%(levelname)s %(name)s %(message)s",
                rename_fields={"levelname": "level", "name": "logger"},
                timestamp="time",
            )
        )


def load_like_a_worker(app: Celery) -> None:
    """Import the app's task modules as a worker does at start (`imports`, `include`, `autodiscover_tasks()`, and
    Django's setup through Celery's Django fixup), so that the relay routes a successor or a redriven child by its
    task's own options (`@shared_task(queue=...)`) exactly as the workers' app would."""
    app.loader.import_default_modules()
    app.finalize(auto=True)


@fanin.command()
@click.option(
    "--poll-interval",
    type=Seconds(0.01),
    default=None,
    help="Seconds between polls (default fanin_relay_poll_interval).",
)
@click.option("--once", is_flag=True, help="Run one round and exit.")
@click.option(
    "--metrics-port",
    type=click.IntRange(0, 65535),
    default=None,
    help="Serve Prometheus metrics on this port (/metrics), with the /healthz and /readyz probes.",
)
@click.option(
    "--metrics-host",
    default="127.0.0.1",
    show_default=True,
    help="Address the metrics listen on: loopback unless told (0.0.0.0 for a scraper or probe on another host).",
)
@click.option(
    "-l", "--loglevel", type=click.Choice(LOG_LEVELS, case_sensitive=False), default="INFO", show_default=True
)
@click.option(
    "-f",
    "--logfile",
    type=click.Path(dir_okay=False),
    default=None,
    help="Append the log to this file (default stderr).",
)
@click.option(
    "--log-format",
    type=click.Choice(("text", "json")),
    default="text",
    show_default=True,
    help="json: one JSON object per line (time, level, logger, message, batch_id/step where a line has them).",
)
@click.pass_context
@_errors_as_exit
def relay(
    ctx: click.Context,
    poll_interval: float | None,
    once: bool,
    metrics_port: int | None,
    metrics_host: str,
    loglevel: str,
    logfile: str | None,
    log_format: str,
) -> None:
    """Run the relay sidecar: publish successors from the outbox, and children no producer published."""
    fanin_ = _fanin(ctx)
    load_like_a_worker(fanin_.app)
    try:
        configure_logging(fanin_.app, loglevel, logfile, log_format)
    except OSError as exc:
        raise click.BadParameter(f"cannot open {logfile}: {exc.strerror}", param_hint="--logfile") from exc
    r = Relay(fanin_, poll_interval=poll_interval)
    if metrics_port is not None:
        serve(r.fanin, metrics_port, metrics_host, relay=r)
    if once:
        fanin_.check_settings()  # as `Relay.run` does
        fanin_.check_schema()
        n = r.run_once()
        click.echo(f"published {n} messages")
        return
    r.install_signal_handlers()
    r.run()


def _ago(seconds: float | None) -> str:
    """`3d 4h`, `12m 5s`, `40s`: two units at most."""
    if seconds is None:
        return "-"
    sign, seconds = ("-" if seconds < 0 else ""), abs(seconds)
    parts: list[str] = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if seconds >= size or (unit == "s" and not parts):
            n = int(seconds // size)
            parts.append(f"{n}{unit}")
            seconds -= n * size
        if len(parts) == 2:
            break
    return sign + " ".join(parts)


def _console() -> Any:
    """The terminal's console; piped output is 160 columns wide, so that batch ids are never cut."""
    console = Console()
    return console if console.is_terminal else Console(width=max(console.width, 160))


def _when(iso: str | None) -> str:
    return iso[:19].replace("T", " ") if iso else "-"


def _node_line(node: dict[str, Any]) -> str:
    kind = node["kind"]
    label = {
        "root": "batch",
        "leaf": "leaf",
        "nested": f"child {node.get('child_index')} → nested batch",
        "stage": "next stage",
        "spawned": "started batch",
    }.get(kind, kind)
    done = node["succeeded"] + node["failed"]
    succ = node["successor_state"] or ("-" if kind == "leaf" else "not created")
    text = f"{label} [bold]{node['batch_id']}[/bold] {escape(node['step'])}  {node['state']}  {done}/{node['planned']}"
    if node["failed"]:
        text += f" ([red]{node['failed']} failed[/red])"
    if kind != "leaf":
        text += f"  successor {succ}"
    if node.get("round", 1) > 1:
        text += f"  round {node['round']}"
    return text


def _render(data: dict[str, Any]) -> None:
    console = _console()
    table = Table(show_header=False, box=None)
    deadline = "-"
    if data["deadline_at"]:
        left = data["deadline_in_seconds"]
        deadline = f"{_when(data['deadline_at'])} ({'in ' + _ago(left) if left >= 0 else _ago(-left) + ' ago'})"
    where = []
    if data["round"] > 1:
        where.append(f"round {data['round']} of batch {data['retry_of']}")
    if data["nested_in"]:
        where.append(f"nested: child {data['nested_in']['child_index']} of batch {data['nested_in']['batch_id']}")
    if data["leaf_of"]:
        where.append(f"leaf counter of batch {data['leaf_of']}")
    if data["lineage"] and not data["nested_in"]:
        where.append(f"started by batch {data['lineage']}")
    for key, value in (
        ("batch", data["batch_id"]),
        ("step", data["step"]),
        ("state", data["state"]),
        *(("of", w) for w in where),
        ("planned", data["planned"]),
        ("remaining", data["remaining"]),
        ("running", f"{data['running']} (pending: {data['pending']})"),
        ("succeeded", data["succeeded"]),
        ("failed", data["failed"]),
        ("published", data["published"]),
        ("created", f"{_when(data['created_at'])} ({_ago(data['age_seconds'])} ago)"),
        ("completed", _when(data["completed_at"])),
        ("deadline", deadline),
        ("successor", f"{data['successor_state'] or 'not created'} ({data['successor_task_id']})"),
        *(
            (("successor reruns", f"{len(data['reruns'])}, now task {data['successor_current_task_id']}"),)
            if data.get("reruns")
            else ()
        ),
        *((("successor error", data["successor_error"]),) if data.get("successor_error") else ()),
        ("duplicate deliveries", data["successor_duplicates"]),
        ("refused reports", data.get("refused_reports", 0)),
    ):
        table.add_row(f"[bold]{key}[/bold]", escape(str(value)))
    console.print(table)
    if data.get("successor_traceback"):
        console.print("successor traceback:", highlight=False)
        console.print(escape(data["successor_traceback"]))
    with Progress(
        TextColumn("children"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        console=console,
        auto_refresh=False,
    ) as progress:
        progress.add_task("children", total=max(data["planned"], 1), completed=data["planned"] - data["remaining"])
        progress.refresh()
    tree_data = data["tree"]
    if tree_data["children"]:

        def grow(branch: Tree, node: dict[str, Any]) -> None:
            for child in node.get("children", []):
                grow(branch.add(_node_line(child)), child)

        tree = Tree(_node_line(tree_data))
        grow(tree, tree_data)
        console.print(tree)
        if data["tree_truncated"]:
            console.print("[dim](tree truncated: --tree-limit shows more)[/dim]")
    if data.get("reruns"):
        reruns = Table("rerun", "task", "replaced", "was", "error", "by", "at", title="successor reruns")
        for r in data["reruns"]:
            error = f"{r['previous_exc_type']}: {r['previous_exc_message'] or ''}" if r["previous_exc_type"] else "-"
            reruns.add_row(
                str(r["rerun"]),
                r["task_id"],
                r["previous_task_id"],
                f"{r['previous_state']} (run {r['previous_runs']})",
                escape(error),
                escape(r["requested_by"]),
                _when(r["requested_at"]),
            )
        console.print(reruns)
    if data["rounds"]:
        rounds = Table(
            "round", "batch", "state", "planned", "succeeded", "failed", "successor", "created", title="rounds"
        )
        for r in data["rounds"]:
            mark = " (this)" if r["batch_id"] == data["batch_id"] else ""
            rounds.add_row(
                str(r["round"]) + mark,
                r["batch_id"],
                r["state"],
                str(r["planned"]),
                str(r["succeeded"]),
                str(r["failed"]),
                r["successor_state"] or "-",
                _when(r["created_at"]),
            )
        console.print(rounds)


@fanin.command()
@click.argument("batch_id")
@click.option("--json", "as_json", is_flag=True, help="Print the status (tree and rounds included) as JSON.")
@click.option(
    "--tree-limit",
    type=click.IntRange(0, MAX_COUNT),
    default=200,
    show_default=True,
    help="Most leaves, nested batches and stages shown.",
)
@click.pass_context
@_errors_as_exit
def status(ctx: click.Context, batch_id: str, as_json: bool, tree_limit: int) -> None:
    """Show a batch's counts, state, age, deadline, successor, its tree (leaves, nested batches, pipeline
    stages) and its retry rounds."""
    data = describe(_fanin(ctx), batch_id, tree_limit=tree_limit)
    if as_json:
        click.echo(json.dumps(data, indent=2))
    else:
        _render(data)


def _finished(st: BatchStatus) -> bool:
    """The successor has finished, or the batch expired or was cancelled with nothing to run."""
    return st.done


@fanin.command()
@click.argument("batch_id")
@click.option("--interval", type=Seconds(0.05), default=1.0, show_default=True, help="Seconds between reads.")
@click.option("--timeout", type=Seconds(0), default=None, help="Give up after this many seconds.")
@click.pass_context
@_errors_as_exit
def watch(ctx: click.Context, batch_id: str, interval: float, timeout: float | None) -> None:
    """Show a live progress bar, with rate and ETA, until the batch's successor has finished.

    Exits 0 when the successor succeeded, 1 when it failed or was revoked, the batch expired or was cancelled
    with nothing to run, or --timeout passed first.
    """

    class Rate(ProgressColumn):
        def render(self, task: Task) -> Text:
            speed = task.finished_speed or task.speed
            return Text(f"{speed:,.1f}/s" if speed else "-/s", style="progress.data.speed")

    fanin_ext = _fanin(ctx)
    st = read_status(fanin_ext, batch_id)  # an unknown batch or an unreachable database ends here
    deadline = None if timeout is None else time.monotonic() + timeout
    console = _console()

    def fields(s: BatchStatus) -> dict[str, Any]:
        failed = f", [red]{s.failed} failed[/red]" if s.failed else ""
        return {"detail": f"{s.state}{failed}, successor {s.successor_state or 'not created'}"}

    with Progress(
        TextColumn(f"batch {st.batch_id[:8]}"),
        BarColumn(),
        MofNCompleteColumn(),
        Rate(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[detail]}"),
        console=console,
        refresh_per_second=4,
    ) as progress:
        bar = progress.add_task("children", total=max(st.planned, 1), completed=st.planned - st.remaining, **fields(st))
        while not _finished(st):
            if deadline is not None and time.monotonic() >= deadline:
                progress.stop()
                raise click.ClickException(
                    f"batch {st.batch_id} not finished after {timeout}s: {st.state}, {st.remaining} children "
                    f"remaining, successor {st.successor_state or 'not created'}"
                )
            time.sleep(interval if deadline is None else max(0.0, min(interval, deadline - time.monotonic())))
            try:
                st = read_status(fanin_ext, st.batch_id)
            except FanInDatabaseError:
                continue  # a database restart or failover: keep watching until --timeout
            progress.update(bar, total=max(st.planned, 1), completed=st.planned - st.remaining, **fields(st))
    summary = (
        f"batch {st.batch_id}: {st.state}, {st.succeeded} succeeded, {st.failed} failed; "
        f"successor {st.successor_state or f'none ({st.state})'}"
    )
    if st.successor_state != SuccessorState.SUCCEEDED:
        raise click.ClickException(summary)
    click.echo(summary)


class Duration(click.ParamType):
    """`30d`, `12h`, `1h30m`, `90s`, or seconds."""

    name = "duration"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        try:
            return parse_duration(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


LS_STATES = (*(s.value for s in BatchState), "stuck")


@fanin.command(name="ls")
@click.option(
    "--state",
    "states",
    multiple=True,
    type=click.Choice(LS_STATES),
    help="Only batches in this state (repeatable). stuck: open or running with no child finished for "
    "longer than --stuck-after.",
)
@click.option(
    "--stuck-after",
    type=Duration(),
    default="600",
    show_default=True,
    help="How long without a finished child makes a running batch stuck (30m, 600, ...).",
)
@click.option("--older-than", type=Duration(), default=None, help="Only batches created longer ago (2h, 7d, ...).")
@click.option("--newer-than", type=Duration(), default=None, help="Only batches created more recently.")
@click.option("--step", default=None, help="Only batches of this step.")
@click.option("--limit", type=click.IntRange(1, MAX_COUNT), default=50, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print the batches as JSON.")
@click.pass_context
@_errors_as_exit
def ls(
    ctx: click.Context,
    states: tuple[str, ...],
    stuck_after: float,
    older_than: float | None,
    newer_than: float | None,
    step: str | None,
    limit: int,
    as_json: bool,
) -> None:
    """List batches, newest first (a tree's leaves and retry rounds' details are in `status`)."""
    rows = list_batches(
        _fanin(ctx),
        states=states,
        stuck_after=stuck_after,
        older_than=older_than,
        newer_than=newer_than,
        step=step,
        limit=limit,
    )
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    if not rows:
        click.echo("no batches match")
        return
    table = Table("batch", "age", "step", "state", "done", "failed", "successor", "round")
    for r in rows:
        state = r["state"] + (" [yellow](stuck)[/yellow]" if r["stuck"] else "")
        table.add_row(
            r["batch_id"],
            _ago(r["age_seconds"]),
            escape(r["step"]),
            state,
            f"{r['succeeded'] + r['failed']}/{r['planned']}",
            str(r["failed"]),
            r["successor_state"] or "-",
            str(r["round"]),
        )
    _console().print(table)


@fanin.command()
@click.argument("batch_id")
@click.option(
    "--limit", type=click.IntRange(1, MAX_COUNT), default=100, show_default=True, help="Most failures listed."
)
@click.option("--json", "as_json", is_flag=True, help="Print the failures as JSON (each with its traceback).")
@click.option("--traceback", "tracebacks", is_flag=True, help="Print each failure's traceback under the table.")
@click.pass_context
@_errors_as_exit
def failures(ctx: click.Context, batch_id: str, limit: int, as_json: bool, tracebacks: bool) -> None:
    """List a batch's failed and lost children: task, state, exception and attempts, in child order; with
    --traceback, the traceback each one raised (kept for a failure in the task's code)."""
    data = read_failures(_fanin(ctx), batch_id, limit=limit)
    if as_json:
        click.echo(json.dumps(data, indent=2))
        return
    listed = data["failures"]
    if not data["total"]:
        click.echo(f"batch {data['batch_id']} ({data['state']}) has no failed children")
        return
    console = _console()
    shown = f"{len(listed)} of {data['total']}" if len(listed) < data["total"] else str(data["total"])
    console.print(f"{shown} failed children of batch {data['batch_id']} ({data['state']})")
    table = Table("index", "task id", "task", "state", "exception", "attempts")
    for f in listed:
        exc = f"{f['exc_type'] or ''}: {f['exc_message'] or ''}".strip(": ")
        table.add_row(
            str(f["index"]), f["task_id"], escape(f["task_name"]), f["state"], escape(exc or "-"), str(f["attempts"])
        )
    console.print(table)
    if tracebacks:
        for f in listed:
            console.print(f"\nchild {f['index']} ({f['task_id']}):", highlight=False)
            console.print(escape(f["traceback"] or "no traceback kept (no error raised in the task's code)"))


@fanin.command(name="retry-failed")
@click.argument("batch_id")
@click.option("--json", "as_json", is_flag=True, help="Print what was done as JSON.")
@click.pass_context
@_errors_as_exit
def retry_failed(ctx: click.Context, batch_id: str, as_json: bool) -> None:
    """Publish a finished batch's failed children again as a new round, then run its successor again.

    BATCH_ID may be any round's batch: the failed children of the latest round are retried. Refused while that
    round or its successor has not finished. The successor's outcome says which round it is (`round`, `retry_of`).
    """
    done = start_round(_fanin(ctx), batch_id)
    if as_json:
        click.echo(json.dumps(done.as_dict(), indent=2))
        return
    retried = f"batch {done.retried}" + (f" (round {done.retried_round})" if done.retried_round > 1 else "")
    if done.batch_id is None:
        click.echo(f"nothing to retry: {retried} has no failed children")
        return
    click.echo(
        f"round {done.round} of batch {done.original}: batch {done.batch_id}"
        + (" (already created by another retry)" if done.existing else "")
    )
    click.echo(
        f"  {done.children} failed children of {retried} published again; the successor runs again when they finish"
    )
    if done.unfinished:
        click.echo(f"  {done.unfinished} children of {retried} were still unfinished and are not retried")
    if done.nested_in:
        click.echo(f"  note: {retried} is nested in batch {done.nested_in}; this round does not change its outcome")


@fanin.command()
@click.argument("batch_id")
@click.option("--step", default=None, help="The successor to run again, for a batch with several (on_failure, ...).")
@click.option("--by", "requested_by", default=None, help="Who asks, as the record keeps it (default: user@host).")
@click.option("--json", "as_json", is_flag=True, help="Print what was done as JSON.")
@click.pass_context
@_errors_as_exit
def rerun(ctx: click.Context, batch_id: str, step: str | None, requested_by: str | None, as_json: bool) -> None:
    """Run a batch's failed or revoked successor again, once its bug is fixed.

    It runs from its stored signature with the batch's outcome, under a new task id and the next run number, once
    (a copy of an earlier delivery is refused); the rerun is recorded (who, when, what it replaced) and `status`
    shows it. Exits 1 if the successor succeeded or has not finished.
    """
    done = start_rerun(_fanin(ctx), parse_batch_id(batch_id), step=step, requested_by=requested_by)
    if as_json:
        click.echo(json.dumps(done.as_dict(), indent=2))
        return
    click.echo(
        f"rerun {done.rerun} of the successor {done.step} of batch {done.batch_id}: task {done.task_id} "
        f"(it was {done.previous_state} as {done.previous_task_id}); published by the relay"
    )


@fanin.command()
@click.option("--older-than", type=Duration(), required=True, help="Age of the batches to delete (30d, 12h, ...).")
@click.option(
    "--chunk",
    type=click.IntRange(1, MAX_COUNT),
    default=500,
    show_default=True,
    help="Root batches locked per transaction.",
)
@click.option(
    "--max-children",
    type=click.IntRange(1, MAX_COUNT),
    default=20_000,
    show_default=True,
    help="Children deleted per transaction (a larger batch goes alone, a tree leaf by leaf).",
)
@click.option("--limit", type=click.IntRange(1, MAX_COUNT), default=None, help="Delete at most this many batches.")
@click.option("--dry-run", is_flag=True, help="Count what would be deleted; delete nothing.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.pass_context
@_errors_as_exit
def prune(
    ctx: click.Context,
    older_than: float,
    chunk: int,
    max_children: int,
    limit: int | None,
    dry_run: bool,
    as_json: bool,
) -> None:
    """Delete finished batches (and their children, successors and outbox rows) and finished sagas that finished
    longer ago than --older-than, in short transactions. Open and running batches, batches whose successor has
    not finished, and sagas that are running or wait for an operator are never deleted."""
    report = run_prune(_fanin(ctx), older_than, chunk=chunk, max_children=max_children, dry_run=dry_run, limit=limit)
    if as_json:
        click.echo(json.dumps(report.as_dict(), indent=2))
        return
    age = _ago(older_than)
    if dry_run:
        click.echo(
            f"would delete {report.batches} batches ({report.children} children) and {report.sagas} sagas "
            f"finished more than {age} ago"
        )
        return
    more = "" if report.complete else " (stopped at --limit: more remain)"
    click.echo(
        f"deleted {report.batches} batches ({report.leaves} leaf counters, {report.children} children) "
        f"and {report.sagas} sagas finished more than {age} ago, in {report.transactions} transactions"
        f"{more}"
    )


@fanin.command()
@click.argument("batch_id")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.pass_context
@_errors_as_exit
def seal(ctx: click.Context, batch_id: str, as_json: bool) -> None:
    """Seal an open (streaming) batch: it takes no more children and finishes when the ones it has do.

    For a batch whose producer is gone (the relay also does this after fanin_open_batch_grace). A producer still
    writing it fails on its next chunk. Exits 1 if the batch is not open.
    """
    fanin_ext = _fanin(ctx)
    sealed = actions.seal_batch(fanin_ext, parse_batch_id(batch_id))
    if as_json:
        click.echo(
            json.dumps(
                {
                    "batch_id": str(sealed.batch_id),
                    "planned": sealed.planned,
                    "successor_created": sealed.successor_created,
                },
                indent=2,
            )
        )
        return
    then = (
        "every child had finished: its successor runs now"
        if sealed.successor_created
        else ("its successor runs once they have finished")
    )
    click.echo(f"sealed batch {sealed.batch_id} with {sealed.planned} children; {then}")


@fanin.command()
@click.argument("batch_id")
@click.option(
    "--proceed",
    is_flag=True,
    help="Run the successor with what has arrived (batch partial), as on_deadline='proceed' does.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.pass_context
@_errors_as_exit
def cancel(ctx: click.Context, batch_id: str, proceed: bool, as_json: bool) -> None:
    """Cancel an open or running batch now: its unfinished children are abandoned and revoked.

    By default the batch ends `cancelled` and its successor does not run (its on_expire does, if it has one), as
    on_deadline='abandon' does at a deadline; --proceed runs the successor with what has arrived instead. Exits 1
    if the batch has already ended.
    """
    fanin_ext = _fanin(ctx)
    expiry = actions.cancel_batch(fanin_ext, parse_batch_id(batch_id), proceed=proceed)
    if as_json:
        click.echo(
            json.dumps(
                {
                    "batch_id": str(expiry.batch_id),
                    "state": expiry.state,
                    "abandoned": len(expiry.abandoned),
                    "successor_created": expiry.successor_created,
                },
                indent=2,
            )
        )
        return
    runs = (
        "its successor runs with what arrived"
        if proceed
        else "on_expire runs"
        if expiry.successor_created
        else "nothing runs"
    )
    click.echo(
        f"cancelled batch {expiry.batch_id}: {expiry.state}, {len(expiry.abandoned)} unfinished children "
        f"abandoned and revoked; {runs}"
    )


@fanin.command()
@click.option("--json", "as_json", is_flag=True, help="Print the repairs as JSON.")
@click.pass_context
@_errors_as_exit
def reconcile(ctx: click.Context, as_json: bool) -> None:
    """Recompute open batches' counters from their child rows; repair and finish what disagrees."""
    fanin_ext = _fanin(ctx)
    repairs = maintenance.reconcile(fanin_ext)
    expired = maintenance.apply_deadlines(fanin_ext)
    if as_json:
        click.echo(
            json.dumps(
                {"repairs": [r.as_dict() for r in repairs], "deadlines": [str(e.batch_id) for e in expired]}, indent=2
            )
        )
        return
    if not repairs and not expired:
        click.echo("all batches agree with their child rows")
        return
    table = Table("batch", "found", "done")
    for r in repairs:
        table.add_row(str(r.batch_id), "\n".join(r.problems + r.unchecked), "\n".join(r.actions) or "reported only")
    for e in expired:
        table.add_row(str(e.batch_id), "deadline passed", f"on_deadline={e.on_deadline}, {len(e.abandoned)} abandoned")
    Console().print(table)


fanin.add_command(saga)
fanin.add_command(dashboard_command(_fanin, _errors_as_exit))
