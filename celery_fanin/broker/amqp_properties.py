"""A message's AMQP basic properties, encoded byte for byte as py-amqp encodes them, reusing what repeats.

Why: py-amqp's ``Message._serialize_properties`` encodes the header table item by item through a chain of
``isinstance`` checks and ``BytesIO`` writes: ~30 µs for a Celery task message on this machine, the largest
single cost of publishing a child to RabbitMQ. The children of a batch share most of their ~22 headers (``lang``,
``task``, ``origin``, ``timelimit``...); only a few (``id``, ``root_id``, ``argsrepr``, ``fanin_index``) change
from one message to the next. `PropertiesEncoder` learns which positions change, keeps the encoded bytes of the
others, and encodes only the changing ones, strings and small integers directly and anything else with py-amqp's
own ``dumps``.

Exactness comes first: a header is reused only if it is at the same position under the same key with a value of
the same type that compares equal (containers compared type by type all the way down; floats are never reused,
since ``0.0 == -0.0`` encode differently); a message with anything this does not model (a property whose type
py-amqp would reject, a key longer than 255 bytes) is encoded by py-amqp itself. tests/test_amqp_frames.py
compares the bytes with py-amqp's for single messages and for sequences built to trip the reuse.
"""

from __future__ import annotations

from operator import itemgetter
from struct import Struct
from typing import Any

from amqp import Message
from amqp.serialization import dumps

_SIZE = Struct(">I").pack
_INT_ITEM = Struct(">ci").pack
_FLAGS = Struct(">H").pack
_OCTET = Struct("B").pack
_LONGLONG = Struct(">Q").pack
_INT_RANGE = 2147483647  # py-amqp writes an integer within +-this as a 32-bit 'I', else as a 64-bit 'L'

# Top-level header types whose equality (same type) means the same encoding; containers are compared deeply.
_PLAIN = frozenset({str, bytes, int, bool, type(None)})
_CONTAINERS = frozenset({list, tuple, dict})
_REUSABLE = _PLAIN | _CONTAINERS


def _same(a: Any, b: Any) -> bool:
    """Whether `b` encodes exactly as `a` does: the same types and equal values all the way down."""
    kind = type(a)
    if kind is not type(b):
        return False
    if kind in _PLAIN:
        return bool(a == b)
    if kind is list or kind is tuple:
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if kind is dict:
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    return False  # floats, decimals, datetimes...: encoded afresh every time


class _TableEncoder:
    """One header table after another, each encoded as py-amqp's ``_write_table`` would."""

    def __init__(self) -> None:
        self._keys: dict[str, bytes] = {}  # key -> its length-prefixed bytes
        self._shape: tuple[Any, ...] | None = None  # the previous table's keys
        self._previous: tuple[Any, ...] = ()  # and values
        self._template: list[bytes] | None = None  # encoded items, the changing positions to be filled in
        self._changing: tuple[int, ...] = ()
        self._fixed: Any = None  # itemgetter of the positions that did not change
        self._fixed_values: tuple[Any, ...] = ()
        self._fixed_types: tuple[type, ...] = ()
        self._deep: tuple[int, ...] = ()  # fixed positions holding containers: checked with `_same`

    def encode(self, table: dict[Any, Any]) -> bytes:
        shape = tuple(table)
        values = tuple(table.values())
        if shape == self._shape and self._template is not None and self._still_fixed(values):
            parts = self._template[:]
            for i in self._changing:
                parts[i] = self._item(shape[i], values[i])
        else:
            parts = [self._item(k, v) for k, v in zip(shape, values, strict=True)]
            self._learn(shape, values, parts)
        data = b"".join(parts)
        return _SIZE(len(data)) + data

    def _still_fixed(self, values: tuple[Any, ...]) -> bool:
        fixed = self._fixed(values)
        if fixed != self._fixed_values or tuple(map(type, fixed)) != self._fixed_types:
            return False
        previous = self._previous
        return all(_same(previous[i], values[i]) for i in self._deep)

    def _learn(self, shape: tuple[Any, ...], values: tuple[Any, ...], parts: list[bytes]) -> None:
        """After a table encoded in full: which positions kept the previous table's value (and can be reused)."""
        if shape != self._shape:
            self._shape, self._previous, self._template = shape, values, None
            return
        previous = self._previous
        fixed = [i for i, (a, b) in enumerate(zip(previous, values, strict=True))
                 if type(b) in _REUSABLE and _same(a, b)]  # fmt: skip
        self._previous = values
        if len(fixed) < 2:  # nothing worth a template (itemgetter of one index returns a value, not a tuple)
            self._template = None
            return
        self._fixed = itemgetter(*fixed)
        self._fixed_values = self._fixed(values)
        self._fixed_types = tuple(map(type, self._fixed_values))
        self._deep = tuple(i for i in fixed if type(values[i]) in _CONTAINERS)
        fixed_set = set(fixed)
        self._changing = tuple(i for i in range(len(values)) if i not in fixed_set)
        self._template = parts

    def _item(self, key: Any, value: Any) -> bytes:
        """One table item as py-amqp's ``_write_table``/``_write_item`` write it."""
        prefix = self._keys.get(key)
        if prefix is None:
            encoded = key.encode("utf-8", "surrogatepass") if isinstance(key, str) else key
            if not isinstance(encoded, bytes) or len(encoded) > 255:
                return dumps("F", [{key: value}])[4:]  # py-amqp's own encoding (and its error)
            prefix = self._keys[key] = _OCTET(len(encoded)) + encoded
        kind = type(value)
        if kind is str:
            data = value.encode("utf-8", "surrogatepass")
            return prefix + b"S" + _SIZE(len(data)) + data
        if kind is int and -_INT_RANGE <= value <= _INT_RANGE:
            return prefix + _INT_ITEM(b"I", value)
        if value is None:
            return prefix + b"V"
        return dumps("F", [{key: value}])[4:]


class PropertiesEncoder:
    """``Message._serialize_properties`` for a stream of messages: flag words, then the values present."""

    def __init__(self) -> None:
        self._table = _TableEncoder()
        self._last: dict[str, tuple[Any, bytes]] = {}  # each shortstr and octet property's last value, encoded
        self._plans: dict[tuple[str, ...], tuple[bytes, list[tuple[str, str]]]] = {}

    def _plan(self, present: tuple[str, ...]) -> tuple[bytes, list[tuple[str, str]]]:
        """For the properties present: the flag word, and (name, kind) in the order the spec lists them."""
        plan = self._plans.get(present)
        if plan is None:
            bits, order = 0, []
            for shift, (name, kind) in zip(range(15, 0, -1), Message.PROPERTIES, strict=False):
                if name in present:  # 14 properties: one flag word, never a continuation
                    bits |= 1 << shift
                    order.append((name, kind))
            plan = self._plans[present] = (_FLAGS(bits), order)
        return plan

    def encode(self, msg: Message) -> bytes:
        properties = msg.properties
        flags, order = self._plan(tuple(name for name, value in properties.items() if value is not None))
        values: list[bytes] = [flags]
        for name, kind in order:
            value = properties[name]
            if kind == "F":
                if type(value) is not dict:
                    return bytes(msg._serialize_properties())
                values.append(self._table.encode(value))
            elif kind == "s" or kind == "o":
                last = self._last.get(name)
                if last is not None and type(last[0]) is type(value) and last[0] == value:
                    values.append(last[1])
                    continue
                if (kind == "s" and type(value) not in (str, bytes)) or (kind == "o" and type(value) is not int):
                    return bytes(msg._serialize_properties())  # py-amqp's encoding, or its error
                # A shortstr as py-amqp writes it, without its general writer (correlation_id changes per message).
                data = value.encode("utf-8", "surrogatepass") if type(value) is str else None
                encoded = _OCTET(len(data)) + data if data is not None and len(data) <= 255 else dumps(kind, [value])
                self._last[name] = (value, encoded)
                values.append(encoded)
            elif kind == "L" and type(value) is int:
                values.append(_LONGLONG(value))
            else:
                return bytes(msg._serialize_properties())
        return b"".join(values)
