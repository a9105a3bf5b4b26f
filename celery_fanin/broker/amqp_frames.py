"""The AMQP frames py-amqp writes for ``basic_publish``, held and written many messages at a time
(docs/concepts/publishing.md).
"""

from __future__ import annotations

import re
from struct import Struct

import amqp
from amqp import Channel, Message
from amqp.exceptions import RecoverableConnectionError
from amqp.serialization import dumps

from .amqp_properties import PropertiesEncoder

# The py-amqp releases this module (and amqp_properties) is tested against, byte for byte:
# tests/broker/test_amqp_frames.py runs on 5.1.1, 5.2.0, 5.3.1, 5.4.0 and the installed one (.ci/amqp-versions). It
# leans on their internals (`Message._serialize_properties`, `Message.PROPERTIES`, `serialization.dumps`, the
# connection's `frame_max`, `transport.write` and `bytes_sent`), so outside this range (a py-amqp 5.5 not yet tested)
# the confirm channel writes through py-amqp's own `basic_publish` instead: slower, the same messages. pyproject.toml
# allows the wider range kombu does (amqp>=5.1.1,<6), which the fallback covers.
TESTED_VERSIONS = ((5, 1, 1), (5, 5, 0))  # from, to (excluded)


def supported(version: str) -> bool:
    """Whether py-amqp `version` is within the tested range (pre-releases and local tags count as their release)."""
    found = re.match(r"(\d+)\.(\d+)\.(\d+)", version)
    if found is None:
        return False
    release = tuple(int(part) for part in found.groups())
    return TESTED_VERSIONS[0] <= release < TESTED_VERSIONS[1]


SUPPORTED = supported(amqp.__version__)

# basic.publish is method 40 of class 60; a frame is its type, channel, payload size, the payload and 0xCE.
_BASIC_CLASS = 60
_PUBLISH_METHOD = Struct(">HH").pack(_BASIC_CLASS, 40)
_FRAME_HEAD = Struct(">BHI").pack
_CONTENT_HEAD = Struct(">HHQ").pack
_FRAME_END = b"\xce"
_METHOD, _HEADER, _BODY = 1, 2, 3
# A frame's head (7 bytes) and end (1 byte): what py-amqp subtracts from frame_max for a body frame's payload.
_FRAME_OVERHEAD = 8

# Bytes held before they are written without waiting for `flush`: the broker starts on a batch's first messages
# while the rest are encoded, and large bodies do not pile up in memory.
FLUSH_BYTES = 256 * 1024


class FrameBuffer:
    """Stands in for one channel's ``basic_publish``: lays out each message's frames and holds them until `flush`."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self._chunks: list[bytes] = []
        self._size = 0
        self._methods: dict[tuple[str, str, bool, bool], bytes] = {}
        self._properties = PropertiesEncoder()

    def publish(
        self,
        msg: Message,
        exchange: str = "",
        routing_key: str = "",
        mandatory: bool = False,
        immediate: bool = False,
        timeout: float | None = None,
        confirm_timeout: float | None = None,
    ) -> None:
        """Lay out `msg` as ``Channel.basic_publish`` would send it; written at the next `flush` (or sooner)."""
        channel_id = self.channel.channel_id
        key = (exchange, routing_key, mandatory, immediate)
        method = self._methods.get(key)
        if method is None:  # the method frame is the same for every message to one exchange and routing key
            payload = _PUBLISH_METHOD + dumps("Bssbb", (0, exchange, routing_key, mandatory, immediate))
            method = self._methods[key] = _FRAME_HEAD(_METHOD, channel_id, len(payload)) + payload + _FRAME_END
        body = msg.body
        if isinstance(body, str):  # as py-amqp: a text body is sent encoded, and says how
            body = body.encode(msg.properties.setdefault("content_encoding", "utf-8"))
        header = _CONTENT_HEAD(_BASIC_CLASS, 0, len(body)) + self._properties.encode(msg)
        chunks = self._chunks
        chunks += (method, _FRAME_HEAD(_HEADER, channel_id, len(header)), header, _FRAME_END)
        size = len(method) + len(header) + _FRAME_OVERHEAD
        step = self.channel.connection.frame_max - _FRAME_OVERHEAD
        for offset in range(0, len(body), step):  # no body frame for an empty body
            piece = body[offset : offset + step]
            chunks += (_FRAME_HEAD(_BODY, channel_id, len(piece)), piece, _FRAME_END)
            size += len(piece) + _FRAME_OVERHEAD
        self._size += size
        if self._size >= FLUSH_BYTES:
            self.flush()

    def flush(self) -> None:
        """Write every frame held so far to the connection, in one write."""
        if not self._chunks:
            return
        data = b"".join(self._chunks)
        self.clear()
        connection = self.channel.connection
        if connection is None or connection.transport is None:
            raise RecoverableConnectionError("basic_publish: connection closed")
        connection.transport.write(data)
        connection.bytes_sent += 1  # what py-amqp's heartbeat check reads as "the connection is in use"

    def clear(self) -> None:
        """Drop what was not written (the channel is being given up)."""
        self._chunks = []
        self._size = 0
