"""The project's Celery app, configured from Django's settings under the `CELERY_` namespace: celery-fanin's
settings too (`CELERY_FANIN_DJANGO_DATABASE` is `fanin_django_database`)."""

from __future__ import annotations

import os

from celery import Celery

from celery_fanin import FanIn

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "examples.django_orders.settings")

app = Celery("django_orders")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
FanIn(app)
