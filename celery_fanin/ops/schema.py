"""`celery -A proj fanin migrate --check / --sql`: what a deploy pipeline asks of the schema before it deploys.

Both only read the database. `pending` lists the migrations this installation of celery-fanin would apply;
`script` renders them as the one transaction `migrate` runs (the same advisory lock, the bookkeeping table, each
migration followed by its bookkeeping row), so a DBA can review it, or apply it with `psql -1 -f` instead.
"""

from __future__ import annotations

from sqlalchemy.exc import SQLAlchemyError

from ..context import FanIn
from ..exceptions import FanInDatabaseError, summarise
from ..store import migrate
from ..store.migrate import Migration


def pending(fanin: FanIn) -> list[Migration]:
    """The migrations `migrate` would apply to this app's database now, oldest first."""
    try:
        return migrate.pending(fanin.engine)
    except SQLAlchemyError as exc:
        raise FanInDatabaseError(f"could not read the fan-in schema's version: {summarise(exc)}") from exc


def name(m: Migration) -> str:
    return f"{m.version:04d}_{m.name}"


def script(todo: list[Migration]) -> str:
    """`todo` as a psql script of one transaction, as `migrate` would run it (an empty one when nothing is due).

    Names and versions come from the package's own file names (`NNNN_[a-z0-9_]+.sql`), so they are written into
    the bookkeeping rows as literals safely."""
    lines = [f"-- celery-fanin: {len(todo)} pending migration(s){': ' if todo else ''}{', '.join(map(name, todo))}"]
    if not todo:
        return lines[0] + "\n"
    lines += [
        "BEGIN;",
        f"SELECT pg_advisory_xact_lock({migrate._MIGRATION_LOCK});  -- as `fanin migrate` takes it",
        "CREATE TABLE IF NOT EXISTS fanin_migrations (version integer PRIMARY KEY, name text NOT NULL,"
        " applied_at timestamptz NOT NULL DEFAULT now());",
    ]
    for m in todo:
        lines += [
            "",
            f"-- {name(m)}",
            m.sql.strip(),
            f"INSERT INTO fanin_migrations (version, name) VALUES ({m.version}, '{m.name}');",
        ]
    lines += ["", "COMMIT;"]
    return "\n".join(lines) + "\n"
