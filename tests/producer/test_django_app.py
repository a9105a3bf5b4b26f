"""The Django app (`celery_fanin.django`): its last migration brings the schema to the last SQL migration shipped,
so `manage.py migrate` after an upgrade applies what `celery -A proj fanin migrate` would. Run end to end (a
pytest-django test database migrated by `migrate`) by tests/e2e/test_django_example.py."""

from __future__ import annotations

import importlib
from pathlib import Path

from celery_fanin.store.migrate import available

MIGRATIONS = Path(__file__).resolve().parents[2] / "celery_fanin" / "django" / "migrations"


def test_the_last_django_migration_reaches_the_last_sql_migration() -> None:
    names = sorted(p.stem for p in MIGRATIONS.glob("[0-9][0-9][0-9][0-9]_*.py"))
    assert names, "the Django app has no migration"
    last = importlib.import_module(f"celery_fanin.django.migrations.{names[-1]}")
    assert available()[-1].version == last.FANIN_VERSION, (
        f"SQL migration {available()[-1].version} is not applied by any Django migration: add one to "
        "celery_fanin/django/migrations (it runs `schema.apply`, which applies every pending SQL migration)"
    )
