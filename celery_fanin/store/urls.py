"""Database URLs: the one parser every connection goes through, SQLAlchemy's engines and the plain psycopg ones.

A URL may name several servers (a primary and its standbys), in either of two forms:

- SQLAlchemy's: `postgresql+psycopg://user@/db?host=a:5432&host=b:5432&target_session_attrs=read-write`
  (or `?host=a,b&port=5432,5432`);
- libpq's: `postgresql://user@a:5432,b:5432/db?target_session_attrs=read-write`.

SQLAlchemy's own parser rejects libpq's form (it reads `5432,b:5432` as a port), and libpq reads SQLAlchemy's
`host=a:5432` as a host named "a:5432". So both are brought to one SQLAlchemy URL (`sqlalchemy_url`), and the
psycopg connections take their parameters from that URL exactly as the engine's dialect does (`libpq_conninfo`,
through SQLAlchemy's psycopg dialect), so that an engine and a report connection can never read one URL two ways.
"""

from __future__ import annotations

import re
from urllib.parse import unquote

from psycopg.conninfo import make_conninfo
from sqlalchemy.dialects.postgresql.psycopg import PGDialect_psycopg
from sqlalchemy.engine import URL, make_url

# scheme://[userinfo@]hostlist[/rest]: the netloc of a libpq URI, whose host list may hold commas.
_URI = re.compile(
    r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]*)://(?:(?P<userinfo>[^@/?#]*)@)?(?P<hosts>[^/?#]*)(?P<rest>.*)$"
)
# One entry of a libpq host list: `host`, `host:port`, `[v6]`, `[v6]:port`, or `:port` (the default host).
_HOSTPORT = re.compile(r"^(?:\[(?P<v6>[^\]]*)\]|(?P<host>[^:]*))(?::(?P<port>\d*))?$")


# Without a DBAPI: its parameters are the URL's alone (an engine's dialect adds its psycopg adapters, `context`).
_DIALECT = PGDialect_psycopg()


def _libpq_multihost(url: str) -> URL | None:
    """A libpq several-host URI as a SQLAlchemy URL (`?host=a,b&port=p,q`), or None if `url` names one host at most.

    The comma form of the query, not `host=a:p`, so that an IPv6 address (`[::1]:5432`) keeps its colons."""
    match = _URI.match(url)
    if match is None or "," not in match["hosts"]:
        return None
    hosts: list[str] = []
    ports: list[str] = []
    for entry in match["hosts"].split(","):
        part = _HOSTPORT.match(entry)
        if part is None:
            raise ValueError(f"cannot read host {entry!r} of a several-host URL")
        hosts.append(unquote(part["v6"] if part["v6"] is not None else part["host"] or ""))
        ports.append(part["port"] or "")
    # Parse the URL with the host list taken out, then put it back in the query: userinfo and database are decoded
    # by SQLAlchemy as for any other URL.
    userinfo = f"{match['userinfo']}@" if match["userinfo"] is not None else ""
    parsed = make_url(f"{match['scheme']}://{userinfo}{match['rest']}")
    for key in ("host", "port"):
        if key in parsed.query:
            raise ValueError(f"a several-host URL names its hosts twice: in its netloc and as ?{key}=")
    query: dict[str, str | tuple[str, ...]] = {**parsed.query, "host": ",".join(hosts)}
    if any(ports):
        query["port"] = ",".join(ports)
    return parsed.set(query=query)


def sqlalchemy_url(url: str) -> URL:
    """`url` (any of the forms above, `postgres://` too) as the SQLAlchemy URL of the psycopg 3 driver.

    Raises ValueError or sqlalchemy's ArgumentError for a URL it cannot read; does not check the backend."""
    if url.startswith("postgres://"):
        url = "postgresql://" + url[len("postgres://") :]
    parsed = _libpq_multihost(url)
    if parsed is None:
        parsed = make_url(url)
        parsed.port  # noqa: B018  (parsed on access: a bad port is an error here, not at the first connection)
    if parsed.drivername in ("postgresql", "postgresql+psycopg2"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    if parsed.host and parsed.host[:3].lower() == "%2f":
        # libpq's URI form of a Unix-socket directory (`postgresql://user@%2Fvar%2Frun/db`, as the embedded server's
        # URLs are): SQLAlchemy hands the host to the driver undecoded, so it goes in the query, where it is decoded.
        query = {**parsed.query, "host": unquote(parsed.host)}
        parsed = URL.create(
            parsed.drivername, parsed.username, parsed.password, None, parsed.port, parsed.database, query
        )
    if parsed.get_backend_name() == "postgresql":
        _DIALECT.create_connect_args(parsed)  # a host list it cannot read (hosts and ports that do not pair) fails now
    return parsed


def libpq_conninfo(url: str) -> str:
    """The libpq connection string for `url`: the parameters SQLAlchemy's psycopg dialect gives the driver for the
    same URL (several hosts become `host=a,b port=p,q`), so a psycopg connection reaches the servers the engine does.
    """
    parsed = sqlalchemy_url(url)
    _, params = _DIALECT.create_connect_args(parsed)
    return make_conninfo("", **params)
