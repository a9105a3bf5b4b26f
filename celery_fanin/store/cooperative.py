"""psycopg under eventlet: waits that let the other green threads run.

With its C speedups installed (psycopg-binary, psycopg-c), psycopg waits for the server in C (`wait_c`), which no
monkey-patching reaches. psycopg notices gevent's patching and then waits in Python, but not eventlet's: under
eventlet every statement blocks the whole hub, so a worker with `-P eventlet -c 100` runs one report at a time,
and a report held up by a lock stalls every task of the worker. The fix psycopg's maintainers describe is a wait
that eventlet's green `select` serves: `wait_select`. Applied once, before the library's first connection, only
when eventlet has patched `select`.
"""

from __future__ import annotations

import logging
import sys

logger = logging.getLogger("celery_fanin")


def ensure() -> bool:
    """Make psycopg wait through `select` if eventlet has patched it; True if it does so (now or before)."""
    patcher = sys.modules.get("eventlet.patcher")
    if patcher is None or not patcher.is_monkey_patched("select"):
        return False
    import selectors

    from psycopg import waiting

    if waiting.wait is not waiting.wait_select:
        waiting.wait = waiting.wait_select
        # Connecting and cancelling wait through a selector psycopg took when it was imported, maybe before
        # eventlet patched `selectors`: the patched one from now on.
        waiting.DefaultSelector = selectors.DefaultSelector  # type: ignore[misc]
        logger.info("eventlet has patched select: psycopg now waits through it (wait_select), not in C")
    return True
