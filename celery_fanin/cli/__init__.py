"""The `celery -A proj fanin ...` commands (the `celery.commands` entry point names `celery_fanin.cli:fanin`)."""

from .commands import fanin

__all__ = ["fanin"]
