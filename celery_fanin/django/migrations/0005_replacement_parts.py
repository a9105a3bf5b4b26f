"""The fan-in schema up to SQL migration 0031 (a replaced successor ends with a failed part of its replacement)."""

from __future__ import annotations

from django.db import migrations

from celery_fanin.django import schema

FANIN_VERSION = 31


class Migration(migrations.Migration):
    dependencies = [("celery_fanin", "0004_operator_actions")]
    operations = [migrations.RunPython(schema.apply, schema.unapply, elidable=False)]
