"""The fan-in schema up to SQL migration 0029 (successor reruns)."""

from __future__ import annotations

from django.db import migrations

from celery_fanin.django import schema

FANIN_VERSION = 29


class Migration(migrations.Migration):
    dependencies = [("celery_fanin", "0002_tracebacks")]
    operations = [migrations.RunPython(schema.apply, schema.unapply, elidable=False)]
