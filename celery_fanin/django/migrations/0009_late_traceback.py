"""The fan-in schema up to SQL migration 0035 (a failed child's traceback kept after a late resend of its report)."""

from __future__ import annotations

from django.db import migrations

from celery_fanin.django import schema

FANIN_VERSION = 35


class Migration(migrations.Migration):
    dependencies = [("celery_fanin", "0008_successor_predicates")]
    operations = [migrations.RunPython(schema.apply, schema.unapply, elidable=False)]
