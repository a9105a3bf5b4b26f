"""pytest-django against the database the outer test gives (FANIN_DATABASE_URL): no test database of its own,
since the fan-in schema is migrated there already; Django's own tables are migrated here."""

from __future__ import annotations

from typing import Any

import pytest
from django.core.management import call_command


@pytest.fixture(scope="session")
def django_db_setup(django_db_blocker: Any) -> None:
    with django_db_blocker.unblock():
        call_command("migrate", run_syncdb=True, verbosity=0)
