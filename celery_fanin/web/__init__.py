"""A read-only web dashboard for batches and sagas (the `web` extra: `pip install "celery-fanin[web]"`).

`create_app(app)` is an ASGI application: serve it with `celery -A proj fanin dashboard`, any ASGI server, or
mount it inside an existing Starlette or FastAPI app (`Mount("/fanin", app=create_app(celery_app))`); a WSGI app
(Flask, Django) can mount it through a2wsgi's `ASGIMiddleware`. See docs/how-to/dashboard.md.
"""

from __future__ import annotations

from typing import Any

from celery import Celery

from ..exceptions import FanInError
from ..extension import FanIn

MISSING_EXTRA = 'the dashboard needs the web extra: pip install "celery-fanin[web]"'
# What the app needs; the `dashboard` command needs uvicorn as well.
APP_MODULES = ("starlette", "jinja2")


class MissingExtra(FanInError, ImportError):
    """The `web` extra (Starlette, Jinja2, uvicorn) is not installed."""


def require_extra(modules: tuple[str, ...] = APP_MODULES) -> None:
    """Raise `MissingExtra` unless the web extra's `modules` can be imported."""
    import importlib

    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise MissingExtra(f"{MISSING_EXTRA} ({name} is not installed)") from exc


def create_app(
    fanin_or_app: FanIn | Celery,
    *,
    token: str | None = None,
    basic_auth: tuple[str, str] | None = None,
    refresh: float | None = None,
    page_size: int = 50,
    statement_timeout: float = 10.0,
    pool_size: int = 2,
    allow_actions: bool = False,
) -> Any:
    """The dashboard as a Starlette (ASGI) application, reading the store of `fanin_or_app` (a `FanIn` or a
    Celery app, wired with `FanIn(app)` here if it is not yet).

    `token`: require it (as a Bearer token, a Basic-auth password, or once as `?token=`, which sets a cookie);
    default `app.conf.fanin_dashboard_token`. `basic_auth`: a (user, password) pair to require instead or as well.
    Neither: no auth, for a loopback address or behind a proxy that authenticates. `refresh`: seconds between live
    updates (default `fanin_dashboard_refresh`, else 2). Connections are read-only (`default_transaction_read_only`)
    and every statement is bounded by `statement_timeout` seconds: a role with SELECT alone is enough.
    `allow_actions`: a batch's page gets buttons to retry its failed children, cancel, seal, or rerun its
    successor, each a CSRF-protected POST recorded with who and when (see `celery_fanin.web.actions`); they run
    through the app's own database URL, whose role needs the rights the operator commands need.
    """
    require_extra()
    from .app import build

    fanin = fanin_or_app if isinstance(fanin_or_app, FanIn) else FanIn(fanin_or_app)
    conf = fanin.app.conf
    token = token if token is not None else conf.get("fanin_dashboard_token")
    if token is not None and not str(token).strip():
        raise ValueError("the dashboard token must not be empty")
    if basic_auth is not None and (len(basic_auth) != 2 or not all(basic_auth)):
        raise ValueError("basic_auth must be a (user, password) pair, neither empty")
    refresh = float(refresh if refresh is not None else conf.get("fanin_dashboard_refresh") or 2.0)
    if refresh < 0.2:
        raise ValueError(f"refresh must be at least 0.2 seconds, not {refresh}")
    if page_size < 1:
        raise ValueError(f"page_size must be at least 1, not {page_size}")
    return build(
        fanin,
        token=token,
        basic_auth=basic_auth,
        refresh=refresh,
        page_size=page_size,
        statement_timeout=statement_timeout,
        pool_size=pool_size,
        allow_actions=allow_actions,
    )


__all__ = ["MISSING_EXTRA", "MissingExtra", "create_app", "require_extra"]
