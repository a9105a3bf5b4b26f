"""The fan-in schema up to SQL migration 0028 (tracebacks)."""

from __future__ import annotations

from django.db import migrations

from celery_fanin.django import schema

FANIN_VERSION = 28


class Migration(migrations.Migration):
    dependencies = [("celery_fanin", "0001_fanin_schema")]
    operations = [migrations.RunPython(schema.apply, schema.unapply, elidable=False)]
