"""Settings of the example project: one PostgreSQL database for Django's tables and celery-fanin's, both created by
`manage.py migrate`."""

from __future__ import annotations

import os
from urllib.parse import urlsplit

DATABASE_URL = os.environ.get("FANIN_DATABASE_URL", "postgresql://root@127.0.0.1/test")
_db = urlsplit(DATABASE_URL)

SECRET_KEY = "example-only"
USE_TZ = True
# `migrate` creates the fan-in schema; django-celery-beat stores scheduled fan-ins (`fan_in_schedule`) as rows.
INSTALLED_APPS = ["celery_fanin.django", "django_celery_beat", "examples.django_orders.orders"]
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": _db.path.lstrip("/"),
        "USER": _db.username or "",
        "PASSWORD": _db.password or "",
        "HOST": _db.hostname or "",
        "PORT": str(_db.port or ""),
    }
}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# Celery, and celery-fanin through Celery's configuration: every CELERY_* setting is the app's setting.
CELERY_BROKER_URL = os.environ.get("FANIN_BROKER_URL", "redis://127.0.0.1:6379/0")
CELERY_TASK_DEFAULT_QUEUE = os.environ.get("FANIN_EXAMPLE_QUEUE", "celery")
# celery-fanin on Django's default database, as Django connects to it now (pytest-django's test database in tests).
CELERY_FANIN_DJANGO_DATABASE = "default"
