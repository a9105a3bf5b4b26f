"""A stand-in for the partner's HTTP API, deterministic by external id so that a run's outcome can be predicted.

Each id falls in one of 100 buckets (a SHA-256 of the id, stable across processes):

====== ================= ===================================================================================
bucket behaviour          what the task does with it
====== ================= ===================================================================================
0-3    rejected          `PermanentError` on every call: not retried, the child fails
4-5    timeout           `RetryableError` on every call: retried until the retries run out, then fails
6-15   rate limited      `RateLimitExceeded` on the first one or two calls, then synced
16-20  user not found    the partner does not know the user: success with a note (discarded, not retried)
21-99  ok                synced
====== ================= ===================================================================================
"""

from __future__ import annotations

import hashlib
import time
from typing import Literal, TypedDict

Behaviour = Literal["rejected", "timeout", "rate_limited", "user_not_found", "ok"]
Expected = Literal["synced", "user_not_found", "failed"]

# Simulated round trip to the partner: small, so the demo's 2,000 calls stay quick on two processes.
LATENCY_SECONDS = 0.002


class PartnerError(Exception):
    """Anything the partner API answers with other than a result."""


class RateLimitExceeded(PartnerError):
    """HTTP 429: the call may succeed later."""


class RetryableError(PartnerError):
    """A timeout or a 5xx: the call may succeed later."""


class PermanentError(PartnerError):
    """The partner refused this user (HTTP 422): retrying cannot help."""


class SyncResult(TypedDict):
    external_id: str
    status: Literal["synced", "user_not_found"]
    attempts: int


def bucket(external_id: str) -> int:
    return int.from_bytes(hashlib.sha256(external_id.encode()).digest()[:4], "big") % 100


def behaviour(external_id: str) -> Behaviour:
    b = bucket(external_id)
    if b < 4:
        return "rejected"
    if b < 6:
        return "timeout"
    if b < 16:
        return "rate_limited"
    if b < 21:
        return "user_not_found"
    return "ok"


def rate_limited_calls(external_id: str) -> int:
    """How many calls for a rate-limited id answer 429 before one succeeds."""
    return 1 + bucket(external_id) % 2


def sync_user(external_id: str, partner_id: str, attempt: int) -> SyncResult:
    """Push one user to the partner; `attempt` counts from 0. Raises a `PartnerError` subclass on failure."""
    time.sleep(LATENCY_SECONDS)
    kind = behaviour(external_id)
    if kind == "rejected":
        raise PermanentError(f"422 from partner {partner_id}: {external_id} rejected")
    if kind == "timeout":
        raise RetryableError(f"timeout calling partner {partner_id} for {external_id}")
    if kind == "rate_limited" and attempt < rate_limited_calls(external_id):
        raise RateLimitExceeded(f"429 from partner {partner_id} for {external_id}")
    status: Literal["synced", "user_not_found"] = "user_not_found" if kind == "user_not_found" else "synced"
    return {"external_id": external_id, "status": status, "attempts": attempt + 1}


def expected(external_id: str, max_retries: int) -> Expected:
    """How a task making at most `1 + max_retries` calls ends for this id: what the report should say."""
    kind = behaviour(external_id)
    if kind in ("rejected", "timeout"):
        return "failed"
    if kind == "rate_limited" and rate_limited_calls(external_id) > max_retries:
        return "failed"
    return "user_not_found" if kind == "user_not_found" else "synced"
