"""The state enums of `celery_fanin.protocol` against the database: each one's values are exactly what the table's
CHECK constraint allows, as a migrated database's catalog holds it, and a state outside them is refused."""

from __future__ import annotations

import re

import psycopg
import pytest
from sqlalchemy import Engine, text
from sqlalchemy.exc import IntegrityError

from celery_fanin.protocol import (
    BatchState,
    ChildState,
    CompensationState,
    SagaState,
    SagaStepState,
    State,
    SuccessorState,
)

from .helpers import create

STATE_COLUMNS: dict[str, type[State]] = {
    "fanin_children": ChildState,
    "fanin_batches": BatchState,
    "fanin_successors": SuccessorState,
    "fanin_sagas": SagaState,
    "fanin_saga_steps": SagaStepState,
    "fanin_saga_compensations": CompensationState,
}


def allowed_states(engine: Engine, table: str) -> set[str]:
    """The values the CHECK constraints on `table` allow its `state` column, read from pg_constraint."""
    with engine.connect() as conn:
        definitions = conn.execute(
            text(
                """
                SELECT pg_get_constraintdef(c.oid)
                  FROM pg_constraint c
                  JOIN pg_attribute a ON a.attrelid = c.conrelid AND a.attnum = ANY (c.conkey)
                 WHERE c.contype = 'c' AND c.conrelid = CAST(:t AS regclass) AND a.attname = 'state'
                """
            ),
            {"t": table},
        ).scalars()
        found = [set(re.findall(r"'((?:[^']|'')*)'::text", d)) for d in definitions]
    assert len(found) == 1, f"{table}.state: expected one CHECK constraint, found {len(found)}"
    return found[0]


@pytest.mark.parametrize("table", sorted(STATE_COLUMNS))
def test_each_enum_is_what_the_check_constraint_allows(store_engine: Engine, table: str) -> None:
    assert allowed_states(store_engine, table) == {s.value for s in STATE_COLUMNS[table]}


def test_a_state_outside_the_enum_is_refused(store_engine: Engine) -> None:
    batch, _, _ = create(store_engine, 1)
    statements = [
        ("UPDATE fanin_batches SET state = 'finished' WHERE id = :b", {"b": batch.id}),
        ("UPDATE fanin_children SET state = 'done' WHERE batch_id = :b", {"b": batch.id}),
    ]
    for sql, params in statements:
        with pytest.raises(IntegrityError) as raised, store_engine.begin() as conn:
            conn.execute(text(sql), params)
        assert isinstance(raised.value.orig, psycopg.errors.CheckViolation)
    with store_engine.begin() as conn:  # and a state the enum has is accepted
        conn.execute(
            text("UPDATE fanin_batches SET state = :s WHERE id = :b"), {"s": BatchState.CANCELLED, "b": batch.id}
        )
        assert (
            conn.execute(text("SELECT state FROM fanin_batches WHERE id = :b"), {"b": batch.id}).scalar() == "cancelled"
        )


def test_a_state_compares_and_formats_as_its_text() -> None:
    assert ChildState.SUCCEEDED == "succeeded" and "succeeded" in {ChildState.SUCCEEDED}
    assert f"{BatchState.FAILED_THRESHOLD}" == str(BatchState.FAILED_THRESHOLD) == "failed_threshold"
    assert SagaState("compensated") is SagaState.COMPENSATED
