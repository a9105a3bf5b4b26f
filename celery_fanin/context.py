"""The per-app context every module may import: `Settings` from `app.conf`, and `FanIn.of(app)`'s engine and
report connection. Wiring the hooks and tasks into an app is `celery_fanin.extension`'s job."""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar, cast

import psycopg
from celery import Celery
from sqlalchemy import URL, Engine, create_engine
from sqlalchemy.exc import ArgumentError, SQLAlchemyError

from . import redact, retry
from .exceptions import FanInDatabaseError, FanInNotConfigured, summarise
from .protocol import OnLost
from .store import cooperative, migrate
from .store.pooler import transaction_pooled
from .store.reports import ReportConnection, connect_options
from .store.urls import sqlalchemy_url

F = TypeVar("F", bound="FanIn")

_REGISTRY: weakref.WeakKeyDictionary[Celery, FanIn] = weakref.WeakKeyDictionary()
_REGISTRY_LOCK = threading.Lock()

# `FanInGroup.apply`'s eager mode: on for the code that runs in this thread (or task) inside the call, never in the
# app's configuration, which every thread of the process shares.
_EAGER_CALL: contextvars.ContextVar[bool] = contextvars.ContextVar("celery_fanin_eager_call", default=False)


def eager_call() -> bool:
    """Whether this code runs inside `FanInGroup.apply` (`eagerly`), whatever the app's `task_always_eager`."""
    return _EAGER_CALL.get()


def is_eager(app: Celery) -> bool:
    """Whether fan-ins run inline here: the app's `task_always_eager`, or inside `FanInGroup.apply`.

    Why not `app.conf` alone: `apply` must not switch the setting on for the whole process (another thread's
    `apply_async` would run inline too) nor leave it changed, so it sets this context's flag instead."""
    return _EAGER_CALL.get() or bool(app.conf.task_always_eager)


@contextlib.contextmanager
def eagerly() -> Iterator[None]:
    """Fan-ins created or published in this context run inline until it exits (raising or not); `app.conf` is
    left alone."""
    token = _EAGER_CALL.set(True)
    try:
        yield
    finally:
        _EAGER_CALL.reset(token)


@dataclass(frozen=True)
class Settings:
    """Every setting, with its default; read from `app.conf` as `fanin_<name>`."""

    database_url: str | None = None
    # The alias of a Django database whose connection settings celery-fanin uses when database_url is not set
    # (`CELERY_FANIN_DJANGO_DATABASE = "default"`): read when a connection is made, so pytest-django's test
    # database is followed, as Django's own connections follow it. See docs/how-to/django.md.
    django_database: str | None = None
    pool_size: int = 5
    # Most failures listed inline in the outcome a successor receives; the full list stays in Postgres.
    outcome_failures_limit: int = 100
    # ... and at most this many bytes of them (JSON, arguments included), so the successor's message stays small.
    outcome_max_bytes: int = 256 * 1024
    # `celery_fanin.chord`: its body gets every header result in one message, so a header may have at most this many
    # tasks (more is refused before anything is written: fan_in_group's successor streams results instead), and
    # their encoded results at most this many bytes (more: the body fails with ChordHeaderFailed, not sent).
    chord_max_header: int = 10_000
    chord_max_bytes: int = 16 * 1024 * 1024
    # Children written and published per round trip by the producer and the relay.
    chunk_size: int = 1000
    # Above this many children a batch becomes a tree of leaf counters (filled round robin, tree_fanout at a time).
    # 150, chosen by measurement (python -m bench.scaling, BENCHMARKS.md): a 10,000-child batch gets 67 leaves, as
    # many counter rows as the most concurrent reporters measured (64). From 4 reporters up a flat batch took about
    # half of a raw one-row UPDATE's rate and every tree more (the default's 1.7x flat's at 16 reporters); with one
    # or two reporters a tree costs nothing measurable.
    max_width: int = 150
    tree_fanout: int = 16
    # Whether a fan-in child's result is also stored in Celery's result backend. Off: the library publishes each
    # child with ignore_result=True (unless its signature sets ignore_result itself), as the outcome the successor
    # gets is read from PostgreSQL and a second copy in the backend costs a write per child (and, with the Redis
    # backend, a result subscription per child). On: Celery's own behaviour, the task's ignore_result decides.
    store_child_results_in_backend: bool = False
    # How deep fan-ins may nest (one created in a fan-in child or successor is one deeper; the first is 0).
    max_depth: int = 8
    relay_poll_interval: float = 1.0
    relay_batch_size: int = 100
    # The relay's liveness probe (/healthz) fails once its loop has not gone round for this long (a stuck round).
    relay_stall_timeout: float = 300.0
    # Seconds a worker keeps retrying a report (a child's terminal outcome, a successor's state) while the store
    # is unreachable, with jittered backoff, before it logs, counts (fanin_worker_reports_given_up_total) and leaves
    # it to reconciliation and child_timeout. The pool process waits meanwhile: a report is never dropped sooner.
    report_timeout: float = 300.0
    # Deprecated and ignored (every store call of a worker is bounded by report_timeout); kept so old configs load.
    record_attempts: int = 5
    # Record each child's start (time, attempt, worker), written off the child's path by a thread of the pool
    # process at most every start_write_interval seconds, many starts per statement (see celery_fanin.worker.starts).
    track_started: bool = True
    start_write_interval: float = 0.25
    # Default per-batch child timeout in seconds (None or 0: children may run forever) and what happens past it.
    child_timeout: float | None = 6 * 3600.0
    on_lost: str = OnLost.FAIL
    max_redrives: int = 3
    # Seconds a successor may stay sent (or retrying past its due time) without starting before it is published
    # again.
    successor_timeout: float = 600.0
    # A successor's run holds a lease on its row, renewed every successor_lease / 4 seconds while its body runs.
    # A run whose lease lapsed more than successor_lease_grace seconds ago is dead (its worker died, or lost the
    # database for that long): another delivery may then run the successor. A database outage shorter than
    # successor_lease + successor_lease_grace never lets a second run start beside a live one.
    successor_lease: float = 60.0
    successor_lease_grace: float = 60.0
    # Seconds a replaced successor (`self.replace(...)`, `then=chain(...)`) may wait for its replacement's carrier,
    # or stay with a dead carrier run, before the relay records it failed (`ReplacementLost`) and its batch ends; a
    # carrier that comes later is refused. None (the default): no bound, as a replaced task has none in Celery.
    replaced_timeout: float | None = None
    # Refuse to start a worker or relay whose database URL goes through a transaction-mode pooler (see
    # celery_fanin.store.pooler): session pooling or a direct connection is required.
    check_pooler: bool = True
    # How often the relay looks for lost children and passed deadlines, and reconciles counters.
    reaper_interval: float = 10.0
    # Seconds past a child's `expires` after which the relay counts it as revoked if no worker took it: a broker
    # may drop an expired message unconsumed (RabbitMQ), and then no worker reports it. The relay waits this plus
    # report_timeout, the time a worker keeps retrying the start of a child it took (relay.maintenance.expiry_grace).
    expires_grace: float = 30.0
    reconcile_interval: float = 300.0
    # Seconds an open (streaming) batch may stay without a live producer before the relay seals it.
    open_batch_grace: float = 300.0
    # The worker whose report created a successor publishes it itself right after that commit (claiming its
    # outbox row as the relay does, so one of them publishes it), and the relay is not woken for it: its periodic
    # scan is the fallback for a worker that dies in between. False: every successor goes through the relay.
    worker_publishes_successors: bool = True
    # Seconds the relay leaves a completed batch's successor to the worker whose report created it, before it
    # publishes the successor itself (the worker publishes it with no lock held, so a worker slower than this
    # publishes a second copy, which the successor's run guard refuses). 0: the worker claims the row as the
    # relay does (a lock held across its publish) and the relay may take it at once.
    successor_handoff: float = 5.0
    # A prefork worker's pool processes send their children's terminal reports to one thread of the worker's main
    # process, which commits those that arrive together in one statement (worker/batching.py): fewer durable
    # commits than children. Each pool process still waits for its report's commit, so acks_late still means
    # "acknowledged after the report is durable". Other pools always send their own.
    report_batching: bool = False
    # A completed batch's successor runs in the pool process whose report completed the batch, through Celery's
    # tracer, instead of going through the broker (dispatch/inline.py): when this worker runs its task, consumes its
    # queue, and neither it nor the child's job has a time limit or an eta. Its run guard admits it as it would the
    # message, and a successor whose id the worker has revoked is published (to be discarded) instead. False: every
    # successor is published.
    successor_inline: bool = True

    def __post_init__(self) -> None:
        for name in CHECKED:
            _check(name, getattr(self, name))

    @classmethod
    def from_conf(cls, conf: Any) -> Settings:
        values: dict[str, Any] = {}
        for name in cls.__dataclass_fields__:
            value = conf.get(f"fanin_{name}", _UNSET)
            if value is _UNSET or (value is None and name not in NONE_ALLOWED):
                continue
            values[name] = _seconds(name, value)
        if not values.get("database_url") and not values.get("django_database"):
            values["database_url"] = os.environ.get("FANIN_DATABASE_URL") or None
        return cls(**values)


# The settings checked where they are read, before a producer writes or a relay publishes anything with them:
# the successor's outcome budget, and durations the relay acts on (its expiry sweep waits the sum of the first two
# past a child's `expires`), checked when read rather than mid-round.
CHECKED = ("outcome_max_bytes", "expires_grace", "report_timeout", "replaced_timeout")


def _check(name: str, value: Any) -> Any:
    """`value`, if it is a valid value of setting `name` (one of CHECKED); else FanInNotConfigured."""
    if name == "outcome_max_bytes":
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise FanInNotConfigured(f"fanin_outcome_max_bytes must be a whole number of bytes >= 0, not {value!r}")
        return value
    if value is None and name in NONE_ALLOWED:  # replaced_timeout = None: no bound
        return value
    try:
        valid = not isinstance(value, bool) and float(value) >= 0  # NaN compares False
    except (TypeError, ValueError):
        valid = False
    if not valid:
        raise FanInNotConfigured(f"fanin_{name} must be a number of seconds >= 0, not {value!r}")
    return value


class LiveSettings:
    """`Settings` as `fanin.settings` gives them: each read from `app.conf` when it is used, so one costs one
    lookup on a hot path (a whole `Settings` reads every one), and it is the configuration of now (apps are
    configured after `FanIn(app)`). A setting that `Settings` checks is checked when it is read."""

    __slots__ = ("_conf",)

    def __init__(self, conf: Any) -> None:
        self._conf = conf

    def __getattr__(self, name: str) -> Any:
        field = Settings.__dataclass_fields__.get(name)
        if field is None:
            raise AttributeError(f"no celery-fanin setting named {name!r}")
        value = self._conf.get(f"fanin_{name}", _UNSET)
        if value is _UNSET or (value is None and name not in NONE_ALLOWED):
            if name == "database_url" and not self.django_database:
                return os.environ.get("FANIN_DATABASE_URL") or None
            return field.default
        value = _seconds(name, value)
        return _check(name, value) if name in CHECKED else value


# Settings given as seconds; a timedelta is taken too, as Celery's own durations (`result_expires`) are.
DURATIONS = frozenset(
    {
        "report_timeout",
        "start_write_interval",
        "child_timeout",
        "successor_timeout",
        "successor_lease",
        "successor_lease_grace",
        "relay_poll_interval",
        "relay_stall_timeout",
        "reaper_interval",
        "expires_grace",
        "reconcile_interval",
        "open_batch_grace",
        "successor_handoff",
        "replaced_timeout",
    }
)
# Settings for which an explicit None means "none" (`fanin_child_timeout = None`: no timeout) rather than "the
# default"; for every other setting None is the same as not setting it.
NONE_ALLOWED = frozenset({"child_timeout", "replaced_timeout"})
_UNSET = object()


def settings_of(app: Celery) -> Settings:
    """`app`'s settings (`LiveSettings`), for code that may run for an app `FanIn(app)` was not called for (the
    publishing functions take any app): `FanIn.settings` without the extension."""
    return cast(Settings, LiveSettings(app.conf))


def _seconds(name: str, value: Any) -> Any:
    return value.total_seconds() if name in DURATIONS and isinstance(value, timedelta) else value


def normalise_database_url(url: str) -> str:
    """Accept `postgresql://` and `postgres://` URLs, with one host or several (in SQLAlchemy's `?host=a:5432&host=
    b:5432` form or libpq's `a:5432,b:5432`), and select the psycopg 3 driver SQLAlchemy needs."""
    redact.remember(url)  # before anything can quote it back (a parse error, a driver error)
    try:
        parsed = sqlalchemy_url(url)
    except (ValueError, ArgumentError) as exc:
        raise FanInNotConfigured(f"fanin_database_url is not a valid URL: {redact.redact(str(exc))}") from None
    if parsed.get_backend_name() != "postgresql":
        raise FanInNotConfigured(f"fanin_database_url must be a PostgreSQL URL, got {parsed.get_backend_name()!r}")
    return parsed.render_as_string(hide_password=False)


def django_database_url(alias: str) -> str:
    """The URL of Django's database `alias`, from its connection settings as they are now (pytest-django points
    them at its test database before the first test)."""
    try:
        from django.db import connections  # noqa: PLC0415 - only for an app that names a Django database
        from django.db.utils import ConnectionDoesNotExist  # noqa: PLC0415
    except ImportError:
        raise FanInNotConfigured("fanin_django_database is set but Django is not installed") from None
    try:
        conf = connections[alias].settings_dict
    except ConnectionDoesNotExist:
        raise FanInNotConfigured(f"fanin_django_database: Django has no database {alias!r} (DATABASES)") from None
    if "postgresql" not in str(conf.get("ENGINE", "")):
        raise FanInNotConfigured(f"fanin_django_database: Django's database {alias!r} is not PostgreSQL")
    port = str(conf.get("PORT") or "")
    options = conf.get("OPTIONS") or {}
    # libpq's TLS options as Django passes them (OPTIONS), so the fan-in connection is as secure as Django's.
    tls = ("sslmode", "sslrootcert", "sslcert", "sslkey")
    query = {key: str(options[key]) for key in tls if key in options}
    return URL.create(
        "postgresql+psycopg",
        username=conf.get("USER") or None,
        password=conf.get("PASSWORD") or None,
        host=conf.get("HOST") or None,
        port=int(port) if port else None,
        database=conf.get("NAME") or None,
        query=query,
    ).render_as_string(hide_password=False)


def dispose_all() -> None:
    """Close every app's connections: before a database they use is dropped (pytest-django's test database)."""
    with _REGISTRY_LOCK:
        found = list(_REGISTRY.values())
    for fanin in found:
        fanin.dispose()


def _unproxy(app: Celery) -> Celery:
    """`celery.current_app` is a proxy; the registry is keyed by the real app object."""
    get = getattr(app, "_get_current_object", None)
    return get() if callable(get) else app


class FanIn:
    """The celery-fanin context of one Celery app: its settings, engine and report connection.

    One object per app (`FanIn.of(app)` finds it); the public `celery_fanin.FanIn` is the subclass that also wires
    the app. The engine is created lazily and again in every forked process, since connections must not cross fork.
    """

    app: Celery
    _engine: Engine | None
    _reports: ReportConnection | None
    _engine_pid: int | None
    _engine_lock: threading.Lock

    def __new__(cls: type[F], app: Celery) -> F:
        app = _unproxy(app)
        redact.guard_loggers()  # on every call: modules imported since (the relay's, the CLI's) log too
        with _REGISTRY_LOCK:
            existing = _REGISTRY.get(app)
            if existing is not None:
                return cast(F, existing)
            self = super().__new__(cls)
            self.app = app
            self._engine = None
            self._reports = None
            self._engine_pid = None
            self._engine_lock = threading.Lock()
            _REGISTRY[app] = self
        self._wire()
        redact.guard_loggers()
        return self

    def _wire(self) -> None:
        """Connect the worker hooks and register the built-in tasks: done by `celery_fanin.extension.FanIn`."""

    def __init__(self, app: Celery) -> None:  # all the work is in __new__, which runs once per app
        pass

    @classmethod
    def of(cls, app: Celery) -> FanIn:
        """The extension wired into `app`; a clear error if `FanIn(app)` was never called."""
        app = _unproxy(app)
        found = _REGISTRY.get(app)
        if found is None:
            raise FanInNotConfigured(f"celery-fanin is not enabled for app {app.main!r}: call FanIn(app) first")
        return found

    @classmethod
    def find(cls, app: Celery) -> FanIn | None:
        return _REGISTRY.get(_unproxy(app))

    @property
    def settings(self) -> Settings:  # type: ignore[override]
        """The app's settings (`fanin.settings.report_timeout`), each read from `app.conf` when it is used
        (`LiveSettings`): cheap enough for a worker hook's path."""
        return settings_of(self.app)

    @property
    def database_url(self) -> str:
        settings = self.settings
        url = settings.database_url
        if not url and settings.django_database:
            url = django_database_url(settings.django_database)
        if not url:
            raise FanInNotConfigured(
                "no database configured: set app.conf.fanin_database_url or the FANIN_DATABASE_URL environment "
                "variable (for example postgresql+psycopg://user@127.0.0.1/dbname), or fanin_django_database"
            )
        return normalise_database_url(url)

    @property
    def engine(self) -> Engine:
        pid = os.getpid()
        if self._engine is None or self._engine_pid != pid:
            with self._engine_lock:
                if self._engine is None or self._engine_pid != pid:
                    if self._engine is not None:
                        # Inherited across fork: drop the parent's connections without closing its sockets.
                        self._engine.dispose(close=False)
                    cooperative.ensure()  # under eventlet, before the first connection
                    # pool_pre_ping: a connection the server dropped (a restart, a network cut) is found dead at
                    # checkout and replaced, instead of failing the first statement sent on it; one that finds the
                    # server read-only (25006, a failover) is discarded too (`retry.reconnect_on_read_only`).
                    self._engine = retry.reconnect_on_read_only(
                        create_engine(
                            self.database_url,
                            pool_size=self.settings.pool_size,
                            pool_pre_ping=True,
                            isolation_level="READ COMMITTED",
                            connect_args=connect_options(self.database_url),
                        )
                    )
                    self._engine_pid = pid
        return self._engine

    @property
    def reports(self) -> ReportConnection:
        """The worker's one transport (its connections, one per statement in flight) for its runtime statements: a
        child's start and terminal reports, a successor run's admission, hand-over, renewals and end (see
        `store.reports`)."""
        reports = self._reports
        if reports is None:
            with self._engine_lock:
                if self._reports is None:
                    self._reports = ReportConnection(self.database_url)
                reports = self._reports
        return reports

    @property
    def worker_publishes_successors(self) -> bool:
        """Whether this process's worker hooks publish the successors their reports create (not in eager mode,
        which runs them inline)."""
        return bool(self.settings.worker_publishes_successors) and not is_eager(self.app)

    @property
    def report_handoff(self) -> float | None:
        """What this process's child reports say about a successor they create (`store.reports.record_terminal`'s
        `handoff`): None, the relay publishes it; else this worker does, and the relay leaves a completed batch's
        successor to it for that many seconds (`fanin_successor_handoff`; 0: due for the relay at once)."""
        if not self.worker_publishes_successors:
            return None
        return max(0.0, float(self.settings.successor_handoff))

    def dispose(self) -> None:
        with self._engine_lock:
            if self._engine is not None:
                self._engine.dispose()
            if self._reports is not None:
                self._reports.reset()
            self._engine = None
            self._reports = None
            self._engine_pid = None

    def check_session_pooling(self) -> None:
        """Raise `FanInNotConfigured` if the database URL reaches PostgreSQL through a transaction-mode pooler.

        Run when a worker or relay starts (unless `fanin_check_pooler` is off). A database that cannot be reached
        now is not an error here: the processes wait for it as they always do.
        """
        if not self.settings.check_pooler:
            return
        try:
            pooled = transaction_pooled(self.database_url)
        except psycopg.OperationalError as exc:
            logging.getLogger("celery_fanin").warning("could not check for a connection pooler: %s", exc)
            return
        if pooled:
            raise FanInNotConfigured(
                "fanin_database_url reaches PostgreSQL through a pooler in transaction (or statement) mode: "
                "celery-fanin needs each connection to keep its session (advisory locks, LISTEN, prepared "
                "statements). Use session mode (PgBouncer pool_mode = session) or a direct connection "
                "(set fanin_check_pooler = False to skip this check)."
            )

    def check_settings(self) -> Settings:
        """Every setting read and checked at once (`FanInNotConfigured` for a bad value), as a frozen `Settings`:
        when a worker or relay starts and when a producer writes a batch, rather than at a first read mid-round."""
        return Settings.from_conf(self.app.conf)

    def check_schema(self) -> None:
        """Raise `FanInNotConfigured` if the database lacks a migration this installation needs (none applied, or
        an older version): a worker or relay on it would fail at its first report or round with an error that does
        not say why. Run when a worker or relay starts; a database that cannot be read now is not an error here
        (the processes wait for it as they always do)."""
        try:
            have = migrate.applied(self.engine)
        except SQLAlchemyError as exc:
            logging.getLogger("celery_fanin").warning("could not check the fan-in schema's version: %s", summarise(exc))
            return
        todo = [m for m in migrate.available() if m.version not in set(have)]
        if not todo:
            return
        names = ", ".join(f"{m.version:04d}_{m.name}" for m in todo)
        where = "has no fan-in schema" if not have else f"has an older fan-in schema (version {max(have)})"
        raise FanInNotConfigured(
            f"the database {where}: {len(todo)} migration(s) not applied ({names}); "
            "run `celery -A proj fanin migrate` first"
        )

    def migrate(self) -> list[str]:
        """Create or upgrade the schema; returns the names of the migrations applied."""
        try:
            return [f"{m.version:04d}_{m.name}" for m in migrate.migrate(self.engine)]
        except SQLAlchemyError as exc:
            raise FanInDatabaseError(f"could not migrate the fan-in schema: {summarise(exc)}") from exc
