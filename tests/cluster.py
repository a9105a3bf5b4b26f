"""A PostgreSQL primary and a streaming standby of the test's own, to fail over (issue 39).

Built from Debian's `postgresql-15` server binaries (`initdb`, `pg_basebackup -R`, `pg_ctl promote`) in a
directory of the test's own, on free ports of its own (never the machine's server on 5432, which other sessions
share). The servers refuse to run as root, as the tests do in CI: as root they run as the `postgres` user.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg

BIN = Path(os.environ.get("FANIN_TEST_PG_BIN", "/usr/lib/postgresql/15/bin"))
DATABASE = "fanin"
USER = "postgres"  # the cluster's superuser (trust authentication on 127.0.0.1 only)
# Throwaway servers: fsync off costs nothing a test can see (a server stopped with `immediate` loses no write the
# OS has, only a machine crash would), and saves seconds on a shared machine.
SETTINGS = {
    "listen_addresses": "'127.0.0.1'",
    "wal_level": "replica",
    "max_wal_senders": "5",
    "wal_keep_size": "'64MB'",
    "hot_standby": "on",
    "fsync": "off",
    "full_page_writes": "off",
    "shared_buffers": "'32MB'",
    "max_connections": "100",
    "wal_receiver_status_interval": "'1s'",
    "logging_collector": "off",
}


def free_port() -> int:
    """A TCP port nobody listens on now (the kernel's pick, so never 5432 while the machine's server has it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    assert port != 5432
    return port


def _as_server_user() -> list[str]:
    return ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []


class Server:
    """One server of the cluster: its data directory and port."""

    def __init__(self, name: str, data: Path, port: int) -> None:
        self.name = name
        self.data = data
        self.port = port
        self.log = data.parent / f"{name}.log"

    @property
    def url(self) -> str:
        return f"postgresql://{USER}@127.0.0.1:{self.port}/{DATABASE}"

    def run(self, *args: str, timeout: float = 60) -> str:
        done = subprocess.run(
            [*_as_server_user(), *args], capture_output=True, text=True, timeout=timeout, cwd=self.data.parent
        )
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} exited {done.returncode}: {done.stdout}{done.stderr}")
        return done.stdout

    def configure(self, settings: dict[str, str]) -> None:
        """Appended to postgresql.auto.conf: read at the next start or reload, the last line winning."""
        with (self.data / "postgresql.auto.conf").open("a") as conf:
            conf.writelines(f"{k} = {v}\n" for k, v in settings.items())

    def start(self) -> None:
        self.run(str(BIN / "pg_ctl"), "start", "-w", "-t", "60", "-D", str(self.data), "-l", str(self.log))

    def first_start(self) -> None:
        """Start on its port, or on another if someone took that one since `free_port` picked it (another test
        session on the machine may be picking ports at the same moment)."""
        for attempt in range(3):
            try:
                self.start()
                return
            except RuntimeError:
                if attempt == 2 or "already in use" not in self.output():
                    raise
            self.port = free_port()
            self.configure({"port": str(self.port)})

    def stop(self, mode: str = "fast") -> None:
        self.run(str(BIN / "pg_ctl"), "stop", "-w", "-t", "60", "-m", mode, "-D", str(self.data))

    def reload(self) -> None:
        self.run(str(BIN / "pg_ctl"), "reload", "-D", str(self.data))

    def promote(self) -> None:
        self.run(str(BIN / "pg_ctl"), "promote", "-w", "-t", "60", "-D", str(self.data))

    @property
    def running(self) -> bool:
        return (self.data / "postmaster.pid").exists()

    def connect(self, dbname: str = DATABASE) -> psycopg.Connection:
        return psycopg.connect(
            host="127.0.0.1", port=self.port, user=USER, dbname=dbname, autocommit=True, connect_timeout=5
        )

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


class Cluster:
    """A primary and a standby streaming from it, synchronously (`synchronous`) or not."""

    def __init__(self, base: Path, synchronous: bool = True) -> None:
        self.base = base
        self.synchronous = synchronous
        self.primary = Server("primary", base / "primary", free_port())
        self.standby = Server("standby", base / "standby", free_port())

    # -- URLs: every server, the one that takes writes found by libpq (target_session_attrs=read-write) --

    @property
    def sqlalchemy_url(self) -> str:
        """SQLAlchemy's documented several-host form, as the issue's user wrote it."""
        hosts = "&".join(f"host=127.0.0.1:{s.port}" for s in (self.primary, self.standby))
        return f"postgresql+psycopg://{USER}@/{DATABASE}?{hosts}&target_session_attrs=read-write"

    @property
    def libpq_url(self) -> str:
        """libpq's several-host form."""
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in (self.primary, self.standby))
        return f"postgresql://{USER}@{hosts}/{DATABASE}?target_session_attrs=read-write"

    def create(self) -> None:
        """initdb, start the primary, create the database, base-backup the standby and start it streaming."""
        self.base.mkdir(parents=True, exist_ok=True)
        if os.geteuid() == 0:
            user = pwd.getpwnam("postgres")
            os.chown(self.base, user.pw_uid, user.pw_gid)
        self.primary.run(
            str(BIN / "initdb"), "-D", str(self.primary.data), "-U", USER, "-A", "trust", "--no-sync", "-E", "UTF8"
        )
        self.primary.configure(
            {
                **SETTINGS,
                "port": str(self.primary.port),
                "unix_socket_directories": f"'{self.base}'",
            }
        )
        self.primary.first_start()
        with self.primary.connect("postgres") as conn:
            conn.execute(f"CREATE DATABASE {DATABASE}")  # a constant
        self.primary.run(
            str(BIN / "pg_basebackup"),
            "-h",
            "127.0.0.1",
            "-p",
            str(self.primary.port),
            "-U",
            USER,
            "-D",
            str(self.standby.data),
            "-R",
            "-X",
            "stream",
            "--no-sync",
            "-c",
            "fast",
        )
        self.standby.configure(
            {
                "port": str(self.standby.port),
                "cluster_name": "'standby'",  # the walreceiver's application_name, which the primary waits for
                # Once promoted it has no standby of its own: a synchronous_standby_names inherited from the
                # primary would make every commit wait forever.
                "synchronous_standby_names": "''",
            }
        )
        self.standby.first_start()
        if self.synchronous:
            # Every commit waits for the standby's flush: what the exactly-once promise needs
            # (docs/how-to/high-availability.md). Set once the standby streams (the database above would wait for
            # it); the application name is the standby's cluster_name.
            self.primary.configure({"synchronous_standby_names": "'standby'"})
            self.primary.reload()
        self.wait_streaming()

    def migrate(self) -> None:
        """celery-fanin's schema, and the table the tests' successors record their runs in."""
        from celery import Celery

        from celery_fanin import FanIn
        from tests.app import RUNS_TABLE_DDL

        app = Celery("fanin-ha-migrate", set_as_current=False)
        app.conf.fanin_database_url = self.sqlalchemy_url
        fanin = FanIn(app)
        fanin.migrate()
        fanin.dispose()
        with self.primary.connect() as conn:
            conn.execute(RUNS_TABLE_DDL)

    def wait_streaming(self, timeout: float = 30) -> None:
        """Until the primary sees the standby streaming (and, if synchronous, as its synchronous standby)."""
        want = "sync" if self.synchronous else "async"
        deadline = time.monotonic() + timeout
        while True:
            with self.primary.connect("postgres") as conn:
                row = conn.execute(
                    "SELECT state, sync_state FROM pg_stat_replication WHERE application_name = 'standby'"
                ).fetchone()
            if row == ("streaming", want):
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"standby not streaming ({want}) after {timeout}s: {row}\n{self.standby.output()}")
            time.sleep(0.1)

    def fail_over(self) -> float:
        """The primary stopped as a crash would (`immediate`), the standby promoted; returns when it stopped
        (time.monotonic()), the moment the measure of issue 39 starts from."""
        self.primary.stop("immediate")
        stopped = time.monotonic()
        self.standby.promote()
        return stopped

    def rejoin(self) -> None:
        """After `fail_over`: the old primary made a standby of the new one (a fresh `pg_basebackup -R` into its
        directory, on its own port), and the roles swapped, so that the cluster can fail over again. The URLs name
        both ports, so they stay valid."""
        old, new = self.primary, self.standby
        if old.running:
            old.stop("immediate")
        shutil.rmtree(old.data)
        new.run(
            str(BIN / "pg_basebackup"),
            *("-h", "127.0.0.1", "-p", str(new.port), "-U", USER, "-D", str(old.data)),
            *("-R", "-X", "stream", "--no-sync", "-c", "fast"),
        )
        old.configure({"port": str(old.port), "cluster_name": "'standby'", "synchronous_standby_names": "''"})
        old.start()
        self.primary, self.standby = new, old
        if self.synchronous:
            new.configure({"synchronous_standby_names": "'standby'"})
            new.reload()
        self.wait_streaming()

    def detach_standby(self) -> None:
        """Stop the standby's WAL receiver: an empty primary_conninfo, reloaded (PostgreSQL 13+ restarts the
        receiver on a change of it, and with none it receives nothing). Then nothing the primary commits reaches
        the standby, as with asynchronous replication lagging at the moment of a failover."""
        self.standby.configure({"primary_conninfo": "''"})
        self.standby.reload()
        deadline = time.monotonic() + 30
        while True:
            with self.standby.connect("postgres") as conn:
                row = conn.execute("SELECT count(*) FROM pg_stat_wal_receiver").fetchone()
            if row is not None and row[0] == 0:
                return
            if time.monotonic() > deadline:
                raise AssertionError("the standby's WAL receiver did not stop")
            time.sleep(0.1)

    def destroy(self) -> None:
        for server in (self.standby, self.primary):
            if server.running:
                with contextlib.suppress(Exception):  # already stopped (the failed-over primary), or stopping
                    server.stop("immediate")
        shutil.rmtree(self.base, ignore_errors=True)


@contextlib.contextmanager
def cluster(synchronous: bool = True) -> Iterator[Cluster]:
    """A running cluster for one test, stopped and deleted afterwards even if the test fails.

    Under a directory of its own in the system's temporary directory: pytest's `tmp_path` lies under a directory
    only root may enter (/tmp/pytest-of-root, mode 0700), where the `postgres` user could not reach its data."""
    base = Path(tempfile.mkdtemp(prefix="fanin-ha-"))
    made = Cluster(base, synchronous=synchronous)
    try:
        made.create()
        yield made
    except BaseException:
        for server in (made.primary, made.standby):
            print(f"===== {server.name} log =====\n{server.output()[-4000:]}")
        raise
    finally:
        made.destroy()
