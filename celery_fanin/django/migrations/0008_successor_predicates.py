"""The fan-in schema up to SQL migration 0034 (a successor's predicates said once, in inlinable functions)."""

from __future__ import annotations

from django.db import migrations

from celery_fanin.django import schema

FANIN_VERSION = 34


class Migration(migrations.Migration):
    dependencies = [("celery_fanin", "0007_notify_relay")]
    operations = [migrations.RunPython(schema.apply, schema.unapply, elidable=False)]
