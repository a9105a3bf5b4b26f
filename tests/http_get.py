"""A GET of a local test server (the dashboard, the relay's probes and metrics), as the tests read one."""

from __future__ import annotations

import urllib.error
import urllib.request


def get(
    url: str, headers: dict[str, str] | None = None, timeout: float = 20, unanswered: tuple[int, str] | None = None
) -> tuple[int, str] | None:
    """(status, body) of a GET, an error status included; `unanswered` while nothing answers (not listening yet)."""
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310 - a local test server
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError:  # URLError is one: refused, reset, nothing there yet
        return unanswered
