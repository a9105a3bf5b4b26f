"""docs/how-to/django.md: a Django project whose orders create their fan-in in the order's own transaction."""

from .celery import app as celery_app

__all__ = ["celery_app"]
