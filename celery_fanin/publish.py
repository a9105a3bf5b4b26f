"""Turning stored rows into broker messages; shared by the producer's fast path and the relay.

Children and successors are published as ordinary Celery task messages with pre-assigned task ids and a few
custom headers that the worker hooks read: ``fanin_batch`` and ``fanin_index`` on a child, ``fanin_successor`` and
``fanin_step`` on a successor. Custom headers reach the task as ``task.request.<name>`` and survive retries.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from celery import Celery
from celery.canvas import Signature
from kombu import Producer
from kombu.serialization import dumps, loads, prepare_accept_content

from .store.batches import Encoded

HEADER_BATCH = "fanin_batch"
HEADER_INDEX = "fanin_index"
HEADER_SUCCESSOR = "fanin_successor"
HEADER_STEP = "fanin_step"


def encode_signature(app: Celery, sig: Signature) -> Encoded:
    """Encode a signature with the serializer its messages will use, so a value it cannot carry fails now."""
    serializer = sig.options.get("serializer") or app.conf.task_serializer
    content_type, content_encoding, body = dumps(dict(sig), serializer=serializer)
    if isinstance(body, str):
        body = body.encode(content_encoding or "utf-8")
    return Encoded(content_type, content_encoding, body)


def decode_signature(app: Celery, encoded: Encoded) -> Signature:
    accept = prepare_accept_content(app.conf.accept_content)
    data = loads(encoded.body, encoded.content_type, encoded.content_encoding, accept=accept)
    return app.signature(data)


def encode_result(app: Celery, value: Any) -> Encoded:
    content_type, content_encoding, body = dumps(value, serializer=app.conf.result_serializer)
    if isinstance(body, str):
        body = body.encode(content_encoding or "utf-8")
    return Encoded(content_type, content_encoding, body)


def decode_result(app: Celery, encoded: Encoded) -> Any:
    accept = prepare_accept_content(app.conf.result_accept_content or app.conf.accept_content)
    return loads(encoded.body, encoded.content_type, encoded.content_encoding, accept=accept)


@contextmanager
def producer(app: Celery) -> Iterator[Producer]:
    """One producer for many messages, pipelined where kombu's transport supports batching."""
    with app.producer_or_acquire() as prod:
        batch = getattr(prod, "batch", None)  # kombu >= 5.7
        if batch is None:
            yield prod
        else:
            with batch(1000):
                yield prod


def publish_children(
    app: Celery, prod: Producer, batch_id: uuid.UUID, children: Iterable[tuple[int, str, Signature]]
) -> None:
    """Publish children (index, task id, signature) as ordinary task messages carrying the batch headers."""
    bid = str(batch_id)
    for idx, task_id, sig in children:
        sig.apply_async(
            task_id=task_id,
            producer=prod,
            headers={**(sig.options.get("headers") or {}), HEADER_BATCH: bid, HEADER_INDEX: idx},
            add_to_parent=False,
        )


def publish_successor(
    app: Celery, prod: Producer, batch_id: uuid.UUID, step: str, task_id: str, then: Signature, outcome: dict[str, Any]
) -> None:
    """Publish the successor with the outcome as its first argument, as a chord body gets the header results."""
    then.apply_async(
        args=(outcome,),
        task_id=task_id,
        producer=prod,
        headers={**(then.options.get("headers") or {}), HEADER_SUCCESSOR: str(batch_id), HEADER_STEP: step},
        add_to_parent=False,
    )
