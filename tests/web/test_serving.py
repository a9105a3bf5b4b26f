"""How the dashboard is served: its token and basic auth, mounted inside a Starlette app and a WSGI app, the
`fanin dashboard` command (a real uvicorn subprocess), and its named statements' loader."""

from __future__ import annotations

import base64
import io
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery
from click.testing import CliRunner
from starlette.applications import Starlette
from starlette.routing import Mount
from starlette.testclient import TestClient

from celery_fanin.cli import fanin as fanin_group
from celery_fanin.web import MISSING_EXTRA, MissingExtra, create_app
from celery_fanin.web.cli import is_loopback
from celery_fanin.web.sql import parse, statements
from tests import http_get
from tests.workers import ROOT, CeleryProcess

from .conftest import Store

pytestmark = pytest.mark.timeout(60)
TOKEN = "s3cret-token-for-tests"


def _basic(user: str, password: str) -> dict[str, str]:
    return {"authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


@pytest.fixture
def guarded(app: Celery) -> Iterator[TestClient]:
    web = create_app(app, token=TOKEN)
    with TestClient(web) as client:
        yield client
    web.state.engine.dispose()


def test_a_token_is_required_everywhere(guarded: TestClient) -> None:
    for path in ("/batches", "/sagas", "/static/dashboard.css", "/batches?partial=1", "/"):
        refused = guarded.get(path, follow_redirects=False)
        assert refused.status_code == 401, path
        assert refused.headers["www-authenticate"].startswith("Basic realm=")
        assert refused.headers["x-frame-options"] == "DENY", "security headers on a refusal too"
        assert TOKEN not in refused.text
    assert guarded.get("/batches", headers={"authorization": f"Bearer {TOKEN}"}).status_code == 200
    assert guarded.get("/batches", headers={"authorization": f"Bearer {TOKEN}x"}).status_code == 401
    assert guarded.get("/batches", headers={"authorization": f"Bearer {TOKEN[:-1]}"}).status_code == 401
    assert guarded.get("/batches", headers=_basic("anyone", TOKEN)).status_code == 200, "a browser's prompt"
    assert guarded.get("/batches", headers=_basic(TOKEN, "wrong")).status_code == 401
    assert guarded.get("/batches", headers={"authorization": "Basic !!not-base64"}).status_code == 401
    guarded.cookies.set("fanin_dashboard", TOKEN)
    assert guarded.get("/batches").status_code == 401, "the cookie holds no token, and no token is a cookie"


def test_a_token_in_the_url_becomes_a_cookie_and_leaves_the_url(guarded: TestClient, store: Store) -> None:
    batch = store.batch(1)
    wrong = guarded.get(f"/batches/{batch.id}?token=nope", follow_redirects=False)
    assert wrong.status_code == 401 and "set-cookie" not in wrong.headers
    login = guarded.get(f"/batches/{batch.id}?failures_after=3&token={TOKEN}", follow_redirects=False)
    assert login.status_code == 303
    assert login.headers["location"] == f"/batches/{batch.id}?failures_after=3", "the shareable URL, no token"
    cookie = login.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=lax" in cookie and TOKEN not in cookie
    page = guarded.get(login.headers["location"])  # the client keeps the cookie
    assert page.status_code == 200 and batch.id in page.text
    assert guarded.get("/static/live.js").status_code == 200


def test_basic_auth_needs_both_user_and_password(app: Celery) -> None:
    web = create_app(app, basic_auth=("ops", "pw-123"))
    try:
        with TestClient(web) as client:
            assert client.get("/batches").status_code == 401
            assert client.get("/batches", headers=_basic("ops", "pw-123")).status_code == 200
            assert client.get("/batches", headers=_basic("ops", "pw-12")).status_code == 401
            assert client.get("/batches", headers=_basic("opz", "pw-123")).status_code == 401
            assert client.get("/batches?token=pw-123").status_code == 401, "no token was configured"
    finally:
        web.state.engine.dispose()


def test_the_token_may_come_from_the_app_conf(app: Celery) -> None:
    app.conf.fanin_dashboard_token = TOKEN
    try:
        web = create_app(app)
        with TestClient(web) as client:
            assert client.get("/batches").status_code == 401
            assert client.get("/batches", headers={"authorization": f"Bearer {TOKEN}"}).status_code == 200
        web.state.engine.dispose()
    finally:
        app.conf.fanin_dashboard_token = None


def _links(page: str) -> list[str]:
    return re.findall(r'(?:href|src|action)="(/[^"]*)"', page)


def test_mounted_in_a_starlette_app_every_link_stays_under_the_mount(app: Celery, store: Store) -> None:
    batch = store.batch(2)
    web = create_app(app)
    host = Starlette(routes=[Mount("/ops/fanin", app=web)])
    try:
        with TestClient(host) as client:
            page = client.get("/ops/fanin/batches")
            assert page.status_code == 200 and batch.id in page.text
            links = _links(page.text)
            assert f"/ops/fanin/batches/{batch.id}" in links and "/ops/fanin/static/dashboard.css" in links
            assert all(link.startswith("/ops/fanin/") for link in links), links
            for link in (f"/ops/fanin/batches/{batch.id}", "/ops/fanin/static/live.js", "/ops/fanin/sagas"):
                assert client.get(link).status_code == 200, link
            assert client.get("/ops/fanin/", follow_redirects=False).headers["location"] == "/ops/fanin/batches"
            assert client.get("/batches").status_code == 404, "nothing outside the mount"
    finally:
        web.state.engine.dispose()


def _wsgi_get(wsgi: Any, script_name: str, path: str, query: str = "") -> tuple[str, str]:
    from wsgiref.util import setup_testing_defaults

    environ: dict[str, Any] = {
        "SCRIPT_NAME": script_name,
        "PATH_INFO": path,
        "QUERY_STRING": query,
        "REQUEST_METHOD": "GET",
        "wsgi.input": io.BytesIO(),
    }
    setup_testing_defaults(environ)
    status: list[str] = []
    body = b"".join(wsgi(environ, lambda s, headers, exc_info=None: status.append(s)))
    return status[0], body.decode()


def test_mounted_in_a_wsgi_app_through_a2wsgi(app: Celery, store: Store) -> None:
    """What docs/how-to/dashboard.md shows for Flask or Django: a2wsgi's ASGIMiddleware under a prefix (here a
    minimal WSGI dispatcher, as werkzeug's DispatcherMiddleware or a Django URL would hand it SCRIPT_NAME)."""
    from a2wsgi import ASGIMiddleware

    batch = store.batch(1)
    web = create_app(app)
    try:
        wsgi = ASGIMiddleware(web)
        status, page = _wsgi_get(wsgi, "/fanin", "/batches")
        assert status.startswith("200") and batch.id in page
        assert all(link.startswith("/fanin/") for link in _links(page))
        status, page = _wsgi_get(wsgi, "/fanin", f"/batches/{batch.id}", "partial=1")
        assert status.startswith("200") and "<html" not in page and batch.id in page
    finally:
        web.state.engine.dispose()


# --- the command --------------------------------------------------------------------------------------------------


def test_is_loopback() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost") and is_loopback("127.8.0.1")
    assert not is_loopback("0.0.0.0") and not is_loopback("::") and not is_loopback("192.168.1.5")
    assert not is_loopback("example.com")


def test_without_the_extra_the_command_says_what_to_install(monkeypatch: pytest.MonkeyPatch, app: Celery) -> None:
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # `import uvicorn` raises ImportError
    result = CliRunner().invoke(fanin_group, ["dashboard"], obj=SimpleNamespace(app=app))
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == [f"Error: {MISSING_EXTRA} (uvicorn is not installed)"]
    assert 'pip install "celery-fanin[web]"' in result.output


def test_without_the_extra_create_app_says_what_to_install(monkeypatch: pytest.MonkeyPatch, app: Celery) -> None:
    monkeypatch.setitem(sys.modules, "starlette", None)
    with pytest.raises(MissingExtra, match=re.escape('pip install "celery-fanin[web]" (starlette is not installed)')):
        create_app(app)


def test_a_public_address_needs_a_token(app: Celery) -> None:
    result = CliRunner().invoke(fanin_group, ["dashboard", "--host", "0.0.0.0"], obj=SimpleNamespace(app=app))
    assert result.exit_code == 1 and "refusing to serve the dashboard on 0.0.0.0 without a token" in result.output


def _serve(env: dict[str, str], tmp_path: Path, *args: str) -> tuple[CeleryProcess, str]:
    proc = CeleryProcess(
        ["fanin", "dashboard", "--port", "0", *args],
        env,
        tmp_path / "dashboard.log",
        ready_marker="dashboard at http://",
    )
    proc.wait_ready()
    found = re.search(r"dashboard at (http://\S+)", proc.output())
    assert found, proc.output()
    return proc, found.group(1).rstrip("/")


def _page(url: str, headers: dict[str, str] | None = None) -> tuple[int, str]:
    got = http_get.get(url, headers)
    assert got is not None, f"nothing answers at {url}"
    return got


def test_the_command_serves_the_pages_on_loopback(e2e_env: dict[str, str], tmp_path: Path, store: Store) -> None:
    batch = store.batch(3)
    proc, base = _serve(e2e_env, tmp_path, "--token", TOKEN)
    try:
        assert base.startswith("http://127.0.0.1:"), "loopback unless told otherwise"
        assert "(token required)" in proc.output() and TOKEN not in proc.output()
        assert _page(f"{base}/batches")[0] == 401
        status, page = _page(f"{base}/batches", {"authorization": f"Bearer {TOKEN}"})
        assert status == 200 and batch.id in page
        status, page = _page(f"{base}/batches/{batch.id}", {"authorization": f"Bearer {TOKEN}"})
        assert status == 200 and "0 / 3" in page
    finally:
        proc.stop()
    assert proc.proc.returncode == 0, proc.output()[-2000:]


def test_flowers_options_address_url_prefix_and_basic_auth(
    e2e_env: dict[str, str], tmp_path: Path, store: Store
) -> None:
    """`--address`, `--url-prefix` and `--basic-auth`, spelled as Flower spells them (issue 40, item 6)."""
    batch = store.batch(2)
    auth = {"authorization": "Basic " + base64.b64encode(b"ops:s3cret").decode()}
    proc, base = _serve(
        e2e_env, tmp_path, "--address", "127.0.0.1", "--url-prefix", "/fanin/", "--basic-auth", "ops:s3cret"
    )
    try:
        assert base.startswith("http://127.0.0.1:") and base.endswith("/fanin"), base
        assert "(basic auth required)" in proc.output() and "s3cret" not in proc.output()
        assert _page(f"{base}/batches")[0] == 401
        status, page = _page(f"{base}/batches", auth)
        assert status == 200 and batch.id in page
        assert f'href="/fanin/batches/{batch.id}"' in page and 'action="/fanin/lookup"' in page, "links under it"
        assert _page(base.removesuffix("/fanin") + "/batches", auth)[0] == 404, "nothing outside the prefix"
    finally:
        proc.stop()
    assert proc.proc.returncode == 0, proc.output()[-2000:]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--basic-auth", "nopassword"], "give USER:PASSWORD"),
        (["--basic-auth", ":x"], "give USER:PASSWORD"),
        (["--url-prefix", "fanin"], "is not a URL path"),
        (["--address", "0.0.0.0"], "without a token"),
    ],
)
def test_bad_dashboard_options_are_refused(app: Celery, args: list[str], message: str) -> None:
    result = CliRunner().invoke(fanin_group, ["dashboard", *args], obj=SimpleNamespace(app=app))
    assert result.exit_code != 0 and message in result.output, result.output


def test_the_command_reports_a_taken_port(e2e_env: dict[str, str], tmp_path: Path) -> None:
    first, base = _serve(e2e_env, tmp_path)
    try:
        port = base.rsplit(":", 1)[1]
        taken = subprocess.run(
            [sys.executable, "-m", "celery", "-A", "tests.app", "fanin", "dashboard", "--port", port],
            cwd=ROOT,
            env={**os.environ, **e2e_env, "PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert taken.returncode == 1
        assert f"cannot listen on 127.0.0.1:{port}" in taken.stderr, taken.stderr[-2000:]
    finally:
        first.stop()


# --- named statements ---------------------------------------------------------------------------------------------


def test_every_dashboard_statement_is_named_described_and_parameterised() -> None:
    found = statements("dashboard")
    assert {"batches_page", "batch_detail", "failures_page", "start_sample", "sagas_page"} <= found.keys()
    for statement in found.values():
        assert statement.description and not statement.description.startswith("-")
        assert not statement.sql.endswith(";") and "-- name:" not in statement.sql
        assert "%" not in statement.sql and "{" not in statement.sql, "values are bound, never formatted in"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("-- name: a\nSELECT 1;\n", "has no description line"),
        ("-- name: a\n-- one\nSELECT 1\n", "does not end with ';'"),
        ("-- name: a\n-- one\nSELECT 1\n-- name: b\n-- two\nSELECT 2;\n", "does not end with ';'"),
        ("-- name: a\n-- one\nSELECT 1;\n-- name: a\n-- again\nSELECT 2;\n", "defined twice"),
        ("SELECT 1;\n", "SQL outside a named statement"),
        ("-- name: a\n-- one\n;\n", "is empty"),
    ],
)
def test_the_loader_refuses_a_file_out_of_form(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        parse(text, "x.sql")


def test_the_loader_reads_the_format() -> None:
    found = parse("-- notes\n\n-- name: one\n-- The first.\nSELECT 1\n  FROM x;\n\n-- name: two\n-- Two.\nSELECT 2;\n")
    assert [(s.name, s.description, s.sql) for s in found.values()] == [
        ("one", "The first.", "SELECT 1\n  FROM x"),
        ("two", "Two.", "SELECT 2"),
    ]
