"""RabbitMQ publisher confirms: a confirm channel written many messages at a time, and the confirms to wait for."""

from __future__ import annotations

import logging
import time
from typing import Any

from kombu import Producer
from kombu.exceptions import OperationalError

from .amqp_frames import FrameBuffer

logger = logging.getLogger("celery_fanin.publish")

# Seconds to wait for RabbitMQ's confirms of one window before giving up (the caller then leaves the chunk to the
# relay, which republishes it: a child published twice is counted once).
CONFIRM_TIMEOUT = 30.0


class Unconfirmed:
    """Messages `publish_children` wrote to RabbitMQ without waiting for the broker's confirms.

    `wait` returns once the broker confirmed all of them and raises if it refused one or did not answer; only then
    may they be recorded as published. Empty (nothing to wait for) on every other broker: there `publish_children`
    returns once the messages are on the broker. The producer they were published with must stay acquired until
    `wait` returns (the confirms arrive on its connection).
    """

    def __init__(self, confirms: ConfirmChannel | None = None, since: int = 1, upto: int = 0) -> None:
        self._confirms = confirms
        self._since = since
        self._upto = upto

    @property
    def pending(self) -> bool:
        """Whether there are confirms to wait for."""
        return self._confirms is not None

    def wait(self) -> None:
        confirms, self._confirms = self._confirms, None
        if confirms is None:
            return
        try:
            confirms.wait(upto=self._upto, since=self._since)
        except BaseException:
            confirms.discard()
            raise


class ConfirmChannel:
    """A channel of the producer's AMQP connection in publisher-confirm mode, written without waiting per message.

    Delivery tags count from 1 on a channel put in confirm mode; the broker acks them (possibly several at once)
    as it takes responsibility for the messages. `wait` drains the connection until every message sent so far is
    acked, and raises if one was nacked, the channel was closed by the broker, or `CONFIRM_TIMEOUT` passed.

    Several calls' messages can be in flight on the channel at once (the producer's chunks), and the confirms of a
    later call's messages can arrive while an earlier call waits: a nack is therefore kept by delivery tag and
    raised by the wait whose range holds it, so that a refused message fails its own chunk and no other.
    """

    def __init__(self, prod: Producer) -> None:
        conn = prod.connection
        self.transport_connection = conn.connection
        self.channel = conn.channel()
        self.channel.confirm_select()
        # Instead of py-amqp's write per message (which, with `confirm_publish`, also waits for each message's
        # ack): the same frames, held and written a stretch at a time, flushed before every wait.
        self.frames = FrameBuffer(self.channel)
        self.channel.basic_publish = self._basic_publish
        self.channel.events["basic_ack"].add(self._on_ack)
        self.channel.events["basic_nack"].add(self._on_nack)
        self.producer = Producer(self.channel, exchange=prod.exchange, serializer=prod.serializer, auto_declare=False)
        self.sent = 0
        self.published = 0  # messages kombu's `Producer.publish` wrote on the channel (Celery's own path)
        self.floor = 0  # every tag <= floor is acked
        self._acked: set[int] = set()
        self._nacked: set[int] = set()  # tags refused and not yet raised by the wait whose range holds them
        self._discarded = False

    def _basic_publish(self, *args: Any, **kwargs: Any) -> None:
        """The channel's ``basic_publish``: counts the message (a delivery tag) and hands it to the frames."""
        self.published += 1
        self.frames.publish(*args, **kwargs)

    @property
    def usable(self) -> bool:
        return (
            not self._discarded and bool(self.channel.is_open) and self.channel.connection is self.transport_connection
        )

    def _on_ack(self, tag: int, multiple: bool) -> None:
        if multiple:
            self.floor = max(self.floor, tag)
        else:
            self._acked.add(tag)
        while self.floor + 1 in self._acked:
            self.floor += 1
            self._acked.discard(self.floor)
        if multiple and self._acked:
            self._acked = {t for t in self._acked if t > self.floor}

    def _on_nack(self, tag: int, multiple: bool) -> None:
        # `multiple`: every tag up to this one that was not confirmed yet (the rare case: nacks are broker errors).
        first = self.floor + 1 if multiple else tag
        self._nacked.update(t for t in range(first, tag + 1) if t not in self._acked)
        self._on_ack(tag, multiple)

    def wait(self, upto: int | None = None, since: int = 1, timeout: float = CONFIRM_TIMEOUT) -> None:
        """Drain acks until every message up to `upto` (default: all sent) is confirmed; raise if one from `since`
        to `upto` was refused."""
        target = self.sent if upto is None else upto
        if self._discarded and self.floor < target:
            # Closed after an earlier failure: these confirms will never come (the channel's count is lost).
            raise OperationalError("the confirm channel was closed after an earlier failure; messages unconfirmed")
        self.frames.flush()
        deadline = time.monotonic() + timeout
        connection = self.channel.connection
        while self.floor < target:
            left = deadline - time.monotonic()
            if left <= 0:
                raise OperationalError(f"RabbitMQ did not confirm {self.sent - self.floor} messages in {timeout}s")
            try:
                connection.drain_events(timeout=min(left, 1.0))
            except TimeoutError:
                continue
        refused = {t for t in self._nacked if since <= t <= target}
        if refused:
            self._nacked -= refused
            raise OperationalError(f"RabbitMQ refused {len(refused)} of the messages published (basic.nack)")

    def discard(self) -> None:
        """After a failure the channel's count is unknown: close it; the next call opens a fresh one."""
        self._discarded = True
        self.frames.clear()
        try:
            self.channel.close()
        except Exception:  # noqa: BLE001 - the channel may be gone with its connection already
            logger.debug("closing the confirm channel failed", exc_info=True)


def confirm_channel(prod: Producer) -> ConfirmChannel:
    """The connection's confirm channel, opened on first use and reused by later calls on the same connection."""
    conn = prod.connection
    existing: ConfirmChannel | None = getattr(conn, "_fanin_confirms", None)
    if existing is not None and existing.usable:  # possibly with an earlier call's messages still unconfirmed
        return existing
    confirms = ConfirmChannel(prod)
    conn._fanin_confirms = confirms
    return confirms
