"""Children and successors as ordinary Celery task messages, built and written in bulk where the
transport allows (docs/concepts/publishing.md).
"""

from __future__ import annotations

import contextlib
import logging
import select
import uuid
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from amqp import Message
from celery import Celery, signals
from celery.app.task import Task
from celery.canvas import Signature, _chain, maybe_signature
from celery.result import denied_join_result
from celery.utils.nodenames import anon_nodename
from celery.utils.quorum_queues import detect_quorum_queues
from celery.utils.saferepr import saferepr
from celery.utils.time import subtract_datetimes
from kombu import Exchange, Producer
from kombu.common import Broadcast
from kombu.compression import compress
from kombu.entity import maybe_delivery_mode
from kombu.exceptions import OperationalError as KombuOperationalError
from kombu.serialization import dumps, loads

from ..codec import serialize
from ..context import eager_call, is_eager, settings_of
from ..protocol import (
    CLAIM_RECEIVER,
    HEADER_BATCH,
    HEADER_CHAIN,
    HEADER_CHORD,
    HEADER_INDEX,
    HEADER_STEP,
    HEADER_SUCCESSOR,
    HEADER_TASK,
    RUN_CANVAS_TASK,
    THEN_CANVAS_TASK,
    put_claim,
)
from . import amqp_frames
from .amqp_frames import FrameBuffer
from .confirms import ConfirmChannel, Unconfirmed, confirm_channel

logger = logging.getLogger("celery_fanin.publish")

# Errors that mean "the broker cannot be reached" rather than "this message is bad".
BROKER_ERRORS = (KombuOperationalError, ConnectionError, OSError)

# The library's own tasks that only write or run a user's canvas (`run_canvas` writes the fan-in a chain reached,
# `then_canvas` replaces itself with a successor's chain or group): what they publish is their parent's child, as
# in the canvas Celery would have run without them (Celery's test_parent_ids).
_TRANSPARENT = frozenset({RUN_CANVAS_TASK, THEN_CANVAS_TASK})


def parent_ids(app: Celery) -> tuple[str | None, str | None]:
    """(root_id, parent_id) of a message published now, as `send_task` sets them from the running task: None
    outside a task; a transparent task's (`_TRANSPARENT`) own parent as the parent."""
    parent = app.current_worker_task
    if parent is None:
        return None, None
    root_id = parent.request.root_id or parent.request.id
    return root_id, parent.request.parent_id if parent.name in _TRANSPARENT else parent.request.id


# Redis commands buffered per pipeline round trip. RabbitMQ: at MAX_UNCONFIRMED messages written and not yet
# confirmed, one call waits until CONFIRM_WINDOW fewer are (room for the producer's chunks in flight).
BATCH_SIZE = 1000
CONFIRM_WINDOW = 1000
MAX_UNCONFIRMED = 8000
# Signature options the fast path builds messages for; a child with any other option is published by Celery.
_PER_MESSAGE_OPTIONS = frozenset({"task_id", "countdown", "eta", "expires", "headers"})
_ROUTE_OPTIONS = frozenset(
    {
        "queue",
        "exchange",
        "routing_key",
        "exchange_type",
        "priority",
        "delivery_mode",
        "serializer",
        "compression",
        "time_limit",
        "soft_time_limit",
        "ignore_result",
        "shadow",
        "retry",
        "retry_policy",
        "immediate",
        "mandatory",
        "add_to_parent",
        "reply_to",
    }
)
_FAST_OPTIONS = _PER_MESSAGE_OPTIONS | _ROUTE_OPTIONS


@contextmanager
def producer(app: Celery, *, batched: bool = True) -> Iterator[Producer]:
    """One producer for many messages, pipelined where kombu's transport supports batching.

    Messages published through it are on the broker when the context exits (the Redis pipeline is flushed then;
    a failed flush raises). `batched=False` for one message: kombu's Redis batch makes a client of its own for
    every batch (~70 µs of CPU a successor, measured in-process), which one message does not need.
    """
    with app.producer_or_acquire() as prod:
        batch = getattr(prod, "batch", None) if batched else None  # kombu >= 5.7
        if batch is None:
            yield prod
        else:
            with batch(BATCH_SIZE):
                yield prod


# --- the fast path -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Route:
    """Where and how one kind of message goes: what Celery's router and `send_task_message` compute, once."""

    exchange: str
    routing_key: str
    declare: tuple[Any, ...]
    serializer: str
    compression: str | None
    properties: Mapping[str, Any]  # delivery_mode, priority and any other message property
    time_limit: float | None
    soft_time_limit: float | None
    ignore_result: bool | None
    shadow: str | None
    expires: Any  # the task's default `expires`, if the signature has none


_NO_ARG: Any = object()  # `_Builder.build` without an argument placed first


class _Unsupported(Exception):
    """This child needs Celery's own publishing path."""


class _Builder:
    """Builds the children's messages of one `publish_children` call with Celery's own message format."""

    def __init__(self, app: Celery, batch_id: str) -> None:
        self.app = app
        self.amqp = app.amqp
        self.batch_id = batch_id
        conf = app.conf
        self.now = app.now()
        self.timezone = app.timezone
        self.default_serializer = conf.task_serializer
        self.default_compression = conf.task_compression
        self.default_delivery_mode = conf.task_default_delivery_mode
        self.default_rkey = conf.task_default_routing_key
        self.default_exchange = self.amqp.default_exchange
        self.repr_levels = conf.task_repr_maxlevels
        self.argsrepr_size = self.amqp.argsrepr_maxsize
        self.kwargsrepr_size = self.amqp.kwargsrepr_maxsize
        self.reply_to = app.thread_oid
        self.origin = anon_nodename()
        # As `send_task` does: a batch created inside a task is that task's child.
        parent = app.current_worker_task
        self.root_id, self.parent_id = parent_ids(app)
        self.parent_priority = None
        if parent is not None and conf.task_inherit_parent_priority:
            self.parent_priority = (parent.request.delivery_info or {}).get("priority")
        self.simple_routes = all(type(r).__name__ == "MapRoute" for r in self.amqp.router.routes)
        self.routes: dict[Any, _Route] = {}
        self.tasks: dict[str, Task | None] = {}
        self.declared: set[int] = set()
        # Whether anyone but celery-fanin's own claim receiver (whose work `build` does) hears before_task_publish.
        self.before_publish = _others_listen(signals.before_task_publish)
        self.ignore_results = child_results_ignored(app)

    def repr(self, value: tuple[Any, ...] | dict[str, Any], size: int) -> str:
        """`saferepr`'s text for the usual flat arguments at `repr`'s speed; `saferepr` itself for anything else."""
        items: Iterable[Any] = (*value.keys(), *value.values()) if isinstance(value, dict) else value
        if len(value) <= 16 and all(_plain(v) for v in items):
            text = repr(value)
            if len(text) <= size:
                return text
        return saferepr(value, size, maxlevels=self.repr_levels)

    def task(self, name: str) -> Task | None:
        try:
            return self.tasks[name]
        except KeyError:
            task = self.app.tasks.get(name)
            if task is not None and (
                getattr(task, "_dump_pydantic_arguments", None) is not None
                or type(task).apply_async is not Task.apply_async
            ):
                task = _UNSUPPORTED_TASK  # pydantic arguments or a custom apply_async: Celery's path
            self.tasks[name] = task
            return task

    def route(self, name: str, task: Task | None, options: dict[str, Any], args: Any, kwargs: Any) -> _Route:
        """The options Celery would publish with; cached per (task, options) unless a routing function decides."""
        key: Any = None
        if self.simple_routes:
            try:
                key = (name, tuple(sorted(options.items())))
                hash(key)
            except TypeError:
                key = None
            else:
                cached = self.routes.get(key)
                if cached is not None:
                    return cached
        route = self._resolve(name, task, dict(options), args, kwargs)
        if key is not None:
            self.routes[key] = route
        return route

    def _resolve(self, name: str, task: Task | None, options: dict[str, Any], args: Any, kwargs: Any) -> _Route:
        # Task.apply_async: the task's own options under the signature's.
        if task is not None:
            options = dict({k: v for k, v in task._get_exec_options().items() if v is not None}, **options)
            options.setdefault("ignore_result", task.ignore_result)
        if options.pop("retry", None) is not None:
            pass  # publishing is not retried message by message here: a failed chunk is left to the relay
        options.pop("retry_policy", None)
        options.pop("add_to_parent", None)
        options.pop("immediate", None)
        options.pop("mandatory", None)
        time_limit = options.pop("time_limit", None)
        soft_time_limit = options.pop("soft_time_limit", None)
        task_expires = options.pop("expires", None)
        ignore_result = options.pop("ignore_result", None)
        shadow = options.pop("shadow", None)
        reply_to = options.pop("reply_to", None)
        if reply_to is not None:
            raise _Unsupported("reply_to")
        if self.parent_priority is not None:
            options.setdefault("priority", self.parent_priority)
        # app.send_task: the router (task_routes, the queue option, the default queue).
        options = self.amqp.router.route(options, name, args, kwargs, task)
        # amqp.send_task_message: from queue/exchange/routing key to what the producer publishes.
        queue = options.pop("queue", None)
        exchange = options.pop("exchange", None)
        routing_key = options.pop("routing_key", None)
        exchange_type = options.pop("exchange_type", None)
        delivery_mode = options.pop("delivery_mode", None)
        serializer = options.pop("serializer", None) or self.default_serializer
        compression = options.pop("compression", None) or self.default_compression
        if options.pop("declare", None) is not None:
            raise _Unsupported("declare")
        qname = queue
        if queue is None and exchange is None:
            queue = self.amqp.default_queue
        if queue is not None:
            if isinstance(queue, str):
                qname, queue = queue, self.amqp.queues[queue]
            else:
                qname = queue.name
        if delivery_mode is None:
            delivery_mode = getattr(getattr(queue, "exchange", None), "delivery_mode", None)
            delivery_mode = delivery_mode or self.default_delivery_mode
        if exchange_type is None:
            exchange_type = getattr(getattr(queue, "exchange", None), "type", None) or "direct"
        if (not exchange or not routing_key) and exchange_type == "direct":
            exchange, routing_key = "", qname
        elif exchange is None:
            exchange = queue.exchange.name or self.default_exchange
            routing_key = routing_key or queue.routing_key or self.default_rkey
        if isinstance(exchange, Exchange):
            exchange = exchange.name
        declare: tuple[Any, ...] = (queue,) if queue is not None and not isinstance(queue, Broadcast) else ()
        return _Route(
            exchange=exchange or "",
            routing_key=routing_key or "",
            declare=declare,
            serializer=serializer,
            compression=compression,
            properties={"delivery_mode": delivery_mode, **options},
            time_limit=time_limit,
            soft_time_limit=soft_time_limit,
            ignore_result=ignore_result,
            shadow=shadow,
            expires=task_expires,
        )

    def build(
        self, idx: int, task_id: str, sig: Signature, *, first_arg: Any = _NO_ARG, marker: dict[str, Any] | None = None
    ) -> tuple[_Route, dict[str, Any], Any, dict[str, Any]]:
        """One child's (route, headers, body, properties), as `app.send_task` would publish it.

        For a successor: `first_arg` (the outcome) goes before the signature's own arguments, as a chord body gets
        its header's results (not for an immutable one, `.si()`, as `apply_async`'s `_merge` does not either), and
        `marker` replaces the child's batch headers.
        """
        options = sig.options
        if not options.keys() <= _FAST_OPTIONS:
            raise _Unsupported(", ".join(sorted(options.keys() - _FAST_OPTIONS)))
        name = sig.task
        task = self.task(name)
        if task is _UNSUPPORTED_TASK:
            raise _Unsupported("task")
        args = tuple(sig.args) if first_arg is _NO_ARG or sig.immutable else (first_arg, *sig.args)
        kwargs = dict(sig.kwargs)
        route_options = {k: v for k, v in options.items() if k not in _PER_MESSAGE_OPTIONS}
        if marker is None and self.ignore_results and "ignore_result" not in options:
            route_options["ignore_result"] = True  # a child's result is the store's (see child_results_ignored)
        route = self.route(name, task, route_options, args, kwargs)
        if task is not None and task.typing:
            # Task.apply_async checks the arguments against the task's signature; a mismatch is the caller's error.
            header = getattr(task, "__header__", None)
            if header is not None:
                header(*args, **kwargs)
        countdown = options.get("countdown")
        eta = options.get("eta")
        expires = options.get("expires", route.expires)
        if isinstance(expires, str):
            raise _Unsupported("expires given as a string")
        shadow = route.shadow
        if task is not None and type(task).shadow_name is not Task.shadow_name:
            shadow = shadow or task.shadow_name(args, kwargs, options)
        message = self.amqp.create_task_message(
            task_id,
            name,
            args,
            kwargs,
            countdown,
            eta,
            None,
            None,
            expires,
            0,
            None,
            None,
            None,
            self.reply_to,
            route.time_limit,
            route.soft_time_limit,
            False,
            self.root_id,
            self.parent_id,
            shadow,
            None,
            ignore_result=route.ignore_result,
            now=self.now,
            timezone=self.timezone,
            origin=self.origin,
            argsrepr=self.repr(args, self.argsrepr_size),
            kwargsrepr=self.repr(kwargs, self.kwargsrepr_size),
        )
        headers = message.headers
        headers.update(options.get("headers") or {})
        headers.update(marker if marker is not None else {HEADER_BATCH: self.batch_id, HEADER_INDEX: idx})
        if route.serializer == "auth":
            # The fan-in headers, bound into the body that signing covers. Unsigned, a claim proves nothing (anyone
            # can write one) and costs a tenth of building the message, so it is left out (workers take it either way).
            put_claim(message.body, headers)
        properties = {**route.properties, **message.properties}
        if expires is not None:
            # As `send_task`: an expiring task is also a message with a TTL (RabbitMQ drops it unconsumed).
            if isinstance(expires, datetime):
                seconds = subtract_datetimes(expires, self.now).total_seconds()
            else:
                seconds = float(expires)
            properties["expiration"] = max(0.0, seconds)
        return route, headers, message.body, properties


_UNSUPPORTED_TASK: Any = object()


def _others_listen(signal: Any) -> bool:
    """Whether a receiver other than the claim's (`protocol.CLAIM_RECEIVER`) is connected to `signal`: sending a
    signal costs about as much as building a message's headers, so the fast path skips one only it would hear."""
    return any(key[0] != CLAIM_RECEIVER for key, _ in signal.receivers)


# Types whose `repr` is what `saferepr` prints for them.
_SCALARS = frozenset({int, float, bool, type(None)})


def _plain(value: Any) -> bool:
    """A value `repr` prints exactly as `saferepr` does (saferepr quotes, escapes and shortens strings its own way
    only when they are long or hold quotes, backslashes or unprintable characters)."""
    if type(value) is str:
        return len(value) < 64 and value.isprintable() and "'" not in value and '"' not in value and "\\" not in value
    return type(value) in _SCALARS


def child_results_ignored(app: Celery) -> bool:
    """Whether the children `publish_children` sends go with ``ignore_result=True`` (unless a child's signature
    sets ``ignore_result`` itself): yes unless ``fanin_store_child_results_in_backend`` is on.

    Why: the outcome a successor gets is read from PostgreSQL, so a child's result in Celery's result backend is
    a second copy nobody needs by default, and its cost (a backend write per child; with the Redis backend, a
    result subscription per child on the producer) was the difference between a chord user's tasks and the
    benchmark's. Successors are never affected: their result is the fan-in's result.
    """
    return not settings_of(app).store_child_results_in_backend


def bulk_publish_enabled(app: Celery) -> bool:
    """Whether the fast path may be used for this app (``fanin_bulk_publish``, default on)."""
    conf = app.conf
    if not conf.get("fanin_bulk_publish", True):
        return False
    return not (is_eager(app) or conf.task_send_sent_event or int(conf.task_protocol or 2) != 2)


def amqp_frames_enabled(app: Celery) -> bool:
    """Whether a RabbitMQ confirm channel writes through `amqp_frames` (``fanin_amqp_frames``, default on, and a
    py-amqp within the tested range) rather than py-amqp's own writer."""
    return bool(app.conf.get("fanin_amqp_frames", True)) and amqp_frames.SUPPORTED


def publish_mode(prod: Producer) -> str:
    """How `publish_children` writes to this producer's broker: ``pipeline`` (Redis), ``confirm`` (AMQP) or
    ``single`` (anything else, one message at a time)."""
    conn = prod.connection
    driver = getattr(getattr(conn, "transport", None), "driver_type", None)
    if driver == "amqp" and getattr(conn.transport, "driver_name", "") in ("py-amqp", "amqp"):
        return "confirm"
    if getattr(prod, "supports_batch_publish", False) and getattr(prod, "batch", None) is not None:
        return "pipeline"
    return "single"


def publish_children(
    app: Celery,
    prod: Producer,
    batch_id: uuid.UUID,
    children: Iterable[tuple[int, str, Signature]],
    *,
    wait: bool = True,
) -> Unconfirmed:
    """Publish children (index, task id, signature) as ordinary task messages carrying the batch headers.

    With Redis the messages are buffered in the producer's pipeline (see `producer`); with RabbitMQ this returns
    once the broker confirmed every one of them, or with `wait=False` as soon as they are written, handing back
    the confirms to wait for (the caller can do other work while the broker stores the messages). Raises if the
    broker cannot be reached or refuses a message: the caller then leaves these children to the relay.
    """
    bid = str(batch_id)
    fast = bulk_publish_enabled(app)
    ignore = child_results_ignored(app)
    if not fast and (is_eager(app) or publish_mode(prod) != "confirm"):
        for idx, task_id, sig in children:
            _publish_with_celery(prod, bid, idx, task_id, sig, ignore_results=ignore)
        return Unconfirmed()
    _ensure_connection(app, prod)
    mode = publish_mode(prod)
    builder = _Builder(app, bid)
    driver = prod.connection.transport.driver_type
    quorum = fast and _has_quorum_queues(app, driver)
    confirms = confirm_channel(prod, amqp_frames_enabled(app)) if mode == "confirm" else None
    target = confirms.producer if confirms is not None else prod
    frames = confirms.frames if confirms is not None else None
    first = confirms.sent + 1 if confirms is not None else 1  # this call's delivery tags: first..confirms.sent
    # Nested in the `producer` context's batch when there is one (flushed when it exits), else flushed here.
    batch = prod.batch(BATCH_SIZE) if mode == "pipeline" else contextlib.nullcontext()
    try:
        with batch:
            for idx, task_id, sig in children:
                built = None
                if fast and not is_chain(sig):
                    try:
                        built = builder.build(idx, task_id, sig)
                        if quorum and (sig.options.get("countdown") or sig.options.get("eta")):
                            raise _Unsupported("eta on quorum queues")  # Celery's native delayed delivery
                    except _Unsupported:
                        built = None
                if built is None:
                    if confirms is None:
                        _publish_with_celery(prod, bid, idx, task_id, sig, ignore_results=ignore)
                        continue
                    # Celery's own path, on the confirm channel: its messages are confirmed like the others.
                    written = confirms.published
                    _publish_with_celery(confirms.producer, bid, idx, task_id, sig, ignore_results=ignore, retry=False)
                    confirms.sent += confirms.published - written
                else:
                    _send(builder, prod, target, sig.task, *built, frames=frames)
                    if confirms is None:
                        continue
                    confirms.sent += 1
                if confirms.sent - confirms.floor >= MAX_UNCONFIRMED:
                    confirms.wait(upto=confirms.sent - MAX_UNCONFIRMED + CONFIRM_WINDOW, since=first)
            if confirms is None:
                return Unconfirmed()
            if wait:
                confirms.wait(since=first)
                return Unconfirmed()
            confirms.flush()
            return Unconfirmed(confirms, first, confirms.sent)
    except BaseException:
        if confirms is not None:
            confirms.discard()
        raise


def _send(
    builder: _Builder,
    prod: Producer,
    target: Producer,
    name: str,
    route: _Route,
    headers: dict[str, Any],
    body: Any,
    properties: dict[str, Any],
    *,
    frames: FrameBuffer | None = None,
) -> None:
    """Publish one built message as `amqp.send_task_message` would: declare its queue once, the publish signals.

    With `frames` (a RabbitMQ confirm channel's), the message goes straight to them (`_publish_frames`) when kombu
    would build it from what the fast path models, else through kombu's ``Producer.publish`` like any other."""
    for entity in route.declare:
        if id(entity) not in builder.declared:
            prod.maybe_declare(entity)
            builder.declared.add(id(entity))
    before = signals.before_task_publish
    if builder.before_publish:
        before.send(
            sender=name,
            body=body,
            exchange=route.exchange,
            routing_key=route.routing_key,
            declare=list(route.declare),
            headers=headers,
            properties=properties,
            retry_policy=None,
        )
    if frames is None or not _publish_frames(frames, target, route, headers, body, properties):
        target.publish(
            body,
            exchange=route.exchange,
            routing_key=route.routing_key,
            serializer=route.serializer,
            compression=route.compression,
            headers=headers,
            declare=[],
            retry=False,
            **properties,
        )
    after = signals.after_task_publish
    if after.receivers:
        after.send(sender=name, body=body, headers=headers, exchange=route.exchange, routing_key=route.routing_key)


# The keyword parameters of kombu's ``Producer.publish``: a property of one of these names is taken as that argument.
# `_publish_frames` models three (the ones Celery's messages carry); a message with any other goes through kombu.
_KOMBU_PUBLISH_ARGS = frozenset(
    {
        "routing_key",
        "delivery_mode",
        "mandatory",
        "immediate",
        "priority",
        "content_type",
        "content_encoding",
        "serializer",
        "headers",
        "compression",
        "exchange",
        "retry",
        "retry_policy",
        "declare",
        "expiration",
        "timeout",
        "confirm_timeout",
    }
)
_MODELLED_ARGS = frozenset({"delivery_mode", "priority", "expiration"})


def _publish_frames(
    frames: FrameBuffer,
    producer: Producer,
    route: _Route,
    headers: dict[str, Any],
    body: Any,
    properties: dict[str, Any],
) -> bool:
    """What kombu's ``Producer.publish`` (kombu 5.x, py-amqp transport) does with `_send`'s arguments, minus the
    steps that do nothing here (declarations, retries, batches): the same ``amqp.Message``, handed to the frames.

    Why: on RabbitMQ kombu's own bookkeeping around a message cost more than encoding its properties. Returns
    False, having done nothing, for a message with a property this does not model (kombu then publishes it);
    tests/broker/test_amqp_frames.py compares the bytes with kombu's for each kind of message the fast path builds.
    """
    exchange = producer.exchange  # kombu gives every producer one (the default exchange)
    if exchange is None or not properties.keys() & _KOMBU_PUBLISH_ARGS <= _MODELLED_ARGS:
        return False
    # Producer._delivery_details: the message's mode, else the producer's exchange's, else persistent.
    props = {k: v for k, v in properties.items() if k not in _MODELLED_ARGS}
    props["delivery_mode"] = maybe_delivery_mode(properties.get("delivery_mode") or exchange.delivery_mode)
    expiration = properties.get("expiration")
    if expiration is not None:
        props["expiration"] = str(int(expiration * 1000))
    # Producer._prepare: serialize (the text stays text: py-amqp encodes it), then compress into the headers.
    content_type, content_encoding, payload = serialize(body, route.serializer)
    compression = route.compression or producer.compression
    if compression:
        payload, headers["compression"] = compress(payload, compression)
    message = Message(
        payload,
        priority=properties.get("priority", 0),
        content_type=content_type,
        content_encoding=content_encoding,
        application_headers=headers,
        **props,
    )
    frames.publish(message, exchange=route.exchange or exchange.name, routing_key=route.routing_key)
    return True


def _publish_with_celery(
    prod: Producer, bid: str, idx: int, task_id: str, sig: Signature, *, ignore_results: bool, **options: Any
) -> None:
    """Celery's own path, one message at a time (every option Celery knows, at Celery's speed).

    `ignore_results` (`child_results_ignored`): the child goes with ``ignore_result=True`` unless its signature
    sets ``ignore_result``; an option given to ``apply_async`` would override the signature's, so it is given
    only then."""
    if is_chain(sig):
        publish_chain(prod, bid, idx, task_id, sig, ignore_results=ignore_results, **options)
        return
    if ignore_results and "ignore_result" not in sig.options:
        options["ignore_result"] = True
    running = sig.app.current_worker_task
    if running is not None and running.name in _TRANSPARENT and "parent_id" not in sig.options:
        options.setdefault("parent_id", parent_ids(sig.app)[1])
    apply_async(
        sig,
        task_id=task_id,
        producer=prod,
        headers={**(sig.options.get("headers") or {}), HEADER_BATCH: bid, HEADER_INDEX: idx},
        add_to_parent=False,
        **options,
    )


def apply_async(sig: Signature, args: tuple[Any, ...] = (), **options: Any) -> Any:
    """`sig.apply_async(args, **options)`; inside `FanInGroup.apply`, run inline as Celery's eager `apply_async`.

    Why: `apply`'s eager mode is this context's (`context.eagerly`), not the app's `task_always_eager`, which is
    all Celery's own check reads. Run as Celery would under that setting: the arguments through the serializer and
    back, then `apply` with the same options (those only a message uses are ignored by `Task.apply`).
    """
    app = sig.app
    if not eager_call() or app.conf.task_always_eager:
        return sig.apply_async(args, **options)
    merged_args, kwargs, merged = sig._merge(args, {}, {k: v for k, v in options.items() if v is not None})
    serializer = merged.get("serializer") or app.conf.task_serializer
    content_type, content_encoding, data = dumps((merged_args, kwargs), serializer)
    merged_args, kwargs = loads(data, content_type, content_encoding, accept=[content_type])
    merged.setdefault("ignore_result", sig.type.ignore_result)
    with denied_join_result():
        return sig.type.apply(merged_args, kwargs, **merged)


# The task ids of a chain child's earlier tasks derive from the child's id, so a republished chain reuses them.
_CHAIN_IDS = uuid.UUID("5d6c1f0e-8a43-4c8e-9f57-2b1a6f0c9e21")


def is_chain(sig: Any) -> bool:
    return isinstance(sig, _chain)


def chain_tasks(sig: Signature) -> list[Any]:
    """A chain's tasks in order, nested chains flattened (anything else, a group or chord, is left as it is)."""
    tasks: list[Any] = []
    for task in sig.tasks:  # type: ignore[attr-defined]
        tasks.extend(chain_tasks(task) if is_chain(task) else [task])
    return tasks


def publish_chain(
    prod: Producer,
    bid: str,
    idx: int,
    task_id: str,
    sig: Signature,
    *,
    ignore_results: bool | None = None,
    **options: Any,
) -> None:
    """A chain child, through Celery's own chain: each of its tasks carries the batch headers and the child's
    task id (`HEADER_CHAIN`, the last task's id), so that the last task's outcome counts the child and a failure
    of any earlier task counts it as failed. Only the first task's message is published here; the worker that
    runs each task publishes the next with the options it carries, headers included.

    With `ignore_results` (default: `child_results_ignored` of the chain's app) every task of the chain carries
    ``ignore_result=True`` unless it sets ``ignore_result`` itself, or the chain does (then the chain is left to
    Celery: its option reaches the first task, each other task keeps its own): a chain's next task is published
    with the options it carries, so this is the only place all of them can get it."""
    tasks = chain_tasks(sig)
    marker = {HEADER_BATCH: bid, HEADER_INDEX: idx, HEADER_CHAIN: task_id, HEADER_TASK: tasks[-1].task}
    shared = sig.options.get("headers") or {}  # the chain's own headers go on each of its tasks
    steps = []
    for i, task in enumerate(tasks):
        step = task.clone()
        opts = step.options
        if i == len(tasks) - 1:
            opts["task_id"] = task_id
        else:
            opts.setdefault("task_id", str(uuid.uuid5(_CHAIN_IDS, f"{task_id}:{i}")))
        opts["headers"] = {**shared, **(opts.get("headers") or {}), **marker}
        steps.append(step)
    app = sig._app or steps[0]._app or sig.app  # a chain built with chain(...) takes no app of its own
    if ignore_results is None:
        ignore_results = child_results_ignored(app)
    if ignore_results and "ignore_result" not in sig.options:
        for step in steps:
            step.options.setdefault("ignore_result", True)
    if is_eager(app):
        # Celery's eager chain applies every task with the chain's task id (the last task's): run them here,
        # each with its own id, passing each result on, and stop at the first that does not succeed (whose
        # failure the hooks record with its own error; it is not raised into the producer).
        last: Any = None
        for step in steps:
            last = step.apply((last.get(),) if last is not None else (), throw=False)
            if not last.successful():
                return
        return
    chained = _chain(*steps, app=app)
    chained.options.update({k: v for k, v in sig.options.items() if k not in ("task_id", "headers")})
    _apply_chain(chained, prod, task_id=task_id, add_to_parent=False, **options)


def _apply_chain(chained: _chain, prod: Producer, **options: Any) -> None:
    """Publish a chain's first task as Celery's ``chain.apply_async`` does, but through `prod`.

    Celery's ``_chain.run`` takes ``producer`` (and ``publisher``) as parameters of its own and does not hand them
    on to the first task, which then acquires another producer from the app's pool: on RabbitMQ not the confirm
    channel (so its confirm would never be waited for), on Redis outside this producer's pipeline. So this does
    what ``run`` does (Celery 5.5 to 5.7): the tasks frozen by the chain's own ``prepare_steps`` (each task's id, the
    last task's the chain's, ``link_error`` on every task), a ``link`` on the last task, and the first task
    published, with the producer, carrying the others, last first, as its ``chain`` option (the worker publishes
    each next task from it). tests/broker/test_publish.py compares the message with the one Celery's chain publishes.
    """
    app = chained.app
    opts = dict(chained.options, **options)
    for unused in ("producer", "publisher"):
        opts.pop(unused, None)
    link = opts.pop("link", None)
    tasks, _ = chained.prepare_steps(
        chained.args,  # no partial arguments: run's, when apply_async is given none (its kwargs hold the tasks)
        {},
        chained.tasks,
        root_id=opts.pop("root_id", None),
        parent_id=opts.pop("parent_id", None),
        link_error=opts.pop("link_error", None),
        app=app,
        last_task_id=opts.pop("task_id", None),
        group_id=opts.pop("group_id", None),
        chord_body=opts.pop("chord", None),
        group_index=opts.pop("group_index", None),
    )
    if link:
        tasks[0].extend_list_option("link", link)
    first = tasks.pop()
    use_link = chained._use_link
    if use_link is None:
        use_link = app.conf.task_protocol == 1
    # Protocol 1 links each task to the next instead (prepare_steps did); else the rest rides in the message.
    opts["chain"] = None if use_link else [*(opts.get("chain") or []), *tasks]
    first.apply_async(producer=prod, **opts)


def check_arguments(app: Celery, sig: Signature) -> None:
    """Raise `TypeError` as `Task.apply_async` would if the arguments do not fit the task (a chain: its first task,
    whose message is the one published), for a task registered in this process; a task it does not know is
    published by name, unchecked, as Celery's `send_task` does.

    Why: the relay publishes children whose producer is gone, a chunk at a time, and must know which child of a
    chunk cannot be published before it publishes the others (`dispatch.children.publish_remaining_children`).
    """
    ArgumentCheck(app)(sig)


class ArgumentCheck:
    """`check_arguments` for many signatures of one app, each task's check looked up once (`check(sig)`).

    Why: a producer checks every child of a batch before writing it; the app's task registry and a task's `typing`
    are read once per task name, not once per child, so 10,000 children of one task cost 10,000 calls of its
    argument-only header (an empty function with the task's parameters) and little else.
    """

    def __init__(self, app: Celery) -> None:
        self.app = app
        self._headers: dict[str, Any] = {}

    def header(self, name: str) -> Any:
        """The task's argument check (Celery's `__header__`), or None: not registered here, `typing=False`, or a
        task class without one (as `Task.apply_async`, which then checks nothing either)."""
        try:
            return self._headers[name]
        except KeyError:
            task = self.app.tasks.get(name)
            header = getattr(task, "__header__", None) if task is not None and task.typing else None
            self._headers[name] = header
            return header

    def __call__(self, sig: Signature, *before: Any) -> None:
        """Raise `TypeError` if `sig` (a chain: its first task) would be refused by `apply_async`; `before` goes
        before its own arguments (a successor's outcome) unless the signature is immutable, as `_merge` does.
        A group or chord (a chain may begin with one) is not checked here: its tasks are, when they are published."""
        first = maybe_signature(chain_tasks(sig)[0], app=self.app) if is_chain(sig) else sig
        if type(first) is not Signature:
            return
        header = self.header(first.task)
        if header is None:
            return
        args = first.args
        if before and not first.immutable:
            args = (*before, *args)
        header(*args, **first.kwargs)


def _ensure_connection(app: Celery, prod: Producer) -> None:
    """Connect with the app's publish retry policy, as `apply_async` would, before anything is built.

    A pooled connection the broker closed while it sat idle (a RabbitMQ restart) is replaced first: the fast
    path publishes without kombu's retry, so a stale connection would fail the call's first chunk (left to the
    relay) even though the broker is back.
    """
    conn = prod.connection
    if _peer_closed(conn):
        logger.info("the broker closed a pooled connection (restarted?): reconnecting before publishing")
        conn.collect()
        prod.revive(conn.default_channel)
    if app.conf.task_publish_retry:
        policy = dict(app.conf.task_publish_retry_policy or {})
        conn.ensure_connection(
            max_retries=policy.get("max_retries", 3),
            interval_start=policy.get("interval_start", 0),
            interval_step=policy.get("interval_step", 0.2),
            interval_max=policy.get("interval_max", 1),
        )
    prod.channel  # noqa: B018 - binds the producer's channel (connecting if need be)


def _peer_closed(conn: Any) -> bool:
    """True if the broker closed this idle AMQP connection (end of stream, or a connection.close it sent).

    Checked without waiting: a socket with nothing to read is taken as alive. Only py-amqp connections are
    checked: redis-py reconnects a broken pooled connection on its own.
    """
    raw = getattr(conn, "_connection", None)  # not `conn.connection`, which would connect
    transport = getattr(raw, "transport", None)
    sock = getattr(transport, "sock", None)
    if raw is None or sock is None or not hasattr(raw, "drain_events"):
        return False
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        if not readable:
            return False
        # Something to read: confirms of an earlier call (handled by their callbacks), or the broker's goodbye.
        raw.drain_events(timeout=0.01)  # not 0: py-amqp spins on EAGAIN in a non-blocking socket
    except (TimeoutError, BlockingIOError):
        return False  # a partial frame or nothing more: alive
    except Exception:  # noqa: BLE001 - end of stream, connection.close, a reset: every one means "reconnect"
        return True
    return False


def _has_quorum_queues(app: Celery, driver: str) -> bool:
    return bool(detect_quorum_queues(app, driver)[0])


def publish_successor(
    app: Celery,
    prod: Producer,
    batch_id: uuid.UUID,
    step: str,
    task_id: str,
    then: Signature,
    outcome: Any,
    chord: str | None = None,
) -> None:
    """Publish the successor with the outcome as its first argument, as a chord body gets the header results (a
    `celery_fanin.chord`'s body: the results themselves, or `chord`, why its run guard must fail it).

    Built like a child's message when it can be (no result-backend subscription for a result this process never
    reads, no per-call routing), else through Celery's own `apply_async`.
    """
    marker = _successor_marker(batch_id, step, chord)
    eager = is_eager(app)
    confirms = None
    if not eager and publish_mode(prod) == "confirm":
        # RabbitMQ: on the confirm channel, and only returned once the broker confirmed it, so that the caller
        # records it as sent only then (a refusal or no answer raises: the outbox row stays pending).
        _ensure_connection(app, prod)
        confirms = confirm_channel(prod, amqp_frames_enabled(app))
    first = confirms.sent + 1 if confirms is not None else 1
    try:
        _publish_successor(app, prod, confirms, batch_id, task_id, then, outcome, marker)
        if confirms is not None:
            confirms.wait(since=first)
    except BaseException:
        if confirms is not None:
            confirms.discard()
        raise


@dataclass(frozen=True)
class Built:
    """One message as the fast path builds it (`_Builder.build`), before anything publishes it."""

    route: _Route
    headers: dict[str, Any]
    body: Any
    properties: dict[str, Any]


def successor_message(
    app: Celery, batch_id: uuid.UUID, step: str, task_id: str, then: Signature, outcome: Any, chord: str | None = None
) -> Built | None:
    """The successor's message exactly as `publish_successor` would send it on its fast path, not sent (for a run
    in this process: `dispatch.inline`), or None where Celery's own `apply_async` would build it."""
    if not bulk_publish_enabled(app):
        return None
    marker = _successor_marker(batch_id, step, chord)
    try:
        return Built(
            *_Builder(app, str(batch_id)).build(0, task_id, _as_successor(then), first_arg=outcome, marker=marker)
        )
    except _Unsupported:
        return None


def _successor_marker(batch_id: uuid.UUID, step: str, chord: str | None) -> dict[str, Any]:
    marker = {HEADER_SUCCESSOR: str(batch_id), HEADER_STEP: step}
    if chord is not None:
        marker[HEADER_CHORD] = chord
    return marker


def _as_successor(then: Signature) -> Signature:
    """The parent a chain's freeze stored is the task before the fan-in; the successor is the child of the task that
    finished the batch, when one publishes it, as a chord's body is of the header task that completed it."""
    then = then.clone()
    then.options.pop("parent_id", None)
    return then


def _publish_successor(
    app: Celery,
    prod: Producer,
    confirms: ConfirmChannel | None,
    batch_id: uuid.UUID,
    task_id: str,
    then: Signature,
    outcome: Any,
    marker: dict[str, Any],
) -> None:
    target = confirms.producer if confirms is not None else prod
    then = _as_successor(then)
    if bulk_publish_enabled(app):
        builder = _Builder(app, str(batch_id))
        try:
            built = builder.build(0, task_id, then, first_arg=outcome, marker=marker)
        except _Unsupported:
            pass
        else:
            _ensure_connection(app, prod)
            _send(builder, prod, target, then.task, *built, frames=confirms.frames if confirms else None)
            if confirms is not None:
                confirms.sent += 1
            return
    written = confirms.published if confirms is not None else 0
    apply_async(
        then,
        (outcome,),
        task_id=task_id,
        producer=target,
        headers={**(then.options.get("headers") or {}), **marker},
        add_to_parent=False,
        **({"retry": False} if confirms is not None else {}),
    )
    if confirms is not None:
        confirms.sent += confirms.published - written
