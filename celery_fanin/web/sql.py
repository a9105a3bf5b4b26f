"""Named statements from `celery_fanin/store/sql/*.sql`.

A file holds statements in this form, each once:

    -- name: batches_page
    -- Root batches newest first, ...
    SELECT ... ;

A `-- name:` line, a one-line description, then the statement up to the line that ends with `;`. Comment lines
before the first name are the file's own notes. Only the dashboard reads its file through this loader for now;
the store's own loader (branch `store`) reads the same format and can take its place.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from importlib import resources

_NAME = re.compile(r"^--\s*name:\s*([a-z_][a-z0-9_]*)\s*$")


@dataclass(frozen=True)
class Statement:
    name: str
    description: str
    sql: str


def parse(text: str, source: str = "<sql>") -> dict[str, Statement]:
    """The statements of one file by name; ValueError naming the file and line for anything out of form."""
    found: dict[str, Statement] = {}
    lines = text.splitlines()
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
