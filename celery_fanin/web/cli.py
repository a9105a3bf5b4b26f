"""`celery -A proj fanin dashboard`: serve the read-only dashboard with uvicorn.

The `fanin` group (celery_fanin.cli, a layer above this package) makes the command with its own helpers, as
`command(_fanin, _errors_as_exit)`: this module never imports the cli package. Imported by every `celery` command,
so it imports nothing of the web extra until the command runs.
"""

from __future__ import annotations

import ipaddress
import signal
import socket
from collections.abc import Callable
from typing import Any

import click

from ..extension import FanIn
from ..ops.inspection import parse_seconds


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def _listen(host: str, port: int) -> socket.socket:
    """A listening socket on `host`:`port` (port 0: any free one), made here so that the address the command
    prints is the one it serves, and a taken port is a one-line error before anything starts."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # asyncio sets TCP_NODELAY only on sockets whose protocol says TCP; without it a keep-alive response's
        # second write waits for the client's delayed ACK (40 ms).
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError as exc:
        raise click.ClickException(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def _finite(ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    """--refresh as a finite number of seconds (click's FloatRange takes nan and inf)."""
    if value is None:
        return None
    try:
        return parse_seconds(value, 0.2)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def _user_password(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[str, str] | None:
    if value is None:
        return None
    user, sep, password = value.partition(":")
    if not sep or not user or not password:
        raise click.BadParameter("give USER:PASSWORD, neither empty")
    return user, password


def _prefix(ctx: click.Context, param: click.Parameter, value: str) -> str:
    prefix = value.strip().rstrip("/")
    if prefix and (not prefix.startswith("/") or any(c in prefix for c in "?#% ")):
        raise click.BadParameter(f"{value!r} is not a URL path (like /fanin)")
    return prefix


def _exit_cleanly(signum: int, frame: object) -> None:
    raise SystemExit(0)


def command(
    fanin_of: Callable[[click.Context], FanIn], errors_as_exit: Callable[[Callable[..., Any]], Callable[..., Any]]
) -> click.Command:
    """The `dashboard` command: `fanin_of` finds the app's FanIn in Celery's CLI context, `errors_as_exit` turns
    celery-fanin and database errors into one-line exits (the cli package's own helpers)."""

    @click.command(name="dashboard")
    @click.option(
        "--host",
        "--address",
        "host",
        default="127.0.0.1",
        show_default=True,
        help="Address to listen on. Anything but loopback needs --token (or --allow-unauthenticated).",
    )
    @click.option("--port", type=click.IntRange(0, 65535), default=5566, show_default=True, help="0: any free port.")
    @click.option(
        "--token",
        envvar="FANIN_DASHBOARD_TOKEN",
        default=None,
        help="Require this token (default: $FANIN_DASHBOARD_TOKEN, else app.conf.fanin_dashboard_token). "
        "Open the dashboard once with ?token=..., or sign in with it as the password.",
    )
    @click.option(
        "--refresh",
        type=click.FloatRange(min=0.2),
        callback=_finite,
        default=None,
        help="Seconds between live updates (default fanin_dashboard_refresh, else 2).",
    )
    @click.option(
        "--basic-auth",
        envvar="FANIN_DASHBOARD_BASIC_AUTH",
        default=None,
        callback=_user_password,
        help="Require HTTP basic auth with this USER:PASSWORD (default: $FANIN_DASHBOARD_BASIC_AUTH), as Flower's.",
    )
    @click.option(
        "--url-prefix",
        default="",
        callback=_prefix,
        help="Serve under this path (`/fanin`: the pages at /fanin/batches), behind a proxy that keeps the prefix.",
    )
    @click.option(
        "--allow-actions",
        is_flag=True,
        help="Show buttons on a batch's page to retry its failed children, cancel, seal or rerun its successor "
        "(CSRF-protected, each recorded with who and when); they run with the app's database URL.",
    )
    @click.option(
        "--allow-unauthenticated",
        is_flag=True,
        help="Serve a non-loopback address without a token (behind a proxy that authenticates).",
    )
    @click.pass_context
    @errors_as_exit
    def dashboard(
        ctx: click.Context,
        host: str,
        port: int,
        token: str | None,
        refresh: float | None,
        basic_auth: tuple[str, str] | None,
        url_prefix: str,
        allow_actions: bool,
        allow_unauthenticated: bool,
    ) -> None:
        """Serve the web dashboard of batches and sagas (needs the web extra): read-only unless --allow-actions."""
        from . import create_app, require_extra

        require_extra(("starlette", "jinja2", "uvicorn"))
        import uvicorn

        fanin = fanin_of(ctx)
        token = token or fanin.app.conf.get("fanin_dashboard_token") or None
        if token is None and basic_auth is None and not is_loopback(host) and not allow_unauthenticated:
            raise click.ClickException(
                f"refusing to serve the dashboard on {host} without a token: pass --token (or set "
                "FANIN_DASHBOARD_TOKEN) or --basic-auth, or --allow-unauthenticated behind a proxy that authenticates"
            )
        dashboard_app = create_app(
            fanin, token=token, basic_auth=basic_auth, refresh=refresh, allow_actions=allow_actions
        )
        app = dashboard_app
        if url_prefix:
            from starlette.applications import Starlette
            from starlette.routing import Mount

            app = Starlette(routes=[Mount(url_prefix, app=dashboard_app)])  # its links stay under the mount
            app.state.engine = dashboard_app.state.engine
        sock = _listen(host, port)
        bound = sock.getsockname()
        shown = f"[{bound[0]}]" if sock.family == socket.AF_INET6 else bound[0]
        needs = " (token required)" if token else " (basic auth required)" if basic_auth else ""
        needs += " (actions allowed)" if allow_actions else ""
        click.echo(f"dashboard at http://{shown}:{bound[1]}{url_prefix}/" + needs, err=True)
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off"))
        # uvicorn shuts down gracefully on SIGINT or SIGTERM, then raises the signal again for the handler it found:
        # this one, so that a warm stop exits 0 (as the relay does) instead of dying by the signal.
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, _exit_cleanly)
        try:
            server.run(sockets=[sock])
        finally:
            app.state.engine.dispose()
            sock.close()

    return dashboard
