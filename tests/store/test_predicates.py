"""The successor predicates of migration 0034 (`fanin_successor_final`, `_handed_over`, `_lapsed`, `_stalled` in
store/sql/schema.sql): each says once what the functions and the relay's queries restated before, means what the
restated expressions meant, and is inlined by the planner (so it costs nothing over the expression written out)."""

from __future__ import annotations

import itertools
import re

import psycopg
import pytest

from celery_fanin.protocol import SUCCESSOR_FINAL, SuccessorState
from celery_fanin.store.statements import q
from tests.sql import SUCCESSOR_PREDICATES as PREDICATES


@pytest.mark.timeout(60)
def test_the_predicates_mean_what_the_expressions_they_replace_meant(clean_db: str) -> None:
    """Every successor state, with and without a carrier, a lease lapsed or not, no lease, and a negative bound (read
    as 0): each predicate against the expression the functions and queries of version 33 wrote out."""
    states = [s.value for s in SuccessorState]
    carriers = [None, "carrier-token"]
    # seconds from now: the lease's end (None: no lease) and the last move
    leases = [None, -100.0, -20.0, 100.0]
    moves = [-100.0, -20.0, -1.0]
    bounds = [(10.0, 50.0), (50.0, 10.0), (-5.0, 0.0)]
    rows = list(itertools.product(states, carriers, leases, moves, bounds))
    with psycopg.connect(clean_db, autocommit=True) as conn:
        for state, carrier, lease, moved, (timeout, grace) in rows:
            got = conn.execute(
                """
                WITH r AS (SELECT %(state)s::text AS state, %(carrier)s::text AS carrier,
                                  now() + make_interval(secs => %(lease)s) AS lease_until,
                                  now() + make_interval(secs => %(moved)s) AS state_at)
                SELECT fanin_successor_final(state), fanin_successor_handed_over(state),
                       fanin_successor_lapsed(lease_until, state_at, %(grace)s),
                       fanin_successor_stalled(state, carrier, lease_until, state_at, %(timeout)s, %(grace)s),
                       state IN ('succeeded', 'failed', 'revoked', 'ignored'),
                       state IN ('sent', 'retrying', 'requeued', 'replaced'),
                       coalesce(lease_until, state_at) < now() - make_interval(secs => greatest(%(grace)s, 0)),
                       carrier IS NULL
                       AND ((state IN ('sent', 'retrying', 'requeued', 'replaced')
                             AND coalesce(lease_until, state_at)
                                 < now() - make_interval(secs => greatest(%(timeout)s, 0)))
                            OR (state = 'running'
                                AND coalesce(lease_until, state_at)
                                    < now() - make_interval(secs => greatest(%(grace)s, 0))))
                  FROM r
                """,
                dict(state=state, carrier=carrier, lease=lease, moved=moved, timeout=timeout, grace=grace),
            ).fetchone()
            assert got is not None
            assert got[:4] == got[4:], (state, carrier, lease, moved, timeout, grace)
            assert got[0] == (state in SUCCESSOR_FINAL), state


@pytest.mark.timeout(60)
def test_the_relay_s_queries_run_the_predicates_inlined(clean_db: str) -> None:
    """A predicate the planner could not inline would be a function call per row of the relay's scans. Inlining
    needs a plain SQL function: no definer rights, no pinned search path. The plans of the queries that use them
    show the expressions, not a call."""
    params = {"timeout": 60.0, "grace": 30.0, "n": 100, "age": 3600.0}
    with psycopg.connect(clean_db, autocommit=True) as conn:
        for name in ("stalled", "lost_replacements", "prunable_totals", "lock_prunable"):
            statement = q(name)
            plan = "\n".join(
                r[0] for r in conn.execute("EXPLAIN (VERBOSE, COSTS OFF) " + statement.psycopg, params).fetchall()
            )
            assert re.search(r"fanin_successor_\w+\(", plan) is None, f"{name} calls a predicate:\n{plan}"
            assert "fanin_successor_" in statement.sql, f"{name} does not use the predicates any more"
        props = conn.execute(
            "SELECT p.proname, l.lanname, p.prosecdef, p.proconfig, p.provolatile, p.prosqlbody IS NOT NULL,"
            " has_function_privilege('public', p.oid, 'EXECUTE')"
            " FROM pg_proc p JOIN pg_language l ON l.oid = p.prolang WHERE p.proname = ANY(%s) ORDER BY 1",
            (list(PREDICATES),),
        ).fetchall()
    assert sorted(PREDICATES) == [p[0] for p in props]
    for name, language, definer, config, volatility, bound, public in props:
        assert (language, definer, config) == ("sql", False, None), f"{name} could not be inlined"
        assert volatility in ("i", "s") and bound and public, name
