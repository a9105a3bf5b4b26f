"""Tell whether the database URL reaches PostgreSQL through a transaction- or statement-mode pooler.

celery-fanin needs each client connection to keep its server session between transactions: the producer holds a
session advisory lock on a batch while it publishes (how the relay tells a dead producer from a slow one), the
relay LISTENs for new outbox rows, and the workers' reports use prepared statements. A pooler in transaction mode
(PgBouncer's `pool_mode = transaction`, and most cloud poolers' default) hands each transaction to whichever
server connection is free, which silently breaks all three. Session mode, or a direct connection, is required.

No SQL statement asks a pooler its mode, so the probe watches what the pool does: two client connections each
note their server process (`pg_backend_pid()`) in a transaction, end them in one order, and start again in the
other order. Under session pooling each client keeps its server process; under transaction pooling at least one
of the two rounds gives a client the other's (whichever order the pooler hands free servers out in).
"""

from __future__ import annotations

import psycopg

from .reports import libpq_conninfo
from .statements import q


def _pid(conn: psycopg.Connection[tuple[int]]) -> int:
    row = conn.execute(q("backend_pid").psycopg).fetchone()
    assert row is not None
    return int(row[0])


def transaction_pooled(sqlalchemy_url: str, connect_timeout: float = 10.0) -> bool:
    """True if connections to `sqlalchemy_url` do not keep their server session between transactions."""
    conninfo = libpq_conninfo(sqlalchemy_url)
    timeout = max(1, int(connect_timeout))
    with (
        psycopg.connect(conninfo, connect_timeout=timeout, application_name="celery-fanin pooler probe") as a,
        psycopg.connect(conninfo, connect_timeout=timeout, application_name="celery-fanin pooler probe") as b,
    ):
        first_a, first_b = _pid(a), _pid(b)  # each in a transaction, so both hold a server connection
        for release_first, release_last in ((b, a), (a, b)):
            release_first.commit()
            release_last.commit()
            # Start again in the opposite order of release: a pooler that hands out the most recently freed
            # server (LIFO) or the longest idle one (FIFO) gives one of the clients the other's in one round.
            if _pid(b) != first_b or _pid(a) != first_a:
                return True
    return False
