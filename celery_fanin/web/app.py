"""The dashboard's ASGI app: Starlette routes over `data`, Jinja templates, a guard for auth and headers.

Every route is a GET (HEAD too); any other method is refused with 405. Each page is rendered whole on the server;
`static/live.js` then fetches the same URL with `?partial=1` every few seconds and swaps the page's live region,
until the server says nothing on it will change (`X-Fanin-Final: 1`). Without JavaScript the pages work the same,
only without updates.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

import jinja2
from sqlalchemy import Engine, create_engine
from sqlalchemy.engine import make_url
from sqlalchemy.exc import SQLAlchemyError
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import MutableHeaders
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..exceptions import summarise
from ..extension import FanIn
from ..store.reports import connect_options
from . import data
from .actions import ACTIONS, ACTOR, CSRF_COOKIE, Actions, actor, applicable, form_fields
from .format import FILTERS, pct

COOKIE = "fanin_dashboard"
# Sent with every response: nothing is framed, sniffed or loaded from elsewhere, and no URL (a `?token=` one
# least of all) leaks in a Referer. The pages use no inline script or style, so the policy needs no exception.
SECURITY_HEADERS = {
    "content-security-policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'; form-action 'self'",
    "x-content-type-options": "nosniff",
    "x-frame-options": "DENY",
    "referrer-policy": "no-referrer",
}


@dataclass(frozen=True)
class Options:
    refresh: float  # seconds between live updates
    page_size: int


def read_only_engine(fanin: FanIn, pool_size: int, statement_timeout: float) -> Engine:
    """An engine of the dashboard's own: every transaction read-only and bounded by `statement_timeout`, so that
    neither a bug nor a heavy page can write or hold the database; statements never prepared server-side, so each
    is planned with its parameters' values (see store/sql/dashboard.sql)."""
    url = fanin.database_url
    ours = f"-c default_transaction_read_only=on -c statement_timeout={int(statement_timeout * 1000)}"
    given = make_url(url).query.get("options")  # the URL's own server options (a search_path, say) are kept
    given = given[-1] if isinstance(given, tuple) else given
    args: dict[str, Any] = {
        **connect_options(url),
        "prepare_threshold": None,
        "application_name": "celery-fanin dashboard",
        "options": f"{given} {ours}" if given else ours,
    }
    return create_engine(url, pool_size=pool_size, max_overflow=pool_size, pool_pre_ping=True, connect_args=args)


# --- auth and headers -------------------------------------------------------------------------------------------


def _cookie_value(token: str) -> str:
    """What the cookie holds: derived from the token, so that the cookie is not the token itself."""
    return hmac.new(token.encode(), b"celery-fanin dashboard cookie", hashlib.sha256).hexdigest()


def _same(given: str, expected: str) -> bool:
    return hmac.compare_digest(given.encode(), expected.encode())


class Guard:
    """ASGI middleware: the security headers on every response, and, when a token or a user and password is set,
    a 401 for any request that does not carry them.

    A token is accepted as `Authorization: Bearer <token>`, as the password of HTTP Basic auth (any user name: a
    browser asks for it), or once as `?token=<token>`, which sets a cookie and redirects to the same URL without it
    (a link to share never needs to carry the token). `basic_auth` is a user name and password checked together.
    Every comparison takes the same time whatever matched.
    """

    def __init__(self, app: ASGIApp, token: str | None, basic_auth: tuple[str, str] | None) -> None:
        self.app = app
        self.token = token
        self.basic_auth = basic_auth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                for name, value in SECURITY_HEADERS.items():
                    headers.setdefault(name, value)
            await send(message)

        if self.token is None and self.basic_auth is None:
            scope.setdefault("state", {})[ACTOR] = "anonymous"
            await self.app(scope, receive, send_with_headers)
            return
        request = Request(scope)
        given = request.query_params.get("token")
        if self.token is not None and given is not None:
            await self._login(request, given)(scope, receive, send_with_headers)
            return
        who = self._signed_in(request)
        if who is None:
            await self._challenge()(scope, receive, send_with_headers)
            return
        scope.setdefault("state", {})[ACTOR] = who  # `request.state`: who an action is recorded as
        await self.app(scope, receive, send_with_headers)

    def _signed_in(self, request: Request) -> str | None:
        """Who the request signed in as: the basic-auth user, `token` for a token's holder; None if neither."""
        by_token = by_user = False
        header = request.headers.get("authorization", "")
        scheme, _, credentials = header.partition(" ")
        if self.token is not None:
            by_token |= scheme.lower() == "bearer" and _same(credentials.strip(), self.token)
            by_token |= _same(request.cookies.get(COOKIE, ""), _cookie_value(self.token))
        user = ""
        if scheme.lower() == "basic":
            try:
                user, _, password = base64.b64decode(credentials.strip(), validate=True).decode().partition(":")
            except (ValueError, UnicodeDecodeError):
                user, password = "", ""
            if self.token is not None:
                by_token |= _same(password, self.token)
            if self.basic_auth is not None:
                by_user = _same(user, self.basic_auth[0]) & _same(password, self.basic_auth[1])
        return user if by_user else "token" if by_token else None

    def _login(self, request: Request, given: str) -> Response:
        assert self.token is not None
        if not _same(given, self.token):
            return self._challenge()
        target = request.url.remove_query_params("token")
        response = RedirectResponse(str(target.replace(scheme="", netloc="")) or "/", status_code=303)
        response.set_cookie(
            COOKIE,
            _cookie_value(self.token),
            httponly=True,
            samesite="lax",
            secure=request.url.scheme == "https",
            path=request.scope.get("root_path") or "/",
        )
        return response

    def _challenge(self) -> Response:
        return PlainTextResponse(
            "401: this dashboard needs a token: open it once with ?token=..., or sign in with the token as the "
            "password (any user name)"
            if self.token is not None
            else "401: sign in to see this dashboard",
            status_code=401,
            headers={"www-authenticate": 'Basic realm="celery-fanin dashboard", charset="UTF-8"'},
        )


# --- pages ------------------------------------------------------------------------------------------------------


def _templates() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("celery_fanin.web", "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(FILTERS)
    env.globals.update(
        pct=pct, batch_states=data.BATCH_STATES, saga_states=data.SAGA_STATES, open_count_limit=data.OPEN_COUNT_LIMIT
    )
    return env


def _link(request: Request) -> Callable[..., str]:
    """`link("/batches", state="running")`: a path under wherever the app is mounted, with a query string."""
    root = request.scope.get("root_path", "")

    def link(path: str, query: dict[str, Any] | None = None, **params: Any) -> str:
        merged = {**(query or {}), **params}
        pairs = {k: v for k, v in merged.items() if v is not None and v != ""}
        return root + path + (("?" + urlencode(pairs)) if pairs else "")

    return link


class Pages:
    def __init__(self, engine: Engine, options: Options, actions: Actions | None = None) -> None:
        self.engine = engine
        self.options = options
        self.env = _templates()
        self.actions = actions  # `--allow-actions`: the batch page's buttons and their POST

    def render(self, request: Request, template: str, status: int = 200, final: bool = False, **ctx: Any) -> Response:
        """The page, or with `?partial=1` only its live region (`<name>_live.html`)."""
        partial = request.query_params.get("partial") == "1"
        name = template.replace(".html", "_live.html") if partial else template
        html = self.env.get_template(name).render(
            request=request, link=_link(request), refresh=self.options.refresh, final=final, **ctx
        )
        headers = {"cache-control": "no-store"}
        if final:
            headers["x-fanin-final"] = "1"
        return HTMLResponse(html, status_code=status, headers=headers)

    def error(self, request: Request, status: int, message: str) -> Response:
        if request.query_params.get("partial") == "1":
            return PlainTextResponse(message, status_code=status, headers={"cache-control": "no-store"})
        html = self.env.get_template("error.html").render(
            request=request, link=_link(request), status=status, message=message, title=str(status)
        )
        return HTMLResponse(html, status_code=status, headers={"cache-control": "no-store"})

    def guarded(self, page: Callable[[Request], Response]) -> Callable[[Request], Response]:
        """A page whose bad input becomes a 400 and whose database errors a 503, both with one line of why."""

        def endpoint(request: Request) -> Response:
            try:
                return page(request)
            except data.BadRequest as exc:
                return self.error(request, 400, str(exc))
            except SQLAlchemyError as exc:
                return self.error(request, 503, f"the database could not be read: {summarise(exc)}")

        return endpoint

    # Sync endpoints: Starlette runs them in its thread pool, beside the (blocking) database driver.

    def index(self, request: Request) -> Response:
        return RedirectResponse(_link(request)("/batches"), status_code=307)

    def batches(self, request: Request) -> Response:
        filters = data.BatchFilters.from_query(request.query_params)
        before = data.Cursor.decode(request.query_params.get("before"))
        with data.read(self.engine) as conn:
            page = data.batches_page(conn, filters, before, self.options.page_size)
            relay = data.relay_panel(conn)
        return self.render(
            request, "batches.html", page=page, relay=relay, filters=filters, before=before, title="Batches"
        )

    def batch(self, request: Request) -> Response:
        batch_id = _uuid(request.path_params["batch_id"], "batch")
        after = _int(request.query_params.get("failures_after"), -1)
        with data.read(self.engine) as conn:
            page = data.batch_page(conn, batch_id, after)
        if page is None:
            return self.error(request, 404, f"no fan-in batch with id {batch_id}")
        if self.actions is None:
            return self.render(
                request, "batch.html", final=page.final, page=page, title=f"Batch {batch_id}", actions=None
            )
        cookie = request.cookies.get(CSRF_COOKIE) or self.actions.new_cookie()
        row, successor = page.row, page.successor
        superseded = any(r.round > row.round for r in page.rounds)
        can = applicable(
            row.state, int(row.failed), successor.state if successor else None, row.parent_id is not None, superseded
        )
        response = self.render(
            request,
            "batch.html",
            final=False,  # an action may change it: keep it live
            page=page,
            title=f"Batch {batch_id}",
            actions={"can": can, "csrf": self.actions.token(cookie)},
        )
        if request.cookies.get(CSRF_COOKIE) != cookie:
            response.set_cookie(
                CSRF_COOKIE,
                cookie,
                httponly=True,
                samesite="strict",
                secure=request.url.scheme == "https",
                path=request.scope.get("root_path") or "/",
            )
        return response

    async def act(self, request: Request) -> Response:
        """POST `/batches/<id>/actions` (`--allow-actions`): check the form, run the action, record it, and go back
        to the batch's page, which lists it."""
        assert self.actions is not None
        try:
            batch_id = _uuid(request.path_params["batch_id"], "batch")
        except data.BadRequest as exc:
            return self.error(request, 400, str(exc))
        fields = form_fields(await request.body())
        action = str(fields.get("action") or "")
        if action not in ACTIONS:
            return self.error(request, 400, f"no action {action!r}: one of {', '.join(ACTIONS)}")
        refused = self.actions.check(request, fields.get("csrf"))
        if refused is not None:
            return self.error(request, 403, refused)
        await run_in_threadpool(self.actions.run, action, batch_id, actor(request))
        return RedirectResponse(_link(request)(f"/batches/{batch_id}"), status_code=303)

    def lookup(self, request: Request) -> Response:
        """`/lookup?id=`: the batch a batch id, a child's task id or a successor's task id belongs to."""
        value = (request.query_params.get("id") or "").strip()
        if not value:
            raise data.BadRequest("give a batch id, or a child's or a successor's task id (?id=)")
        with data.read(self.engine) as conn:
            found = data.lookup(conn, value)
        if found is None:
            return self.error(request, 404, f"no batch, child or successor with id {value}")
        return RedirectResponse(_link(request)(f"/batches/{found}"), status_code=303)

    def sagas(self, request: Request) -> Response:
        state = request.query_params.get("state") or None
        before = data.Cursor.decode(request.query_params.get("before"))
        with data.read(self.engine) as conn:
            page = data.sagas_page(conn, state, before, self.options.page_size)
        return self.render(request, "sagas.html", page=page, state=state, before=before, title="Sagas")

    def saga(self, request: Request) -> Response:
        saga_id = _uuid(request.path_params["saga_id"], "saga")
        with data.read(self.engine) as conn:
            page = data.saga_page(conn, saga_id)
        if page is None:
            return self.error(request, 404, f"no saga with id {saga_id}")
        return self.render(request, "saga.html", final=page.final, page=page, title=f"Saga {saga_id}")


class Api:
    """The JSON API (docs/how-to/dashboard.md#json-api): the batches list and one batch, as the pages show them."""

    def __init__(self, pages: Pages) -> None:
        self.pages = pages

    def guarded(self, endpoint: Callable[[Request], Response]) -> Callable[[Request], Response]:
        """Bad input a 400, a database error a 503, each as `{"error": why}`."""

        def guarded_endpoint(request: Request) -> Response:
            try:
                return endpoint(request)
            except data.BadRequest as exc:
                return _json_error(400, str(exc))
            except SQLAlchemyError as exc:
                return _json_error(503, f"the database could not be read: {summarise(exc)}")

        return guarded_endpoint

    def batches(self, request: Request) -> Response:
        filters = data.BatchFilters.from_query(request.query_params)
        before = data.Cursor.decode(request.query_params.get("before"))
        limit = min(_int(request.query_params.get("limit"), self.pages.options.page_size), 1000)
        if limit < 1:
            raise data.BadRequest("limit must be at least 1")
        with data.read(self.pages.engine) as conn:
            page = data.batches_page(conn, filters, before, limit)
        return JSONResponse(data.batches_json(page), headers={"cache-control": "no-store"})

    def relay(self, request: Request) -> Response:
        with data.read(self.pages.engine) as conn:
            panel = data.relay_panel(conn)
        return JSONResponse(data.relay_json(panel), headers={"cache-control": "no-store"})

    def batch(self, request: Request) -> Response:
        batch_id = _uuid(request.path_params["batch_id"], "batch")
        after = _int(request.query_params.get("failures_after"), -1)
        with data.read(self.pages.engine) as conn:
            page = data.batch_page(conn, batch_id, after)
        if page is None:
            return _json_error(404, f"no fan-in batch with id {batch_id}")
        return JSONResponse(data.batch_json(page), headers={"cache-control": "no-store"})


def _json_error(status: int, message: str) -> Response:
    return JSONResponse({"error": message}, status_code=status, headers={"cache-control": "no-store"})


def _uuid(value: str, what: str) -> uuid.UUID:
    try:
        return uuid.UUID(value)
    except ValueError:
        raise data.BadRequest(f"{value!r} is not a {what} id ({what} ids are UUIDs)") from None


def _int(value: str | None, default: int) -> int:
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise data.BadRequest(f"{value!r} is not a whole number") from None


def build(
    fanin: FanIn,
    *,
    token: str | None,
    basic_auth: tuple[str, str] | None,
    refresh: float,
    page_size: int,
    statement_timeout: float,
    pool_size: int,
    allow_actions: bool = False,
) -> Starlette:
    engine = read_only_engine(fanin, pool_size, statement_timeout)
    pages = Pages(engine, Options(refresh, page_size), Actions(fanin) if allow_actions else None)
    api = Api(pages)
    routes = [
        Route("/", pages.index, methods=["GET"]),
        Route("/batches", pages.guarded(pages.batches), methods=["GET"], name="batches"),
        Route("/batches/{batch_id}", pages.guarded(pages.batch), methods=["GET"], name="batch"),
        Route("/lookup", pages.guarded(pages.lookup), methods=["GET"], name="lookup"),
        *([Route("/batches/{batch_id}/actions", pages.act, methods=["POST"], name="act")] if allow_actions else []),
        Route("/api/batches", api.guarded(api.batches), methods=["GET"], name="api_batches"),
        Route("/api/batches/{batch_id}", api.guarded(api.batch), methods=["GET"], name="api_batch"),
        Route("/api/relay", api.guarded(api.relay), methods=["GET"], name="api_relay"),
        Route("/sagas", pages.guarded(pages.sagas), methods=["GET"], name="sagas"),
        Route("/sagas/{saga_id}", pages.guarded(pages.saga), methods=["GET"], name="saga"),
        Mount("/static", StaticFiles(packages=[("celery_fanin.web", "static")]), name="static"),
    ]
    app = Starlette(routes=routes, middleware=[Middleware(Guard, token=token, basic_auth=basic_auth)])
    app.state.engine = engine  # for whoever embeds the app and wants to dispose of its connections
    return app
