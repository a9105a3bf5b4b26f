"""The fan-in schema up to SQL migration 0032 (who publishes a successor a report creates is an argument)."""

from __future__ import annotations

from django.db import migrations

from celery_fanin.django import schema

FANIN_VERSION = 32


class Migration(migrations.Migration):
    dependencies = [("celery_fanin", "0005_replacement_parts")]
    operations = [migrations.RunPython(schema.apply, schema.unapply, elidable=False)]
