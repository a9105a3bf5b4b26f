"""celery-fanin as a Django app: ``INSTALLED_APPS += ["celery_fanin.django"]`` and ``manage.py migrate`` creates
and upgrades the fan-in schema on Django's database, as it does Django's own tables (pytest-django's test
database included). See docs/how-to/django.md."""
