"""`amqp_frames.FrameBuffer` writes, byte for byte, what py-amqp's own frame writer writes for the same publish."""

from __future__ import annotations

import copy
import random
import struct
import uuid
from datetime import datetime, timezone
from decimal import Decimal
from typing import Any

import pytest
from amqp import Message, spec
from amqp.exceptions import RecoverableConnectionError
from amqp.method_framing import frame_writer
from amqp.serialization import dumps
from celery import Celery
from kombu import Producer
from kombu.exceptions import EncodeError
from kombu.serialization import dumps as kombu_dumps
from kombu.transport.pyamqp import Channel as PyAmqpChannel

from celery_fanin import codec
from celery_fanin.broker import amqp_frames, amqp_properties, publish


class _Transport:
    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def write(self, data: Any) -> None:
        self.writes.append(bytes(data))  # py-amqp hands over a view of a buffer it reuses


class _Connection:
    def __init__(self, frame_max: int) -> None:
        self.frame_max = frame_max
        self.bytes_sent = 0
        self.transport = _Transport()


class _Channel:
    def __init__(self, frame_max: int = 131072, channel_id: int = 3) -> None:
        self.channel_id = channel_id
        self.connection = _Connection(frame_max)


def _py_amqp_bytes(msg: Message, frame_max: int, exchange: str, routing_key: str, mandatory: bool) -> bytes:
    """What ``Channel.basic_publish`` hands to py-amqp's frame writer (``send_method``), captured."""
    conn = _Connection(frame_max)
    args = dumps("Bssbb", (0, exchange, routing_key, mandatory, False))
    frame_writer(conn, conn.transport)(1, 3, spec.Basic.Publish, args, msg)
    return b"".join(conn.transport.writes)


def _celery_message(i: int) -> Message:
    """A child's message as the fast path builds it, turned into an ``amqp.Message`` as kombu does."""
    app = Celery("tests.frames", broker="memory://", set_as_current=False)
    sig = app.signature("some.task", args=(i, "ünïcode", [1, 2]), kwargs={"k": {"nested": True}})
    route, headers, body, properties = publish._Builder(app, "batch").build(i, str(uuid.uuid4()), sig)
    return Message(
        f'[[{i}, "x"], {{}}, {{}}]',
        content_type="application/json",
        content_encoding="utf-8",
        application_headers=headers,
        **{k: v for k, v in properties.items() if v is not None},
    )


def _messages() -> list[tuple[str, Message]]:
    when = datetime(2026, 11, 30, 12, 0, tzinfo=timezone.utc)
    odd_headers = {
        "s": "é",
        "b": True,
        "i": 1,
        "big": 2**40,
        "f": 1.5,
        "d": Decimal("1.25"),
        "t": when,
        "n": None,
        "l": [1, "a", None, [True]],
        "m": {"x": {"y": 1}},
        "bytes": b"\x00\x01",
    }
    return [
        ("celery task", _celery_message(7)),
        ("text body, unicode", Message("héllo wörld")),
        (
            "bytes body, every property",
            Message(
                b"\x00" * 50,
                content_type="application/x-test",
                content_encoding="binary",
                application_headers=odd_headers,
                delivery_mode=2,
                priority=9,
                correlation_id="c-1",
                reply_to="r",
                expiration="60000",
                message_id="m-1",
                timestamp=1700000000,
                type="t",
                user_id="guest",
                app_id="a",
                cluster_id="c",
            ),
        ),
        ("empty body", Message(b"", application_headers={"x": 1})),
        ("body over frame_max", Message(b"0123456789" * 1000, application_headers={"k": "v"})),
        ("body exactly one frame", Message(b"a" * (4096 - 8))),
    ]


@pytest.mark.parametrize("frame_max", [131072, 4096])
@pytest.mark.parametrize(("label", "make"), [(label, i) for i, (label, _) in enumerate(_messages())])
def test_frames_match_py_amqp(label: str, make: int, frame_max: int) -> None:
    ours, theirs = _messages()[make][1], _messages()[make][1]
    theirs.properties = dict(ours.properties)
    if "application_headers" in ours.properties:
        theirs.properties["application_headers"] = dict(ours.properties["application_headers"])
    channel = _Channel(frame_max)
    buffer = amqp_frames.FrameBuffer(channel)  # type: ignore[arg-type]
    buffer.publish(ours, exchange="ex", routing_key="rk", mandatory=True)
    buffer.flush()
    assert b"".join(channel.connection.transport.writes) == _py_amqp_bytes(theirs, frame_max, "ex", "rk", True)
    assert ours.properties == theirs.properties  # a text body gets its content_encoding on both sides


def test_many_messages_are_one_write_until_the_size_bound() -> None:
    channel = _Channel()
    buffer = amqp_frames.FrameBuffer(channel)  # type: ignore[arg-type]
    expected = b""
    for i in range(20):
        msg = _celery_message(i)
        expected += _py_amqp_bytes(Message(msg.body, **msg.properties), 131072, "", "q", False)
        buffer.publish(msg, routing_key="q")
    assert channel.connection.transport.writes == []  # held
    buffer.flush()
    assert channel.connection.transport.writes == [expected]
    buffer.flush()  # nothing held: nothing written
    assert len(channel.connection.transport.writes) == 1

    big = Message(b"x" * (amqp_frames.FLUSH_BYTES // 2 + 1))
    buffer.publish(big, routing_key="q")
    assert len(channel.connection.transport.writes) == 1
    buffer.publish(big, routing_key="q")  # past the bound: written without waiting for flush
    assert len(channel.connection.transport.writes) == 2


def test_cleared_frames_are_never_written_and_a_closed_connection_raises() -> None:
    channel = _Channel()
    buffer = amqp_frames.FrameBuffer(channel)  # type: ignore[arg-type]
    buffer.publish(Message(b"dropped"), routing_key="q")
    buffer.clear()
    buffer.flush()
    assert channel.connection.transport.writes == []
    buffer.publish(Message(b"kept"), routing_key="q")
    channel.connection = None  # type: ignore[assignment]
    with pytest.raises(RecoverableConnectionError):
        buffer.flush()


# --- a stream of messages: what is reused from one message to the next must never change the bytes ----------------


class _Text(str):
    pass


def _tripwires() -> list[dict[str, Any]]:
    """Header tables that differ from the one before in ways equality alone would miss."""
    base = {
        "lang": "py",
        "task": "t",
        "id": "1",
        "n": 1,
        "flag": True,
        "timelimit": [None, None],
        "stamps": {},
        "f": 0.0,
        "big": 2**31 - 1,
    }
    steps: list[dict[str, Any]] = [
        {},
        {"id": "2"},
        {"id": "3"},
        {"n": True},
        {"n": 1, "flag": 1},
        {"flag": True, "timelimit": [None, 0]},
        {"timelimit": [None, False]},
        {"timelimit": (None, False)},
        {"stamps": {"k": 1}},
        {"stamps": {"k": True}},
        {"stamps": {"k": True, "j": "x"}},
        {"stamps": {"j": "x", "k": True}},
        {"f": -0.0},
        {"f": float("nan")},
        {"big": 2**31},
        {"big": -(2**31)},
        {"task": "é"},
        {"task": _Text("é")},
        {"lang": b"py"},
        {"id": None},
        {"id": "4", "extra": "added"},
        {"id": "5"},
    ]
    tables, current = [], dict(base)
    for change in steps:
        current = {**current, **change}
        tables.append(dict(current))
    tables.append(dict(reversed(list(current.items()))))  # the same items in another order
    tables.append({k: v for k, v in current.items() if k != "extra"})
    return tables


def test_a_stream_of_tripwires_encodes_as_py_amqp() -> None:
    encoder = amqp_properties.PropertiesEncoder()
    for i, table in enumerate(_tripwires()):
        msg = Message(
            b"x",
            content_type="application/json",
            application_headers=table,
            correlation_id=str(i),
            delivery_mode=2 if i % 3 else 1,
            priority=i % 2 or None,
        )
        assert encoder.encode(msg) == msg._serialize_properties(), (i, table)


def test_a_random_stream_encodes_as_py_amqp() -> None:
    """Seeded: headers drawn from pools of values of look-alike types, most repeated, some changing each time."""
    rng = random.Random(20261130)
    pools: list[list[Any]] = [
        ["a", "é", _Text("a")],
        [0, 1, True, False, None, 2**40],
        [[None, None], [0, None], [False, None], (0, None)],
        [{}, {"x": 1}, {"x": True}],
        [1.0, -0.0, 0.0],
    ]
    keys = [f"k{i}" for i in range(12)]
    encoder = amqp_properties.PropertiesEncoder()
    table = {k: rng.choice(rng.choice(pools)) for k in keys}
    for i in range(3000):
        if rng.random() < 0.3:  # most messages repeat most headers, as a batch's children do
            key = rng.choice(keys)
            table[key] = rng.choice(rng.choice(pools))
        table["id"] = str(uuid.uuid4())
        if rng.random() < 0.02:
            table = dict(rng.sample(list(table.items()), len(table)))  # a new key order
        msg = Message(
            b"",
            application_headers=dict(table),
            correlation_id=table["id"],
            content_type=rng.choice(["application/json", "text/plain"]),
        )
        assert encoder.encode(msg) == msg._serialize_properties(), (i, table)


def test_properties_py_amqp_would_refuse_are_refused_alike() -> None:
    for properties in (
        {"priority": 300},
        {"correlation_id": 5},
        {"application_headers": {"k": object()}},
        {"application_headers": {"x" * 256: 1}},
    ):
        msg = Message(b"", **properties)
        with pytest.raises(Exception) as theirs:
            msg._serialize_properties()
        with pytest.raises(type(theirs.value)):
            amqp_properties.PropertiesEncoder().encode(msg)


@pytest.mark.parametrize("value", ["", "4", "é" * 127, "x" * 255, "\ud800", b"raw"], ids=repr)
def test_shortstr_properties_encode_as_py_amqp(value: str | bytes) -> None:
    """A changing shortstr (correlation_id) is written directly: the same bytes as py-amqp, one message after
    another (the second repeats it, the third changes it back)."""
    encoder = amqp_properties.PropertiesEncoder()
    for correlation_id in ("first", value, value, "last"):
        msg = Message(b"x", content_type="application/json", correlation_id=correlation_id, reply_to=value)
        assert encoder.encode(msg) == msg._serialize_properties(), correlation_id


def test_a_shortstr_too_long_is_refused_as_py_amqp_refuses_it() -> None:
    msg = Message(b"x", correlation_id="x" * 256)
    with pytest.raises(struct.error):
        msg._serialize_properties()
    with pytest.raises(struct.error):
        amqp_properties.PropertiesEncoder().encode(msg)


class _KombuChannel(_Channel):
    """Enough of a kombu py-amqp channel for `kombu.Producer.publish`: its `prepare_message`, our frames."""

    prepare_message = PyAmqpChannel.prepare_message

    def __init__(self) -> None:
        super().__init__()
        self.basic_publish = amqp_frames.FrameBuffer(self).publish  # type: ignore[arg-type]


def _wire(built: tuple[Any, ...], direct: bool, name: str = "some.task") -> bytes:
    """The bytes one built message becomes: through kombu's `Producer.publish`, or straight to the frames."""
    route, headers, body, properties = copy.deepcopy(built)
    channel = _KombuChannel()
    producer = Producer(channel, auto_declare=False)
    frames = channel.basic_publish.__self__
    builder = publish._Builder(Celery("tests.frames", broker="memory://", set_as_current=False), "batch")
    builder.declared.update(id(entity) for entity in route.declare)  # nothing to declare on this stand-in
    publish._send(
        builder, producer, producer, name, route, headers, body, properties, frames=frames if direct else None
    )
    frames.flush()
    return b"".join(channel.connection.transport.writes)


OPTIONS = [
    {},
    {"compression": "zlib"},
    {"serializer": "pickle"},
    {"priority": 3, "delivery_mode": 1},
    {"delivery_mode": "transient"},
    {"expires": 600},
    {"exchange": "ex", "routing_key": "rk"},
]


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(sorted(o)) or "json")
def test_a_message_sent_straight_to_the_frames_is_what_kombu_sends(options: dict[str, Any]) -> None:
    """On RabbitMQ the fast path does kombu's `Producer.publish` itself (`broker.publish._publish_frames`), encoding the
    body with `codec.serialize`: the frames on the wire are the ones kombu writes for the same message."""
    app = Celery("tests.frames", broker="memory://", set_as_current=False)
    app.conf.accept_content = ["json", "pickle"]
    when = datetime(2026, 11, 30, 12, 0, tzinfo=timezone.utc)
    sig = app.signature(
        "some.task",
        args=(1, "ünïcode", when, uuid.UUID(int=5), Decimal("1.5"), b"\x00\xff"),
        kwargs={"nested": {"k": [None, True, 2.5]}},
        **options,
    )
    built = publish._Builder(app, "batch").build(5, "0c1f7a52-7d0e-4a55-9d1e-3f2d1c0b9a87", sig)
    ours = _wire(built, direct=True)
    assert ours == _wire(built, direct=False)
    assert b"some.task" in ours


def test_a_property_kombu_takes_as_an_argument_goes_through_kombu() -> None:
    """A property the direct path does not model (here `mandatory`, which a route may add) is left to kombu."""
    app = Celery("tests.frames", broker="memory://", set_as_current=False)
    route, headers, body, properties = publish._Builder(app, "batch").build(1, "t-1", app.signature("some.task"))
    properties = {**properties, "mandatory": True}
    frames = _KombuChannel().basic_publish.__self__
    assert not publish._publish_frames(frames, Producer(_KombuChannel()), route, headers, body, properties)
    assert _wire((route, headers, body, properties), direct=True) == _wire((route, headers, body, properties), False)


def test_serialize_is_kombus_dumps() -> None:
    """The same content type, encoding and text as kombu's `dumps` for what a task's arguments hold; a value JSON
    cannot carry raises kombu's EncodeError; a serializer other than JSON is kombu's own."""
    when = datetime(2026, 11, 30, 12, 0, tzinfo=timezone.utc)
    values: list[Any] = [
        [[1, "é", None, True, 1.5, -0.0], {"k": {"n": [1, 2]}}, {"callbacks": None}],
        {"when": when, "id": uuid.UUID(int=1), "d": Decimal("0.1"), "raw": b"\xff\x00", "text": b"ascii"},
        "a string",
        [float("nan"), 2**70],
    ]
    for value in values:
        for serializer in ("json", "pickle"):
            assert codec.serialize(value, serializer) == kombu_dumps(value, serializer=serializer), value
    with pytest.raises(EncodeError):
        codec.serialize([object()], "json")
    with pytest.raises(EncodeError):
        kombu_dumps([object()], serializer="json")


VERSIONS = [("5.1.1", True), ("5.1.0", False), ("5.4.2", True), ("5.4.99", True), ("5.5.0", False)]
VERSIONS += [("6.0.0", False), ("5.3.0rc1", True), ("4.6.11", False), ("not a version", False)]


@pytest.mark.parametrize(("version", "ok"), VERSIONS)
def test_the_frame_writer_is_used_only_with_a_tested_py_amqp(version: str, ok: bool) -> None:
    assert amqp_frames.supported(version) is ok


def test_the_installed_py_amqp_is_tested_and_declared() -> None:
    """The py-amqp this suite runs with is within the fast path's range, and pyproject.toml declares the range
    the fallback covers (the dependency must not be narrower than the tested range)."""
    import amqp

    from tests.workers import ROOT

    assert amqp_frames.SUPPORTED and amqp_frames.supported(amqp.__version__)
    assert '"amqp>=5.1.1,<6",' in (ROOT / "pyproject.toml").read_text()
    assert amqp_frames.TESTED_VERSIONS[0] == (5, 1, 1)
