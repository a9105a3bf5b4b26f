"""How a failed successor's error comes back from `get()` (no result backend: the store keeps its type's name and
text): a built-in as itself, a loaded class of that name as that class (so `except MyError:` works), and anything
else, or an ambiguous name, as a stand-in of that name."""

from __future__ import annotations

from celery_fanin import ChordHeaderFailed
from celery_fanin.producer.result import rebuilt_exception


class PaymentDeclined(Exception):
    pass


class NeedsTwoArguments(Exception):
    def __init__(self, code: int, why: str) -> None:
        super().__init__(code, why)


def test_an_error_is_rebuilt_as_the_class_the_caller_can_catch() -> None:
    assert type(rebuilt_exception("ValueError", "bad")) is ValueError
    declined = rebuilt_exception("PaymentDeclined", "card 4242")
    assert type(declined) is PaymentDeclined and declined.args == ("card 4242",)
    chord = rebuilt_exception("ChordHeaderFailed", "chord x: 1 of 2 header tasks succeeded")
    assert isinstance(chord, ChordHeaderFailed)
    unknown = rebuilt_exception("NotLoadedAnywhere", "?")
    assert type(unknown).__name__ == "NotLoadedAnywhere" and type(unknown).__module__ == "celery_fanin.remote"
    odd = rebuilt_exception("NeedsTwoArguments", "3: no")  # its constructor wants more than the text: a stand-in
    assert type(odd).__name__ == "NeedsTwoArguments" and type(odd) is not NeedsTwoArguments


def test_an_ambiguous_name_gets_a_stand_in() -> None:
    first = type("Twice", (Exception,), {})
    second = type("Twice", (Exception,), {})
    got = rebuilt_exception("Twice", "which one?")
    assert type(got) not in (first, second) and type(got).__name__ == "Twice"


def test_chord_results_the_bodys_serializer_cannot_carry_fail_the_body_with_why() -> None:
    from celery import Celery

    from celery_fanin import FanIn
    from celery_fanin.dispatch.successors import _encodable

    app = Celery("encodable", set_as_current=False)
    app.conf.fanin_database_url = "postgresql://nobody@127.0.0.1:1/none"  # never connected to
    fanin = FanIn(app)
    body = app.signature("t.body")
    assert _encodable(fanin, body, [1, "two", [3]])
    assert not _encodable(fanin, body, [{1, 2}]), "a set: the JSON task serializer cannot carry it"
    assert _encodable(fanin, body.set(serializer="pickle"), [{1, 2}])
    err = ChordHeaderFailed.from_outcome({"batch_id": "b1", "failures": []}, "unencodable")
    assert "cannot be encoded with its body's serializer" in str(err) and err.batch_id == "b1"
