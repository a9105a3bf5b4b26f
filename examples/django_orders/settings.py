"""Settings of the example project: one PostgreSQL database for Django's tables and celery-fanin's."""

from __future__ import annotations

import os
from urllib.parse import urlsplit

DATABASE_URL = os.environ.get("FANIN_DATABASE_URL", "postgresql://root@127.0.0.1/test")
_db = urlsplit(DATABASE_URL)

SECRET_KEY = "example-only"
USE_TZ = True
INSTALLED_APPS = ["examples.django_orders.orders"]
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
CELERY_FANIN_DATABASE_URL = DATABASE_URL.replace("postgresql://", "postgresql+psycopg://", 1)  # the same database
