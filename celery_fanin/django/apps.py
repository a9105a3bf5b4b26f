"""The Django app's configuration: no models, only the migrations that apply the fan-in schema."""

from __future__ import annotations

from django.apps import AppConfig


class FanInConfig(AppConfig):
    name = "celery_fanin.django"
    label = "celery_fanin"
    verbose_name = "celery-fanin"
