"""Database URLs with one host or several: the psycopg connections (reports, starts, the relay's LISTEN, the pooler
probe, the testing plugin) read a URL exactly as the SQLAlchemy engine does (issue 39: the several-host URL that
SQLAlchemy documents reached libpq as hosts named "a:5432")."""

from __future__ import annotations

import pytest
from psycopg.conninfo import conninfo_to_dict
from sqlalchemy import create_engine
from sqlalchemy.exc import ArgumentError

from celery_fanin.context import normalise_database_url
from celery_fanin.exceptions import FanInNotConfigured
from celery_fanin.store.reports import ReportConnection, connect_options, libpq_conninfo
from celery_fanin.store.urls import sqlalchemy_url


def engine_params(url: str) -> dict[str, object]:
    """What the engine hands psycopg for `url` (no connection is made)."""
    engine = create_engine(normalise_database_url(url))
    try:
        _, params = engine.dialect.create_connect_args(engine.url)
        return {k: str(v) for k, v in params.items() if k != "context"}  # the dialect's psycopg adapters
    finally:
        engine.dispose()


SEVERAL = {
    "host": "10.0.0.1,10.0.0.2",
    "port": "5432,5433",
    "user": "app",
    "dbname": "jobs",
    "target_session_attrs": "read-write",
}


@pytest.mark.parametrize(
    "url",
    [
        # SQLAlchemy's documented form, as in the issue
        "postgresql+psycopg://app@/jobs?host=10.0.0.1:5432&host=10.0.0.2:5433&target_session_attrs=read-write",
        # SQLAlchemy's comma form
        "postgresql+psycopg://app@/jobs?host=10.0.0.1,10.0.0.2&port=5432,5433&target_session_attrs=read-write",
        # libpq's form, with and without a driver, and Heroku's scheme
        "postgresql://app@10.0.0.1:5432,10.0.0.2:5433/jobs?target_session_attrs=read-write",
        "postgresql+psycopg://app@10.0.0.1:5432,10.0.0.2:5433/jobs?target_session_attrs=read-write",
        "postgres://app@10.0.0.1:5432,10.0.0.2:5433/jobs?target_session_attrs=read-write",
    ],
)
def test_several_hosts_in_either_form(url: str) -> None:
    conninfo = conninfo_to_dict(libpq_conninfo(url))
    assert conninfo == SEVERAL
    # the engine and the psycopg connections agree, from the raw URL and from the normalised one
    assert engine_params(url) == SEVERAL
    assert conninfo_to_dict(libpq_conninfo(normalise_database_url(url))) == SEVERAL
    # and the report connection's conninfo carries the same hosts, with the library's connect options
    report = conninfo_to_dict(ReportConnection(url)._conninfo)
    assert {k: report[k] for k in SEVERAL} == SEVERAL
    assert report["connect_timeout"] == "10"


def test_several_hosts_some_without_a_port() -> None:
    """An empty entry of libpq's port list is the default port, as the engine's dialect passes it."""
    for url in ("postgresql://app@a,b:6000/jobs", "postgresql+psycopg://app@/jobs?host=a&host=b:6000"):
        expected = {"host": "a,b", "port": ",6000", "user": "app", "dbname": "jobs"}
        assert conninfo_to_dict(libpq_conninfo(url)) == expected
        assert engine_params(url) == expected
    info = conninfo_to_dict(libpq_conninfo("postgresql://app@a,b/jobs"))
    assert info["host"] == "a,b" and str(info.get("port") or "").strip(",") == ""


def test_several_hosts_ipv6() -> None:
    info = conninfo_to_dict(libpq_conninfo("postgresql://app@[::1]:5432,[fe80::2]:5433/jobs"))
    assert info["host"] == "::1,fe80::2" and info["port"] == "5432,5433"


@pytest.mark.parametrize("password", ["p@ss:w/rd?#%&= '\\", "plain", "üñí,çødé"])
def test_passwords_with_special_characters(password: str) -> None:
    from urllib.parse import quote

    encoded = quote(password, safe="")
    for url in (
        f"postgresql://app:{encoded}@a:5432,b:5433/jobs",
        f"postgresql+psycopg://app:{encoded}@/jobs?host=a:5432&host=b:5433",
        f"postgresql+psycopg://app:{encoded}@db.example:6543/jobs?sslmode=require",
    ):
        info = conninfo_to_dict(libpq_conninfo(url))
        assert info["password"] == password, url
        assert info["user"] == "app"
        # the normalised URL (what the engine gets) keeps it too
        assert sqlalchemy_url(normalise_database_url(url)).password == password


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        (
            "postgresql://root@127.0.0.1:5432/postgres",
            {"host": "127.0.0.1", "port": "5432", "user": "root", "dbname": "postgres"},
        ),
        (
            "postgresql+psycopg://u:pw@db/x?sslmode=require&application_name=a%20b",
            {
                "host": "db",
                "user": "u",
                "password": "pw",
                "dbname": "x",
                "sslmode": "require",
                "application_name": "a b",
            },
        ),
        ("postgresql+psycopg2://u@db:6000/x", {"host": "db", "port": "6000", "user": "u", "dbname": "x"}),
        ("postgres://u@db/x", {"host": "db", "user": "u", "dbname": "x"}),
        # a Unix-socket directory in libpq's URI form, as the embedded server's URLs are, and in the query
        (
            "postgresql://postgres@%2Ftmp%2Fpg%20sock:5499/fanin",
            {"host": "/tmp/pg sock", "port": "5499", "user": "postgres", "dbname": "fanin"},
        ),
        (
            "postgresql+psycopg://postgres@/fanin?host=/var/run/postgresql",
            {"host": "/var/run/postgresql", "user": "postgres", "dbname": "fanin"},
        ),
        # SQLAlchemy's one `host:port` in the query
        ("postgresql+psycopg://u@/x?host=db:6000", {"host": "db", "port": "6000", "user": "u", "dbname": "x"}),
    ],
)
def test_one_host_forms_unchanged(url: str, expected: dict[str, str]) -> None:
    assert conninfo_to_dict(libpq_conninfo(url)) == expected
    assert engine_params(url) == expected


def test_connect_options_yield_to_the_url_in_either_form() -> None:
    for url in (
        "postgresql://app@a:5432,b:5433/jobs?connect_timeout=3",
        "postgresql+psycopg://app@/jobs?host=a:5432&host=b:5433&connect_timeout=3",
    ):
        options = connect_options(url)
        assert "connect_timeout" not in options and options["keepalives"] == 1


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://app@a:5432,b:port/jobs",
        "postgresql://app@a:5432,b:5433/jobs?host=c",
        "postgresql+psycopg://app@/jobs?host=a:1&host=b:2&port=3,4",
    ],
)
def test_unreadable_several_host_urls_are_configuration_errors(url: str) -> None:
    with pytest.raises((ValueError, ArgumentError)):
        libpq_conninfo(url)
    with pytest.raises(FanInNotConfigured):
        normalise_database_url(url)


def test_the_dashboards_engine_reaches_every_host() -> None:
    """The dashboard's read-only engine (its own connect arguments over the URL) keeps the host list."""
    from celery import Celery

    from celery_fanin import FanIn
    from celery_fanin.web.app import read_only_engine

    app = Celery("fanin-urls", set_as_current=False)
    app.conf.fanin_database_url = (
        "postgresql://app@10.0.0.1:5432,10.0.0.2:5433/jobs?target_session_attrs=prefer-standby"
    )
    engine = read_only_engine(FanIn(app), pool_size=1, statement_timeout=5)
    try:
        _, params = engine.dialect.create_connect_args(engine.url)
        assert (params["host"], params["port"]) == ("10.0.0.1,10.0.0.2", "5432,5433")
        assert params["target_session_attrs"] == "prefer-standby"
    finally:
        engine.dispose()
        FanIn.of(app).dispose()
