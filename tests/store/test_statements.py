"""`store/sql/queries.sql`: every statement the store runs is named there, read by the one loader for both
transports, and every named statement is run by the library (or, for one, by a test that checks a relay's view)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from celery_fanin.protocol import OUTBOX_CHANNEL
from celery_fanin.store import statements

PACKAGE = Path(statements.__file__).resolve().parent.parent
# A name the code asks the loader for, by a call of `q` with a literal (the store's modules and the tests).
_ASKED = re.compile(r"""\bq\(\s*["']([a-z_0-9]+)["']\s*\)""")
# The store's statements chosen by name at runtime (sagas._children is given one of these).
_BY_VARIABLE = {"first_child", "succeeded_children_marked", "get_saga", "get_saga_locked"}
# Modules that hold SQL of their own, not the store's runtime statements: the migrator's bookkeeping (it runs before
# any schema), the loader (it holds none), and the tools that create a database for a developer (`embedded`) or a
# test session (`testing`), before any fan-in schema exists.
_OWN_SQL = {"store/migrate.py", "store/statements.py", "embedded.py", "testing.py"}


def test_every_statement_is_named_described_and_used_and_every_name_exists() -> None:
    found = statements.statements("queries")
    asked: set[str] = set()
    for path in [*PACKAGE.rglob("*.py"), *(PACKAGE.parent / "tests").rglob("*.py")]:
        asked |= set(_ASKED.findall(path.read_text(encoding="utf-8")))
    assert asked - set(found) == set(), "the code asks for statements queries.sql does not have"
    assert set(found) - asked - _BY_VARIABLE == set(), "queries.sql has statements nothing runs"
    for name, st in found.items():
        assert st.description and not st.description.startswith(("name:", "store/")), name
    for path in PACKAGE.rglob("*.py"):
        if path.relative_to(PACKAGE).as_posix() in _OWN_SQL:
            continue
        source = path.read_text(encoding="utf-8")
        where = path.relative_to(PACKAGE).as_posix()
        assert not re.search(r"\btext\(\s*f?[\"']", source), f"{where} runs SQL that is not in queries.sql"
        assert not re.search(r"\.execute\(\s*f?[\"']", source), f"{where} runs SQL that is not in queries.sql"
        assert 'exec_driver_sql("' not in source, where


def test_the_relay_listens_on_the_channel_the_schema_notifies_from_one_place() -> None:
    """Every NOTIFY goes through `fanin_notify_relay` (migration 0033), on the channel the relay listens on."""
    listen = statements.q("listen_outbox").sql
    assert listen.split() == ["LISTEN", OUTBOX_CHANNEL]
    sql = PACKAGE / "store" / "sql"
    schema, queries = (
        (sql / "schema.sql").read_text(encoding="utf-8"),
        (sql / "queries.sql").read_text(encoding="utf-8"),
    )
    assert re.findall(r"pg_notify\(\s*'(\w+)'", schema) == [OUTBOX_CHANNEL] and "pg_notify" not in queries
    notify = schema[schema.index("CREATE FUNCTION fanin_notify_relay(") :]
    assert notify.index(f"pg_notify('{OUTBOX_CHANNEL}'") < notify.index("$$;"), "the one NOTIFY is not in the function"
    assert "fanin_notify_relay(" in statements.q("wake_relay_for_batch").sql


def test_one_text_serves_sqlalchemy_and_psycopg() -> None:
    parsed = statements.parse(
        "-- notes\n\n-- name: one\n-- The first.\nSELECT x::text, CAST(:id AS uuid), '50%' LIKE y\n"
        "  FROM t WHERE a = :a_b;\n"
    )["one"]
    assert parsed.psycopg == "SELECT x::text, CAST(%(id)s AS uuid), '50%%' LIKE y\n  FROM t WHERE a = %(a_b)s"
    assert set(parsed.text.compile().params) == {"id", "a_b"}
    report = statements.q("report_terminal").psycopg
    assert "%(task_id)s" in report and ":task_id" not in report, "the worker's report runs on plain psycopg"


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("SELECT 1;", "outside a named statement"),
        ("-- name: a\nSELECT 1;", "no description"),
        ("-- name: a\n-- d\nSELECT 1", "does not end"),
        ("-- name: a\n-- d\nSELECT 1;\n-- name: a\n-- d\nSELECT 2;", "defined twice"),
    ],
)
def test_a_file_out_of_form_is_refused_with_its_line(text: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        statements.parse(text, "x.sql")
