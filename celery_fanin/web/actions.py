"""The dashboard's actions (`fanin dashboard --allow-actions`): retry failed, cancel, seal and rerun, from a
batch's page, as the operator commands do them.

Off unless asked for. Each is a POST of a form whose CSRF token is an HMAC, under a secret of this process, of a
random value in a `SameSite=Strict` cookie (a page of another site can neither read the token nor send the cookie);
a POST from another origin (its `Origin` header) is refused too. Each is recorded, done, refused or failed, with who
asked (the Basic-auth user, `token` for a token's holder, else `anonymous`, and the client's address) and when, in
`fanin_operator_actions`, which the batch's page lists. Actions run through the app's own engine (its database URL):
its role needs the rights the commands need (the relay's, and the producer's for retry-failed), while the pages
keep reading through the dashboard's read-only engine.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs

from sqlalchemy.exc import SQLAlchemyError
from starlette.requests import Request

from ..context import FanIn
from ..exceptions import FanInError, summarise
from ..ops.rounds import retry_failed
from ..producer.actions import cancel_batch, seal_batch
from ..protocol import BATCH_ACTIVE, SUCCESSOR_FINAL, BatchState, SuccessorState
from ..redact import redact
from ..relay import reruns
from ..store import admin

CSRF_COOKIE = "fanin_csrf"
# The attribute of `request.state` where the guard (`app.Guard`) puts who the request signed in as.
ACTOR = "fanin_actor"
ACTIONS = ("retry-failed", "cancel", "seal", "rerun")


@dataclass(frozen=True)
class Done:
    """How an action ended: "done", "refused" (the batch was not in a state for it) or "error", and what to say."""

    outcome: str
    message: str


class Actions:
    """The actions of one dashboard: its CSRF secret, and the FanIn whose engine runs them."""

    def __init__(self, fanin: FanIn) -> None:
        self.fanin = fanin
        self.secret = secrets.token_bytes(32)  # per process: a form from before a restart is refused (reload it)

    # --- CSRF -------------------------------------------------------------------------------------------------------

    def token(self, cookie: str) -> str:
        return hmac.new(self.secret, cookie.encode(), hashlib.sha256).hexdigest()

    @staticmethod
    def new_cookie() -> str:
        return secrets.token_urlsafe(24)

    def check(self, request: Request, given: str | None) -> str | None:
        """Why this POST is refused (None: it is not): a missing or wrong token, or another origin."""
        origin = request.headers.get("origin")
        # "null": what a browser sends under the pages' `Referrer-Policy: no-referrer`; the token decides then.
        if origin is not None and origin != "null":
            # The page's own origin: its Host, or the host a reverse proxy says it forwarded (X-Forwarded-Host).
            hosts = {request.headers.get("host", ""), *request.headers.get("x-forwarded-host", "").split(",")}
            if origin.split("://", 1)[-1].rstrip("/") not in {h.strip() for h in hosts if h.strip()}:
                return f"a form from another origin ({origin}) is refused"
        cookie = request.cookies.get(CSRF_COOKIE)
        if not cookie or not given or not hmac.compare_digest(given.encode(), self.token(cookie).encode()):
            return "the form's token is missing or stale: reload the page and try again"
        return None

    # --- the actions ------------------------------------------------------------------------------------------------

    def run(self, action: str, batch_id: uuid.UUID, actor: str) -> Done:
        """Run `action` on the batch, and record it whatever happened."""
        steps: dict[str, Callable[[], str]] = {
            "retry-failed": lambda: self._retry(batch_id),
            "cancel": lambda: self._cancel(batch_id),
            "seal": lambda: self._seal(batch_id),
            "rerun": lambda: self._rerun(batch_id, actor),
        }
        try:
            done = Done("done", steps[action]())
        except FanInError as exc:
            done = Done("refused", redact(str(exc)))
        except SQLAlchemyError as exc:
            done = Done("error", f"database error: {summarise(exc)}")
        try:
            with self.fanin.engine.begin() as conn:
                admin.record_action(conn, actor, action, batch_id, done.outcome, done.message)
        except SQLAlchemyError as exc:  # the action's own outcome stands; say that it was not recorded
            return Done("error", f"{done.message} (not recorded: {summarise(exc)})")
        return done

    def _retry(self, batch_id: uuid.UUID) -> str:
        done = retry_failed(self.fanin, batch_id)
        if done.batch_id is None:
            return "nothing to retry: no child failed"
        return f"round {done.round}: {done.children} failed children published again (batch {done.batch_id})"

    def _cancel(self, batch_id: uuid.UUID) -> str:
        expiry = cancel_batch(self.fanin, batch_id)
        return f"cancelled: {len(expiry.abandoned)} unfinished children abandoned and revoked"

    def _seal(self, batch_id: uuid.UUID) -> str:
        sealed = seal_batch(self.fanin, batch_id)
        return f"sealed with {sealed.planned} children"

    def _rerun(self, batch_id: uuid.UUID, actor: str) -> str:
        done = reruns.rerun(self.fanin, batch_id, requested_by=actor)
        return f"rerun {done.rerun} of the successor, as task {done.task_id}"


def applicable(
    state: str, failed: int, successor_state: str | None, is_leaf: bool, superseded: bool = False
) -> list[str]:
    """The actions a batch in this state can take (the buttons its page shows; the action checks again). A round
    retried since (`superseded`) takes none: its last round is the one to act on."""
    if is_leaf or superseded:
        return []
    found = []
    if state == BatchState.OPEN:
        found.append("seal")
    if state in BATCH_ACTIVE:
        found.append("cancel")
    if state not in BATCH_ACTIVE and failed and (successor_state is None or successor_state in SUCCESSOR_FINAL):
        found.append("retry-failed")
    if successor_state in (SuccessorState.FAILED, SuccessorState.REVOKED):
        found.append("rerun")
    return found


def actor(request: Request) -> str:
    """Who asks, as the record keeps it: who the guard found the request signed in as (`app.Guard`: the
    basic-auth user, `token`, or `anonymous` with no auth configured; nothing a client says of itself), with the
    client's address."""
    who = getattr(request.state, ACTOR, None) or "anonymous"
    client = request.client.host if request.client is not None else "?"
    return f"{who} ({client})"


def form_fields(body: bytes) -> dict[str, Any]:
    """An `application/x-www-form-urlencoded` body's fields (the actions' forms are that, and small)."""
    return {k: v[-1] for k, v in parse_qs(body.decode("utf-8", "replace"), max_num_fields=10).items()}
