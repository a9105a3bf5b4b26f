"""What each of the app's Django migrations runs: the fan-in migrations not applied yet, in Django's transaction.

A Django migration cannot be told apart from the SQL it applies, so each celery-fanin release whose schema moves
adds one Django migration (`FANIN_VERSION`: the SQL version it brings the schema to) that applies whatever is
pending; tests/producer/test_django_app.py checks that the last one reaches the last SQL migration shipped. Applying
"everything pending" rather than a fixed list keeps a database migrated by `celery -A proj fanin migrate` and one
migrated by Django interchangeable: both record their versions in `fanin_migrations`.
"""

from __future__ import annotations

from typing import Any

from ..store import migrate


def apply(apps: Any, schema_editor: Any) -> None:
    """`RunPython`'s forward step, on the connection Django migrates (its `--database`)."""
    with schema_editor.connection.cursor() as cursor:
        migrate.apply_pending(cursor)


def unapply(apps: Any, schema_editor: Any) -> None:
    """Migrating the app back leaves the fan-in tables: they hold batches in flight, and dropping them is a
    decision for `DROP TABLE`, not a side effect of `migrate celery_fanin zero`."""
