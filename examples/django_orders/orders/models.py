from __future__ import annotations

from django.db import models


class Order(models.Model):
    items = models.PositiveIntegerField()
    batch_id = models.CharField(max_length=36, null=True)

    class Meta:
        app_label = "orders"
