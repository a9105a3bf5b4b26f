"""The fan-in schema up to SQL migration 0030 (operator actions)."""

from __future__ import annotations

from django.db import migrations

from celery_fanin.django import schema

FANIN_VERSION = 30


class Migration(migrations.Migration):
    dependencies = [("celery_fanin", "0003_successor_reruns")]
    operations = [migrations.RunPython(schema.apply, schema.unapply, elidable=False)]
