"""The one loader of named statements: `celery_fanin/store/sql/queries.sql` (and the dashboard's `dashboard.sql`).

A file holds statements in this form, each once (procrastinate's `queries.sql` format):

    -- name: batch_row
    -- One batch's row, as BatchRow is built from it.
    SELECT ... WHERE b.id = :id;

A `-- name:` line, a one-line description, then the statement up to the line that ends with `;`. Comment lines
before the first name are the file's own notes. Placeholders are SQLAlchemy's `:name`; `Query.psycopg` is the same
statement with psycopg's `%(name)s`, for the worker's reports (a plain psycopg connection) and for
`exec_driver_sql`, so both transports run one text.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from typing import Any, Protocol

from sqlalchemy import TextClause, text

_NAME = re.compile(r"^--\s*name:\s*([a-z_][a-z0-9_]*)\s*$")
# A `:name` placeholder, not the second colon of a `::type` cast nor a colon inside a word.
_PLACEHOLDER = re.compile(r"(?<![:\w]):([A-Za-z_]\w*)(?!:)")


@dataclass(frozen=True)
class Statement:
    name: str
    description: str
    sql: str

    # Built once, on first use (a cached_property writes the instance's __dict__, which frozen allows).
    @functools.cached_property
    def text(self) -> TextClause:
        """What SQLAlchemy executes."""
        return text(self.sql)

    @functools.cached_property
    def psycopg(self) -> str:
        """The same statement in psycopg's placeholders (`%` doubled)."""
        return _PLACEHOLDER.sub(r"%(\1)s", self.sql.replace("%", "%%"))

    @functools.cached_property
    def positional(self) -> tuple[str, tuple[str, ...]]:
        """The same in psycopg's positional `%s`, and the parameters' names in their order (repeats included): what
        a cursor kept open takes with a list of values, sparing psycopg a new cursor and the reordering of a
        mapping on every call (the worker's reports, `store.reports`)."""
        text = self.sql.replace("%", "%%")
        return _PLACEHOLDER.sub("%s", text), tuple(_PLACEHOLDER.findall(text))


class Runner(Protocol):
    """What runs the workers' runtime statements: `store.reports.ReportConnection`, the one transport a worker
    uses (psycopg connections taken per statement, in autocommit: each statement its own transaction). The
    store's functions for those statements (`reports.record_terminal`, `successors.claim_run`, ...) take one, so each
    statement's parameters, text and row are written once; a test or the protocol model passes a runner over a
    transaction it holds, and so runs the same functions the worker runs."""

    def one(self, statement: Statement, params: Mapping[str, object]) -> tuple[Any, ...]:
        """The statement's one row."""
        ...

    def all(self, statement: Statement, params: Mapping[str, object]) -> list[tuple[Any, ...]]:
        """The statement's rows."""
        ...


def parse(source_text: str, source: str = "<sql>") -> dict[str, Statement]:
    """The statements of one file by name; ValueError naming the file and line for anything out of form."""
    found: dict[str, Statement] = {}
    lines = source_text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i].strip()
        match = _NAME.match(line)
        if match is None:
            if line and not line.startswith("--"):
                raise ValueError(f"{source}:{i + 1}: SQL outside a named statement")
            i += 1
            continue
        name, start = match.group(1), i + 1
        if name in found:
            raise ValueError(f"{source}:{start}: statement {name!r} defined twice")
        if i + 1 >= len(lines) or not lines[i + 1].startswith("--") or _NAME.match(lines[i + 1].strip()):
            raise ValueError(f"{source}:{start}: statement {name!r} has no description line")
        description = lines[i + 1].lstrip("-").strip()
        body: list[str] = []
        i += 2
        while i < len(lines) and not _NAME.match(lines[i].strip()):
            body.append(lines[i])
            i += 1
            if body[-1].rstrip().endswith(";"):
                break
        else:
            raise ValueError(f"{source}:{start}: statement {name!r} does not end with ';'")
        sql = "\n".join(body).rstrip().removesuffix(";").strip()
        if not sql:
            raise ValueError(f"{source}:{start}: statement {name!r} is empty")
        found[name] = Statement(name, description, sql)
    return found


@functools.cache
def statements(file: str) -> dict[str, Statement]:
    """The statements of `celery_fanin/store/sql/<file>.sql`, read once."""
    path = resources.files("celery_fanin.store") / "sql" / f"{file}.sql"
    return parse(path.read_text(encoding="utf-8"), f"store/sql/{file}.sql")


def sql(file: str, name: str) -> str:
    """One statement's text; KeyError if the file has no statement of that name."""
    return statements(file)[name].sql


def q(name: str) -> Statement:
    """One statement of `queries.sql`, the statements the store runs; KeyError for an unknown name."""
    return statements("queries")[name]
