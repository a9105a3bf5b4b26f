"""The how-tos' example applications (docs/how-to/flask.md, docs/how-to/django.md); the test suite runs them."""
