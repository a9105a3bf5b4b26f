"""A batch written in the caller's own database transaction: `apply_async(transaction=...)`.

With a SQLAlchemy `Session` (Flask-SQLAlchemy's `db.session`), a SQLAlchemy `Connection`, or a Django connection
inside `transaction.atomic()`, the batch and its children are written on the caller's connection, under a
savepoint, so they commit or roll back with the caller's own rows. Nothing is published before the commit: the
children's rows are unpublished until then, and a `NOTIFY` sent in the same transaction wakes the relay when it
commits. After the commit the producer publishes them itself where the caller's library says when that is (a
Session's `after_commit`, Django's `on_commit`); where it cannot (a bare Connection), or if the process dies in
between, the relay does, under the batch's publish lock, so they go out once.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, create_engine, event
from sqlalchemy.engine.url import make_url
from sqlalchemy.orm import Session
from sqlalchemy.pool import StaticPool

from ..context import FanIn
from ..dispatch.children import publish_remaining_children
from ..dispatch.successors import publish_outbox
from ..exceptions import InvalidFanIn
from ..store import batches
from ..store.statements import q

logger = logging.getLogger("celery_fanin.producer")


@dataclass
class CallerTransaction:
    """The caller's transaction as a SQLAlchemy connection, and how to run something once it commits."""

    conn: Connection
    # Runs the callable after the caller's commit (never after a rollback); None: nothing tells us, the relay
    # publishes (woken by the NOTIFY that commits with the batch).
    after_commit: Callable[[Callable[[], None]], None] | None


def adopt(fanin: FanIn, transaction: Any) -> CallerTransaction | None:
    """The caller's transaction, or None where there is none to join (a Django connection outside `atomic()`
    commits each statement: the batch is then written as without `transaction=`)."""
    if type(transaction).__module__.startswith("django."):  # a connection, or django.db.connection (a proxy)
        adopted = _django(transaction)
        if adopted is None:
            return None
    elif isinstance(transaction, Session) or hasattr(transaction, "registry"):  # a Session, or a scoped_session
        session = transaction() if not isinstance(transaction, Session) else transaction
        if not isinstance(session, Session):
            raise InvalidFanIn(
                f"transaction= must be a SQLAlchemy Session or Connection, or a Django connection, "
                f"not {type(transaction).__name__}"
            )
        adopted = CallerTransaction(session.connection(), lambda fn: _after_session_commit(session, fn))
    elif isinstance(transaction, Connection):
        adopted = CallerTransaction(transaction, None)
    else:
        raise InvalidFanIn(
            "transaction= must be a SQLAlchemy Session or Connection, or a Django connection, "
            f"not {type(transaction).__name__}"
        )
    _check_same_database(fanin, adopted.conn)
    return adopted


def _after_session_commit(session: Session, fn: Callable[[], None]) -> None:
    """`fn` after the session's next commit; forgotten if it rolls back first."""

    def committed(_: Session) -> None:
        event.remove(session, "after_soft_rollback", rolled_back)
        fn()

    def rolled_back(_: Session, previous: Any) -> None:
        if previous.parent is None:  # the outermost transaction (a savepoint's rollback leaves ours standing)
            event.remove(session, "after_commit", committed)
            event.remove(session, "after_soft_rollback", rolled_back)

    event.listen(session, "after_commit", committed, once=True)
    event.listen(session, "after_soft_rollback", rolled_back)


def _django(connection: Any) -> CallerTransaction | None:
    """A Django connection in `atomic()`: its DB-API connection, under a SQLAlchemy connection that never
    commits, rolls back or closes it (the transaction is Django's)."""
    if getattr(connection, "vendor", None) != "postgresql":
        raise InvalidFanIn(f"transaction=: a {getattr(connection, 'vendor', '?')} Django connection; PostgreSQL only")
    if not connection.in_atomic_block:
        return None
    from django.db import transaction as django_transaction

    connection.ensure_connection()
    raw = connection.connection
    driver = (
        "psycopg" if type(raw).__module__.startswith("psycopg.") or type(raw).__module__ == "psycopg" else "psycopg2"
    )
    engine = create_engine(
        f"postgresql+{driver}://", creator=lambda: raw, poolclass=StaticPool, pool_reset_on_return=None
    )
    # The transaction and the connection are Django's: SQLAlchemy must never commit, roll back or close them.
    for name in ("do_commit", "do_rollback", "do_close", "do_terminate"):
        setattr(engine.dialect, name, _leave_alone)
    alias = connection.alias
    return CallerTransaction(engine.connect(), lambda fn: django_transaction.on_commit(fn, using=alias))


def _leave_alone(dbapi_connection: Any) -> None:
    """What SQLAlchemy's commit, rollback and close do to a connection it borrowed from Django: nothing."""


def _check_same_database(fanin: FanIn, conn: Connection) -> None:
    """The caller's transaction must be on the fan-in database: workers report to `fanin_database_url`."""
    expected = make_url(fanin.database_url).database
    row = conn.execute(q("caller_database").text).one()
    if expected and row[0] != expected:
        raise InvalidFanIn(
            f"transaction= is on database {row[0]!r}, but fanin_database_url names {expected!r}: the batch must be "
            "written where the workers report"
        )
    if not row[1]:
        raise InvalidFanIn(f"transaction=: database {row[0]!r} has no celery-fanin schema (run `celery fanin migrate`)")


def wake_relay(conn: Connection, batch_id: uuid.UUID) -> None:
    """Sent in the caller's transaction, so delivered when it commits: the relay publishes what we do not."""
    conn.execute(q("wake_relay_for_batch").text, {"payload": f"batch:{batch_id}"})


def publish_committed(fanin: FanIn, batch_id: uuid.UUID, successor_outbox_id: int | None) -> None:
    """After the caller's commit: publish the batch's children (and an empty batch's successor) unless the relay
    is doing it (it holds the publish lock) or did (the published mark). Failures are left to the relay."""
    try:
        with fanin.engine.connect() as conn:
            if batches.try_publish_lock(conn, batch_id):
                conn.commit()
                try:
                    publish_remaining_children(fanin, conn, batch_id)
                finally:
                    conn.rollback()
                    batches.release_publish_lock(conn, batch_id)
                    conn.commit()
        if successor_outbox_id is not None:
            publish_outbox(fanin, ids=[successor_outbox_id])
    except Exception:
        logger.warning(
            "could not publish batch_id=%s after its transaction committed; the relay will",
            batch_id,
            exc_info=True,
            extra={"batch_id": str(batch_id)},
        )
