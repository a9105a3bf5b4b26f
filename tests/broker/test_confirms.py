"""`broker.confirms.ConfirmChannel`'s bookkeeping of RabbitMQ's publisher confirms, against a scripted broker.

The producer keeps several chunks in flight on one confirm channel, so confirms for a later chunk's messages
arrive while an earlier chunk is waited for. A refused message (basic.nack) must fail the chunk that holds it and
no other: a chunk wrongly failed is published twice, a chunk wrongly passed is recorded as published and lost.
The real broker path is covered in tests/broker/test_publish.py; a broker that nacks on demand is not available there.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from kombu.exceptions import OperationalError

from celery_fanin.broker.confirms import ConfirmChannel, Unconfirmed

Event = Callable[[ConfirmChannel], None]


def ack(tag: int, multiple: bool = False) -> Event:
    return lambda confirms: confirms._on_ack(tag, multiple)


def nack(tag: int, multiple: bool = False) -> Event:
    return lambda confirms: confirms._on_nack(tag, multiple)


class _Connection:
    """Plays the broker: each `drain_events` delivers the next scripted confirm, then times out."""

    def __init__(self) -> None:
        self.script: list[Event] = []
        self.confirms: ConfirmChannel | None = None
        self.drains = 0

    def drain_events(self, timeout: float) -> None:
        self.drains += 1
        if not self.script:
            raise TimeoutError
        assert self.confirms is not None
        self.script.pop(0)(self.confirms)


class _Channel:
    def __init__(self) -> None:
        self.connection = _Connection()
        self.closed = False

    def close(self) -> None:
        self.closed = True


class _Frames:
    def flush(self) -> None:
        pass

    def clear(self) -> None:
        pass


def confirm_channel(sent: int, *script: Event) -> ConfirmChannel:
    """A ConfirmChannel that has sent `sent` messages, and whose broker will answer with `script`."""
    confirms = ConfirmChannel.__new__(ConfirmChannel)  # no connection: only the bookkeeping is under test
    channel = _Channel()
    confirms.channel = channel  # type: ignore[assignment]
    confirms.frames = _Frames()  # type: ignore[assignment]
    confirms.sent, confirms.floor = sent, 0
    confirms._acked, confirms._nacked, confirms._discarded = set(), set(), False
    channel.connection.confirms = confirms
    channel.connection.script = list(script)
    return confirms


def test_a_nack_for_a_later_chunk_fails_that_chunk_not_the_one_waited_for() -> None:
    # Chunk A holds tags 1-3, chunk B 4-6; the broker refuses 5 while A is waited for.
    confirms = confirm_channel(6, ack(2, multiple=True), nack(5), ack(3), ack(4), ack(6))
    a, b = Unconfirmed(confirms, since=1, upto=3), Unconfirmed(confirms, since=4, upto=6)
    a.wait()
    with pytest.raises(OperationalError, match="refused 1 of the messages"):
        b.wait()
    assert confirms._discarded, "a failed chunk gives up the channel: its count is no longer trusted"


def test_a_nack_in_the_chunk_waited_for_fails_it_even_when_it_arrives_with_later_acks() -> None:
    confirms = confirm_channel(6, ack(1), nack(2), ack(6, multiple=True))
    with pytest.raises(OperationalError, match="refused 1 of the messages"):
        Unconfirmed(confirms, since=1, upto=3).wait()


def test_a_multiple_nack_counts_only_the_messages_not_acked_before() -> None:
    # Tag 3 was acked on its own; "nack up to 4, multiple" then refuses 1, 2 and 4.
    confirms = confirm_channel(4, ack(3), nack(4, multiple=True))
    with pytest.raises(OperationalError, match="refused 3 of the messages"):
        confirms.wait(since=1)


def test_every_message_acked_passes_and_a_refusal_is_raised_once() -> None:
    confirms = confirm_channel(3, ack(3, multiple=True))
    confirms.wait(since=1)
    assert confirms.floor == 3
    confirms.sent = 5
    confirms.channel.connection.script = [nack(4), ack(5)]  # type: ignore[attr-defined]
    with pytest.raises(OperationalError):
        confirms.wait(since=4)
    confirms.wait(since=4)  # already raised: not a second time (the chunk was given to the relay)


def test_a_wait_on_a_discarded_channel_fails_at_once_instead_of_timing_out() -> None:
    confirms = confirm_channel(6, ack(3, multiple=True))
    confirms.wait(upto=3, since=1)
    confirms.discard()
    drains = confirms.channel.connection.drains  # type: ignore[attr-defined]
    with pytest.raises(OperationalError, match="closed after an earlier failure"):
        confirms.wait(upto=6, since=4, timeout=30)
    assert confirms.channel.connection.drains == drains  # type: ignore[attr-defined]
    confirms.wait(upto=3, since=1)  # what was confirmed before stays confirmed
