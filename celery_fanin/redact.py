"""Database passwords kept out of what celery-fanin prints: logs, CLI output and error messages.

A password can surface in text the library did not write: psycopg echoes a malformed connection string's pieces
("invalid percent-encoded token: ..."), SQLAlchemy and libpq errors quote URLs and `key=value` strings. So text
on its way out is redacted three ways: a URL's `user:password@` part, a conninfo's `password=...`, and every
password of a database URL this process was configured with (`remember`), wherever it appears.
"""

from __future__ import annotations

import logging
import re
import threading
from urllib.parse import quote, unquote

MASK = "***"

_URL = re.compile(r"(?P<head>\b[A-Za-z][A-Za-z0-9+.-]*://[^:/?#@\s'\"]*:)[^@\s'\"]*(?=@)")
_KEYWORD = re.compile(r"(?P<head>\bpassword\s*=\s*)(?:'(?:[^'\\]|\\.)*'?|[^\s'\"]+)", re.IGNORECASE)
_URL_PASSWORD = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://[^:/?#@\s]*:(?P<pw>[^@\s]*)@")

_known: set[str] = set()
_lock = threading.Lock()


def remember(url: str | None) -> None:
    """Redact the password of `url` (as written, and percent-decoded and -encoded) from now on."""
    if not url:
        return
    found = _URL_PASSWORD.match(url)
    if found is None or not found["pw"]:
        return
    raw = found["pw"]
    with _lock:
        _known.update(p for p in (raw, unquote(raw), quote(unquote(raw), safe="")) if p)


def redact(text: str) -> str:
    """`text` without any password it carries (see the module)."""
    text = _URL.sub(lambda m: m["head"] + MASK, text)
    text = _KEYWORD.sub(lambda m: m["head"] + MASK, text)
    for secret in sorted(_known, key=len, reverse=True):
        text = text.replace(secret, MASK)
    return text


class RedactingFilter(logging.Filter):
    """Redacts a record's message and its traceback before any handler formats them."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        clean = redact(message)
        if clean != message:
            record.msg, record.args = clean, None
        if record.exc_info and not record.exc_text:
            record.exc_text = redact(logging.Formatter().formatException(record.exc_info))
        elif record.exc_text:
            record.exc_text = redact(record.exc_text)
        return True


_FILTER = RedactingFilter()


def guard_loggers(prefix: str = "celery_fanin") -> None:
    """Put the filter on every logger named `prefix` or under it (a logger's filters do not apply to its
    children's records, so each gets it); idempotent."""
    names = [n for n in logging.root.manager.loggerDict if n == prefix or n.startswith(prefix + ".")]
    for name in [prefix, *names]:
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)
