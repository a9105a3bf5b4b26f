"""A login role of a test's own on the session database, with the session settings the test gives it (`ALTER ROLE
... SET`): a worker that logs in as it meets `lock_timeout`, `statement_timeout` or a read-only session as a
deployment configured so would. Roles are cluster-wide: each gets a unique name and is dropped afterwards, and no
setting of a role or database the test did not create is ever changed.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import psycopg
from psycopg import sql
from sqlalchemy.engine import make_url

from tests.conftest import ADMIN_URL


@dataclass(frozen=True)
class SessionRole:
    name: str
    database_url: str  # the session database, as the admin
    url: str  # the same database, as this role

    def admin(self) -> psycopg.Connection:
        return psycopg.connect(self.database_url, autocommit=True)

    def set(self, setting: str, value: str | None) -> None:
        """`ALTER ROLE ... SET setting = value` (RESET for None): new sessions of the role get it."""
        with self.admin() as conn:
            if value is None:
                conn.execute(sql.SQL("ALTER ROLE {} RESET {}").format(sql.Identifier(self.name), sql.SQL(setting)))
            else:
                conn.execute(
                    sql.SQL("ALTER ROLE {} SET {} = {}").format(
                        sql.Identifier(self.name), sql.SQL(setting), sql.Literal(value)
                    )
                )

    def terminate_sessions(self) -> int:
        """End every session of this role (as a failover does); how many there were."""
        with self.admin() as conn:
            row = conn.execute(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE usename = %s", (self.name,)
            ).fetchone()
        return int(row[0]) if row else 0


@contextlib.contextmanager
def session_role(database_url: str, settings: dict[str, str]) -> Iterator[SessionRole]:
    """A role that may do what a worker does on `database_url` (read the fan-in tables, call every function), with
    `settings` for its sessions."""
    name = f"fanin_dberr_{uuid.uuid4().hex[:10]}"
    db_url = make_url(database_url)
    role_url = db_url.set(username=name, password=None).render_as_string(hide_password=False)
    role = SessionRole(name, database_url.replace("postgresql+psycopg://", "postgresql://"), role_url)
    ident = sql.Identifier(name)
    with role.admin() as conn:
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(ident))
    try:
        with role.admin() as conn:
            conn.execute(sql.SQL("GRANT SELECT ON ALL TABLES IN SCHEMA public TO {}").format(ident))
            conn.execute(sql.SQL("GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA public TO {}").format(ident))
        for setting, value in settings.items():
            role.set(setting, value)
        yield role
    finally:
        role.terminate_sessions()
        with role.admin() as conn:
            conn.execute(sql.SQL("DROP OWNED BY {}").format(ident))  # its grants on this database
        with psycopg.connect(ADMIN_URL, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(ident))
