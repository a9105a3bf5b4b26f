"""The fan-in schema up to SQL migration 0027 (celery_fanin/store/migrations)."""

from __future__ import annotations

from django.db import migrations

from celery_fanin.django import schema

FANIN_VERSION = 27


class Migration(migrations.Migration):
    initial = True
    dependencies: list[tuple[str, str]] = []
    operations = [migrations.RunPython(schema.apply, schema.unapply, elidable=False)]
