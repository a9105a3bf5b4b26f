"""A database URL's password never shows: not in logs, CLI output, `status --json`, metrics or error messages,
including a driver error that quotes the connection string back (psycopg's "invalid percent-encoded token")."""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Iterator
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
from celery_fanin.worker import hooks

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
        rec = hooks.worker_hooks.record_child(fanin, "t-1", protocol.Marker(str(uuid.uuid4()), 0, None), "succeeded")
    assert rec is None
    assert caplog.records, "the failed report was logged"
    logged = "\n".join(
        logging.Formatter("%(message)s").format(r) for r in caplog.records if r.name.startswith("celery_fanin")
    )
    assert "cannot connect" in logged and SECRET not in logged
    # The API's error.
    with pytest.raises(FanInDatabaseError) as caught:
        fan_in_group([], then=broken_app.signature("t.s"), app=broken_app).apply_async().status()
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


def test_status_json_never_holds_the_url(app: Celery) -> None:
    url = make_url(FanIn.of(app).database_url)
    handle = fan_in_group([], then=app.signature("t.s"), app=app).apply_async()
    result = CliRunner().invoke(fanin_cli, ["status", "--json", handle.batch_id], obj=SimpleNamespace(app=app))
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert str(url.host) not in json.dumps(data) or "database" not in json.dumps(data)
    assert "postgresql" not in result.output


def test_every_library_logger_redacts(app: Celery) -> None:
    import celery_fanin.cli  # noqa: F401  (the modules a worker, the relay and the CLI import)
    import celery_fanin.relay  # noqa: F401
    from celery_fanin.redact import RedactingFilter

    FanIn(app)
    names = [n for n in logging.root.manager.loggerDict if n.startswith("celery_fanin")]
    assert names
    for name in names:
        assert any(isinstance(f, RedactingFilter) for f in logging.getLogger(name).filters), name
