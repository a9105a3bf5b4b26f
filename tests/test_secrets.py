"""A database URL's password never shows: not in logs, CLI output, `status --json`, metrics or error messages,
including a driver error that quotes the connection string back (psycopg's "invalid percent-encoded token")."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import psycopg
import pytest
from celery import Celery
from click.testing import CliRunner
from prometheus_client import REGISTRY, generate_latest
from sqlalchemy.engine import make_url

from celery_fanin import FanIn, FanInDatabaseError, FanInNotConfigured, fan_in_group, protocol
from celery_fanin.cli import fanin as fanin_cli
from celery_fanin.redact import MASK, redact, remember
from celery_fanin.worker import runtime
from tests import http_get
from tests.cluster import free_port
from tests.workers import CeleryProcess, wait_for

SECRET = "Sup3rS3cretPw"


def _app(url: str) -> Celery:
    app = Celery(f"secrets-{uuid.uuid4().hex[:6]}", broker="memory://", set_as_current=False)
    app.conf.update(fanin_database_url=url, fanin_record_attempts=1, fanin_report_timeout=0.5)
    FanIn(app)
    return app


@pytest.fixture
def broken_app(clean_db: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Celery]:
    """The test database with a password, behind a driver whose connection error quotes the connection string
    and the password back (as psycopg does for some malformed strings: "invalid percent-encoded token: ...")."""
    url = make_url(clean_db).set(password=SECRET).render_as_string(hide_password=False)

    def connect(conninfo: str = "", **kwargs: object) -> None:
        raise psycopg.OperationalError(f"cannot connect with {conninfo!r} {kwargs!r}: token {SECRET!r} refused")

    monkeypatch.setattr(psycopg, "connect", connect)
    app = _app(url)
    yield app
    FanIn.of(app).dispose()


def test_redact_removes_url_keyword_and_known_passwords() -> None:
    remember(f"postgresql://u:{SECRET}x@h/db")
    assert (
        redact(f"failed: postgresql+psycopg://user:{SECRET}@host:5432/db")
        == f"failed: postgresql+psycopg://user:{MASK}@host:5432/db"
    )
    assert SECRET not in redact(f"host=h user=u password='{SECRET} more' dbname=x")
    assert SECRET not in redact(f"host=h password={SECRET} dbname=x")
    assert redact(f'invalid percent-encoded token: "{SECRET}x"') == f'invalid percent-encoded token: "{MASK}"'
    assert redact("nothing to hide: postgresql://user@host/db") == "nothing to hide: postgresql://user@host/db"


def test_a_driver_error_quoting_the_password_is_redacted_everywhere(
    broken_app: Celery, caplog: pytest.LogCaptureFixture
) -> None:
    fanin = FanIn.of(broken_app)
    # The worker's report path: the error is logged (with its traceback), never the password.
    with caplog.at_level(logging.DEBUG):
        rec = runtime.current.reporter.record_child(
            fanin, "t-1", protocol.Marker(str(uuid.uuid4()), 0, None), "succeeded"
        )
    assert rec is None
    assert caplog.records, "the failed report was logged"
    logged = "\n".join(
        logging.Formatter("%(message)s").format(r) for r in caplog.records if r.name.startswith("celery_fanin")
    )
    assert "cannot connect" in logged and SECRET not in logged
    # The API's error.
    with pytest.raises(FanInDatabaseError) as caught:
        fan_in_group([], then=broken_app.signature("t.s"), app=broken_app).apply_async().batch_status()
    assert SECRET not in str(caught.value)
    # The CLI, plain and --json: one line, exit 1, no password.
    runner = CliRunner()
    for args in (["status", str(uuid.uuid4())], ["status", "--json", str(uuid.uuid4())]):
        result = runner.invoke(fanin_cli, args, obj=SimpleNamespace(app=broken_app))
        assert result.exit_code == 1 and SECRET not in result.output, result.output
    # Metrics: no label or value carries it.
    assert SECRET not in generate_latest(REGISTRY).decode()


def test_a_url_that_does_not_parse_is_refused_without_its_password() -> None:
    with pytest.raises(FanInNotConfigured) as caught:
        FanIn.of(_app(f"postgresql://user:{SECRET}@host:notaport/db")).database_url  # noqa: B018
    assert "not a valid URL" in str(caught.value) and SECRET not in str(caught.value)


def test_cli_output_and_json_never_hold_the_password(clean_db: str, clean_redis: str) -> None:
    """The test server trusts local connections, so a URL with a password connects for real: every command's
    output, plain and --json, on a real batch, holds neither the password nor the URL."""
    url = make_url(clean_db).set(password=SECRET).render_as_string(hide_password=False)
    app = Celery(f"secrets-{uuid.uuid4().hex[:6]}", broker=clean_redis, set_as_current=False)
    app.conf.update(fanin_database_url=url)
    FanIn(app)
    try:
        batch = fan_in_group([app.signature("t.c", args=(1,))], then=app.signature("t.s"), app=app).apply_async()
        runner = CliRunner()
        for path, arg_sets in _REACHING_THE_DATABASE.items():
            for args in arg_sets:
                argv = [*path, *(a.replace("{id}", batch.batch_id) for a in args)]
                if path == ("relay",):
                    continue  # publishes the batch's children: read by test_the_relay_and_dashboard_processes_...
                result = runner.invoke(fanin_cli, argv, obj=SimpleNamespace(app=app))
                assert result.exit_code in (0, 1), (argv, result.output, result.exception)
                assert SECRET not in result.output and "postgresql" not in result.output, (argv, result.output)
    finally:
        FanIn.of(app).dispose()


def test_every_library_logger_redacts(app: Celery) -> None:
    import celery_fanin.cli  # noqa: F401  (the modules a worker, the relay and the CLI import)
    import celery_fanin.relay  # noqa: F401
    from celery_fanin.redact import RedactingFilter

    FanIn(app)
    names = [n for n in logging.root.manager.loggerDict if n.startswith("celery_fanin")]
    assert names
    for name in names:
        assert any(isinstance(f, RedactingFilter) for f in logging.getLogger(name).filters), name


# Arguments with which each command reaches the database (a command missing here fails the test: add it).
_REACHING_THE_DATABASE: dict[tuple[str, ...], list[list[str]]] = {
    ("migrate",): [[], ["--check"], ["--sql"]],
    ("relay",): [["--once"]],
    ("status",): [["{id}"], ["--json", "{id}"]],
    ("watch",): [["{id}", "--timeout", "1"]],
    ("failures",): [["{id}"], ["--json", "{id}"]],
    ("retry-failed",): [["{id}"], ["--json", "{id}"]],
    ("rerun",): [["{id}"], ["--json", "{id}"]],
    ("seal",): [["{id}"], ["--json", "{id}"]],
    ("cancel",): [["{id}"], ["--json", "{id}"]],
    ("ls",): [[], ["--json"]],
    ("prune",): [["--older-than", "1d"], ["--older-than", "1d", "--dry-run", "--json"]],
    ("reconcile",): [[], ["--json"]],
    ("saga", "status"): [["{id}"], ["--json", "{id}"]],
    ("saga", "resume"): [["{id}"]],
    ("saga", "ack"): [["{id}", "1"]],
    ("dashboard",): [],  # serves until stopped: its error path is test_the_dashboard_keeps_the_password_out
}


def test_every_cli_command_keeps_the_password_out(broken_app: Celery, caplog: pytest.LogCaptureFixture) -> None:
    """Each command, run where the database's driver quotes the password back: one line, exit 1, no password in
    its output, its error or the log."""
    from tests.clitools import leaf_commands

    assert set(leaf_commands()) == set(_REACHING_THE_DATABASE), "give every command its arguments above"
    runner = CliRunner()
    for path, arg_sets in _REACHING_THE_DATABASE.items():
        for args in arg_sets:
            argv = [*path, *(a.replace("{id}", str(uuid.uuid4())) for a in args)]
            with caplog.at_level(logging.DEBUG):
                result = runner.invoke(fanin_cli, argv, obj=SimpleNamespace(app=broken_app))
            assert result.exit_code == 1, (argv, result.output, result.exception)
            assert isinstance(result.exception, SystemExit), (argv, repr(result.exception))
            errors = [line for line in result.output.splitlines() if line.startswith("Error")]
            assert len(errors) == 1 and SECRET not in result.output, (argv, result.output)
            logged = "\n".join(logging.Formatter("%(message)s").format(r) for r in caplog.records)
            assert SECRET not in logged, (argv, logged)
            caplog.clear()


def test_the_dashboard_keeps_the_password_out(broken_app: Celery) -> None:
    """The dashboard's pages when the database cannot be reached (503): the error says why, without the password."""
    from starlette.testclient import TestClient

    from celery_fanin.web import create_app

    web = create_app(broken_app)
    try:
        with TestClient(web) as client:
            for path in ("/batches", f"/batches/{uuid.uuid4()}", "/sagas", "/batches?partial=1"):
                page = client.get(path)
                assert page.status_code == 503 and "could not be read" in page.text, (path, page.text[:500])
                assert SECRET not in page.text, path
    finally:
        web.state.engine.dispose()


@pytest.mark.timeout(120)
def test_the_relay_and_dashboard_processes_keep_the_password_out(clean_redis: str, tmp_path: Path) -> None:
    """A real `celery fanin relay` (with its metrics endpoint) and `celery fanin dashboard` whose database URL has a
    password and nothing listening at its address: their logs, the dashboard's 503 page and the metrics (labels
    included) say the database cannot be reached, and never the password."""
    url = f"postgresql+psycopg://fanin:{SECRET}@127.0.0.1:{free_port()}/fanin"
    env = {"FANIN_DATABASE_URL": url, "FANIN_TEST_BROKER": clean_redis, "FANIN_DASHBOARD_TOKEN": ""}
    metrics, web = free_port(), free_port()
    relay = CeleryProcess(
        ["fanin", "relay", "--poll-interval", "0.2", "--metrics-port", str(metrics), "-l", "DEBUG"],
        env,
        tmp_path / "relay.log",
        ready_marker=None,
    )
    dashboard = CeleryProcess(
        ["fanin", "dashboard", "--port", str(web)], env, tmp_path / "dashboard.log", ready_marker="dashboard at"
    )
    try:
        dashboard.wait_ready(60)
        page = http_get.get(f"http://127.0.0.1:{web}/batches")
        assert page[0] == 503 and "could not be read" in page[1] and SECRET not in page[1], page
        wait_for(lambda: "relay round failed" in relay.output() or "cannot" in relay.output(), 60, message="an error")
        scraped = wait_for(lambda: http_get.get(f"http://127.0.0.1:{metrics}/metrics"), 60, message="metrics")
        assert "fanin_" in scraped[1] and SECRET not in scraped[1]
    finally:
        relay.stop()
        dashboard.stop()
    for proc in (relay, dashboard):
        output = proc.output()
        assert "127.0.0.1" in output or "connect" in output, output
        assert SECRET not in output, output
