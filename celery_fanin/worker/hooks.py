"""The worker side: every Celery signal that ends a child or a successor's run, mapped to one report.

`WorkerHooks` is the signal adapter (`middleware.Middleware`): one method per signal, connected once per process by
`install`. Each acts only for apps wired with `FanIn(app)` and returns before any database work for a task without
the fan-in headers; the reports themselves are `runtime.current.reporter`'s, the task guards `guards`'. Which signal
fires where, per Celery version: docs/concepts/terminal-outcomes.md.
"""

from __future__ import annotations

import logging
from typing import Any

from billiard.exceptions import TimeLimitExceeded, WorkerLostError
from celery import Celery, current_app
from celery.app.trace import build_tracer
from celery.worker import state as worker_state
from celery.worker.consumer.consumer import Consumer

from ..dispatch import inline
from ..exceptions import FanInNotConfigured
from ..protocol import BODY_CLAIM, ChildState, Marker, SuccessorState, body_claim, put_claim, stamp_slot
from . import batching, middleware, report, runtime, starts, successor_runs
from .guards import guard_tasks
from .reporter import claim_refusal, fanin_for, unverified

logger = logging.getLogger("celery_fanin.hooks")


class _Revoked(Exception):
    """Stands for the reason a revoked task never ran to an end, as stored in the child's row."""


class WorkerHooks(middleware.Middleware):
    """celery-fanin in a worker: one method per Celery signal it listens to."""

    def before_task_publish(self, sender: Any = None, body: Any = None, headers: Any = None, **_: Any) -> None:
        """Bind a fan-in message's headers into the body Celery publishes (`protocol.claim`)."""
        # Every fan-in message Celery publishes itself: a chain's next task, a retry, a replacement, a child or
        # successor published one at a time. The fast path builds the claim into its own messages.
        if headers:
            put_claim(body, headers)
            stamp_slot(headers.get("task"), body)  # a scheduled fan-in, sent by beat: the time of its slot

    def task_received(self, sender: Any = None, request: Any = None, **_: Any) -> None:
        """Remember a fan-in message's marker while the main process holds its request (unless its claim refuses it)."""
        # A claim given as a header is dropped: the pool reads the claim from the request, to which Celery lifts the
        # headers and then the body's embed, so only the (signed) body's claim may reach it.
        if request is None:
            return
        data = getattr(request, "request_dict", None)
        if data is None:
            return
        data.pop(BODY_CLAIM, None)
        marker = Marker.from_mapping(data)
        if marker is None:
            return
        fanin = fanin_for(getattr(sender, "app", None))
        if fanin is not None and claim_refusal(fanin, data, body_claim(getattr(request, "_payload", None))):
            return  # refused, logged and counted when the pool takes it (`_guard`); no main-process path counts it
        runtime.current.received.add(request.id, marker, request)

    def task_prerun(self, sender: Any = None, task_id: str | None = None, task: Any = None, **_: Any) -> None:
        """Queue a child's start, written off the child's path by `starts`."""
        task = task or sender
        if task is None or task_id is None:
            return
        marker = Marker.from_mapping(task.request)
        if marker is None or marker.is_successor:
            return
        fanin = fanin_for(task.app)
        if fanin is None:
            return
        request = task.request
        if not fanin.settings.track_started and not getattr(request, "expires", None):
            # Off, but a child with `expires` is recorded still: the relay's expiry sweep takes a child with no start
            # for one no worker took (docs/concepts/terminal-outcomes.md).
            return
        if not request.is_eager and claim_refusal(fanin, request, getattr(request, BODY_CLAIM, None)):
            return  # refused by `_guard`, next: not started
        child_id = marker.child_id(task_id)  # a chain child started when its first task did
        starts.note_start(fanin, child_id, int(getattr(request, "retries", 0) or 0), getattr(request, "hostname", None))

    def task_postrun(
        self,
        sender: Any = None,
        task_id: str | None = None,
        task: Any = None,
        retval: Any = None,
        state: str | None = None,
        **_: Any,
    ) -> None:
        """Record how a child or a successor's run ended in the pool process (success, failure, rejection)."""
        task = task or sender
        if task is not None and task_id is not None:
            runtime.current.reporter.postrun(task, task_id, retval, state)

    @report.in_event_loop
    def task_failure(
        self, sender: Any = None, task_id: str | None = None, exception: BaseException | None = None, **_: Any
    ) -> None:
        """Record a hard time limit or a lost pool process, the failures only the main process sees."""
        if task_id is None or not isinstance(exception, (TimeLimitExceeded, WorkerLostError)):
            return
        # Celery 5.7 fires task_failure twice for a hard time limit, once without a request: keep the marker for the
        # repeat, which is then recorded as a late report; the entry still goes when Celery lets the request go.
        held = runtime.current.received.request(task_id)
        lookup = (
            runtime.current.received.get if isinstance(exception, TimeLimitExceeded) else runtime.current.received.pop
        )
        marker = lookup(task_id) or Marker.from_mapping(getattr(sender, "request", None))
        fanin = fanin_for(getattr(sender, "app", None))
        if marker is None or fanin is None:
            return
        state = ChildState.TIME_LIMIT if isinstance(exception, TimeLimitExceeded) else ChildState.WORKER_LOST
        # This copy ran in a pool process (a time limit, a lost process): that process's run, whichever it was.
        pid = _ran_in(held) or _ran_in(getattr(sender, "request", None)) or 0
        runtime.current.reporter.copy_ended(fanin, task_id, marker, state, SuccessorState.FAILED, exception, ran_in=pid)

    @report.in_event_loop
    def task_revoked(
        self, sender: Any = None, request: Any = None, terminated: bool = False, expired: bool = False, **_: Any
    ) -> None:
        """Record a child or successor revoked before or while it ran (or expired unstarted)."""
        marker = Marker.from_mapping(request)
        fanin = fanin_for(getattr(sender, "app", None))
        if marker is None or fanin is None or request is None:
            return
        runtime.current.received.pop(request.id)
        why = claim_refusal(fanin, getattr(request, "request_dict", request), _request_claim(request))
        if why is not None:  # not the message its headers say (revoked or expired before the pool saw it)
            if expired:
                # Celery put the task id in the worker's revoked set on this message's word (its `expires` header,
                # which signing does not cover) before any hook ran: taken out again, or the genuine message would
                # be discarded as revoked and its child counted `revoked`.
                worker_state.revoked.discard(request.id)
            runtime.current.reporter.refuse(fanin, request.id, marker, why)
            return
        reason = "expired" if expired else "terminated" if terminated else "revoked"
        if expired:
            # Celery put the id in this worker's revoked set for this copy's own expiry, not for a revoke: another
            # copy (a live run's retry, a redelivery) must still be judged on its own.
            worker_state.revoked.discard(request.id)
        # Only a terminated copy ran; an expired or revoked one was discarded before a pool process took it.
        ran_in = (_ran_in(request) or 0) if terminated else None
        retries = (getattr(request, "request_dict", None) or {}).get("retries")
        runtime.current.reporter.copy_ended(
            fanin,
            request.id,
            marker,
            ChildState.REVOKED,
            SuccessorState.REVOKED,
            _Revoked(reason),
            ran_in=ran_in,
            retries=retries,
        )

    @report.in_event_loop
    def task_unknown(
        self,
        sender: Any = None,
        message: Any = None,
        exc: BaseException | None = None,
        name: str | None = None,
        id: str | None = None,
        **_: Any,
    ) -> None:
        """Record a message for a task this worker does not know."""
        marker = Marker.from_mapping(getattr(message, "headers", None))
        fanin = fanin_for(getattr(sender, "app", None))
        if marker is None or fanin is None or not id or unverified(fanin, "unknown task", id, exc):
            return
        retries = (getattr(message, "headers", None) or {}).get("retries")
        runtime.current.reporter.copy_ended(
            fanin, id, marker, ChildState.UNKNOWN, SuccessorState.FAILED, exc, ran_in=None, retries=retries
        )

    @report.in_event_loop
    def task_rejected(
        self, sender: Any = None, message: Any = None, exc: BaseException | None = None, **_: Any
    ) -> None:
        """Record a message the worker refused (a content type it does not accept, or a body it cannot decode)."""
        headers = getattr(message, "headers", None) or {}
        marker = Marker.from_mapping(headers)
        fanin = fanin_for(getattr(sender, "app", None))
        task_id = headers.get("id")
        if marker is None or fanin is None or not task_id or unverified(fanin, "rejected", task_id, exc):
            return
        retries = headers.get("retries")
        runtime.current.reporter.copy_ended(
            fanin, task_id, marker, ChildState.REJECTED, SuccessorState.FAILED, exc, ran_in=None, retries=retries
        )

    def worker_init(self, sender: Any = None, **_: Any) -> None:
        """Refuse bad settings, a pooled URL or an old schema; guard the app's tasks; count undecodable messages."""
        app = getattr(sender, "app", None)
        fanin = fanin_for(app)
        if fanin is not None:
            try:
                fanin.check_settings()
                fanin.check_session_pooling()
                fanin.check_schema()
            except FanInNotConfigured as exc:  # Celery logs and ignores a signal handler's Exception: stop the worker
                logger.critical("%s", exc)
                raise SystemExit(1) from exc
            guard_tasks(app)  # type: ignore[arg-type]
            self._report_decode_errors()
            successor_runs.new_worker_key()  # before the pool starts: its processes inherit it
            inline.prepare_worker(sender, app)  # the same: what a successor run where its batch completed checks
            batching.start(fanin, getattr(sender, "pool_cls", None) or app.conf.worker_pool)  # type: ignore[union-attr]

    def worker_process_init(self, **_: Any) -> None:
        """Guard the tasks of a pool process started as a fresh interpreter (spawn), and rebuild their tracers."""
        # The tracers read `before_start` once when they are built.
        app = current_app._get_current_object()
        if fanin_for(app) is not None and guard_tasks(app):
            for name, task in app.tasks.items():
                task.__trace__ = build_tracer(name, task, app.loader, app=app)

    def worker_shutdown(self, **_: Any) -> None:
        """Give the starts and the reports still queued a few seconds to reach the store; stop the batcher."""
        batching.stop()
        starts.flush_all(timeout=5.0)
        if not report.background().flush(timeout=10.0):
            logger.warning(
                "reports still waiting for the store at shutdown: reconciliation and child_timeout settle them"
            )

    def worker_process_shutdown(self, **_: Any) -> None:
        """The same as `worker_shutdown`, in a pool process."""
        self.worker_shutdown()

    # --- helpers -----------------------------------------------------------------------------------------------

    def _report_decode_errors(self) -> None:
        """Count a child whose body the worker cannot decode (corrupt, or not what its content type says) as
        rejected: Celery acks such a message in `Consumer.on_decode_error` and only logs it, no signal fires, and
        the child would wait for `child_timeout`. Its headers are readable, so it is reported as `task_rejected`
        would be. Wrapped once per worker process, at `worker_init`."""
        original = Consumer.on_decode_error
        if getattr(original, "_fanin_reports", False):
            return
        task_rejected = self.task_rejected

        def on_decode_error(consumer: Any, message: Any, exc: BaseException) -> None:
            original(consumer, message, exc)  # logs and acks, as before
            task_rejected(sender=consumer, message=message, exc=exc)

        on_decode_error._fanin_reports = True  # type: ignore[attr-defined]
        Consumer.on_decode_error = on_decode_error  # type: ignore[method-assign]


def _ran_in(request: Any) -> int | None:
    """The pool process a main-process request ran in (prefork's `worker_pid`; the main process itself for the
    thread pools and solo), or None if none took it."""
    pid = getattr(request, "worker_pid", None)
    return pid if isinstance(pid, int) and pid > 0 else None


def _request_claim(request: Any) -> Any:
    """The claim in a request's body: a main-process `Request` holds the decoded body, a pool's context has the
    body's embed lifted onto it (and no header of that name: `task_received` dropped it)."""
    payload = getattr(request, "_payload", None)
    return body_claim(payload) if payload is not None else getattr(request, BODY_CLAIM, None)


worker_hooks = WorkerHooks()


def install(app: Celery | None = None) -> None:
    """Connect the worker hooks once per process; they act only for apps wired with FanIn."""
    middleware.connect(worker_hooks)
