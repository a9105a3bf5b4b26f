"""The worker's own Prometheus counters, in the default prometheus_client registry of the process that counts them.

Why here and not on the relay's endpoint (`celery_fanin.relay.metrics`): they count what never reached the store
(a report given up) or what the store refused, so only the worker process knows. A prefork worker's pool
processes count their own: export them with prometheus_client's multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``).
"""

from __future__ import annotations

from prometheus_client import Counter

# Reports given up after fanin_report_timeout, or refused by the store as not transient, by kind ("terminal": a
# child's outcome, "successor": a successor's final state), whether the main process or a pool process gave up.
REPORTS_GIVEN_UP = Counter(
    "fanin_worker_reports_given_up", "Reports a worker gave up after fanin_report_timeout.", ["kind"]
)
# Terminal reports the store refused: the message's batch, index or task name disagree with the child's row.
REPORTS_REFUSED = Counter("fanin_worker_reports_refused", "Terminal reports refused: headers do not match the child.")
