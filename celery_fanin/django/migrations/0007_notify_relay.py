"""The fan-in schema up to SQL migration 0033 (the relay is woken from one function, `fanin_notify_relay`)."""

from __future__ import annotations

from django.db import migrations

from celery_fanin.django import schema

FANIN_VERSION = 33


class Migration(migrations.Migration):
    dependencies = [("celery_fanin", "0006_explicit_handoff")]
    operations = [migrations.RunPython(schema.apply, schema.unapply, elidable=False)]
