"""Signatures and results as stored bytes: encoded with the serializer their messages use, decoded for the app."""

from __future__ import annotations

from typing import Any

from celery import Celery
from celery.canvas import Signature
from kombu.exceptions import EncodeError
from kombu.serialization import dumps, loads, prepare_accept_content, registry
from kombu.utils import json as kombu_json

from .store.batches import Encoded

# One instance for every message: `json.dumps(value, cls=JSONEncoder)`, which kombu's JSON serializer calls, builds
# an encoder with these same (default) arguments for each value.
_JSON_ENCODER = kombu_json.JSONEncoder()


def serialize(data: Any, serializer: str) -> tuple[str, str, str | bytes]:
    """``kombu.serialization.dumps(data, serializer=serializer)``: the same content type, encoding and payload.

    Why: a batch encodes two values per child (its stored signature and its message body), and for JSON kombu's
    path costs more than the encoding itself (a context manager, a dict of keyword arguments, a new encoder per
    value). JSON as kombu registers it is encoded here with one reused encoder; any other serializer, or a JSON
    serializer registered over kombu's, goes through kombu.
    """
    codec = registry._encoders.get(serializer) if serializer == "json" else None
    if codec is None or codec.encoder is not kombu_json.dumps:
        content_type, content_encoding, payload = dumps(data, serializer=serializer)
        return content_type, content_encoding, payload
    try:
        payload = _JSON_ENCODER.encode(data)
    except Exception as exc:  # as kombu's `dumps` wraps its encoder's errors
        raise EncodeError(exc) from exc
    return codec.content_type, codec.content_encoding, payload


def encode_signature(app: Celery, sig: Signature, default_serializer: str | None = None) -> Encoded:
    """Encode a signature with the serializer its messages will use, so a value it cannot carry fails now.

    `default_serializer` is the app's ``task_serializer``, for a caller encoding many signatures: reading the
    app's configuration costs more than a small signature's JSON."""
    serializer = sig.options.get("serializer") or default_serializer or app.conf.task_serializer
    content_type, content_encoding, body = serialize(dict(sig), serializer)
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
