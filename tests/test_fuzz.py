"""Bad input, fuzzed (hypothesis): `fan_in_group`'s options and children, `BatchOutcome.from_message`, and the
CLI's arguments. Each input either works or is refused with one clear error (`InvalidFanIn`, `ValueError` for an
outcome, a nonzero exit with one line for the CLI), and a refused batch writes nothing."""

from __future__ import annotations

import math
from datetime import timedelta, timezone
from types import SimpleNamespace
from typing import Any

import psycopg
from celery import Celery
from click.testing import CliRunner
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from celery_fanin import BatchOutcome, InvalidFanIn, fan_in_group
from celery_fanin.cli import fanin as fanin_cli

FIXTURES = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)

_edges = st.sampled_from(
    [
        0,
        -1,
        1,
        2**31,
        2**40,
        0.5,
        1e308,
        float("inf"),
        float("nan"),
        "",
        "\x00",
        "fail",
        "redrive",
        "proceed",
        "abandon",
        True,
        timedelta(days=999_999_999),
        timedelta(seconds=-1),
        timedelta(seconds=5),
    ]
)
_odd = st.one_of(
    _edges,
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.timedeltas(min_value=timedelta(days=-3), max_value=timedelta(days=3)),
    st.datetimes(timezones=st.just(timezone.utc)),
    st.lists(st.integers(), max_size=3),
)
_OPTIONS = ("child_timeout", "on_lost", "max_redrives", "deadline", "on_deadline", "max_failures", "key", "max_width")


def _rows(url: str) -> tuple[int, int]:
    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT (SELECT count(*) FROM fanin_batches), (SELECT count(*) FROM fanin_children)")
        found = row.fetchone()
    assert found is not None
    return int(found[0]), int(found[1])


@FIXTURES
@given(
    options=st.dictionaries(st.sampled_from(_OPTIONS), _odd, max_size=2),
    children=st.lists(st.one_of(st.just("sig"), st.just("sig"), _odd), max_size=3),
    step=st.one_of(st.none(), st.none(), st.text(max_size=300)),
)
@example(options={"child_timeout": float("inf")}, children=["sig"], step=None)
@example(options={"child_timeout": float("nan")}, children=["sig"], step=None)
@example(options={"child_timeout": 1e308}, children=["sig"], step=None)
@example(options={"deadline": timedelta(days=999_999_999)}, children=["sig"], step=None)
@example(options={"deadline": 1e308}, children=["sig"], step=None)
@example(options={"deadline": 2**70}, children=["sig"], step=None)
@example(options={"max_redrives": 2**40}, children=["sig"], step=None)
@example(options={"max_failures": 2**40}, children=["sig"], step=None)
@example(options={"key": "x\x00y"}, children=["sig"], step=None)
@example(options={}, children=["sig"], step="a\x00b")
def test_fan_in_group_works_or_raises_invalid_fan_in_and_writes_nothing(
    app: Celery, clean_db: str, options: dict[str, Any], children: list[Any], step: str | None
) -> None:
    sig = app.signature("t.child")
    built = [sig.clone(args=(i,)) if c == "sig" else c for i, c in enumerate(children)]
    before = _rows(clean_db)
    try:
        handle = fan_in_group(built, then=app.signature("t.then"), step=step, app=app, **options).apply_async()
    except InvalidFanIn as exc:
        assert str(exc) and "\n" not in str(exc)
        assert _rows(clean_db) == before, "a refused batch wrote rows"
        return
    assert handle.status().planned == len(built)


_json = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=10)),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=10,
)
_OUTCOME_KEYS = (
    "batch_id",
    "step",
    "planned",
    "succeeded",
    "failed",
    "failures",
    "failures_truncated",
    "state",
    "partial",
    "abandoned",
    "unfinished",
    "round",
    "retry_of",
)


_value = _json | st.floats(allow_infinity=True, allow_nan=True) | st.integers(min_value=-(2**70), max_value=2**70)


@settings(max_examples=300, deadline=None)
@given(
    outcome=st.one_of(
        _json,
        st.fixed_dictionaries(
            {k: _value for k in _OUTCOME_KEYS[:5]},
            optional={k: _value for k in _OUTCOME_KEYS[5:]},
        ),
    )
)
def test_from_message_returns_an_outcome_or_raises_value_error(outcome: Any) -> None:
    try:
        found = BatchOutcome.from_message(outcome)
    except ValueError as exc:
        assert str(exc).startswith("not a celery-fanin outcome")
        return
    assert isinstance(found, BatchOutcome)


_COMMANDS = ("status", "watch", "failures", "retry-failed", "seal", "cancel", "ls", "prune")
_arg = st.one_of(
    st.text(max_size=40),
    st.sampled_from(["--json", "--limit", "-1", "--tree-limit", "nan", "--timeout", "--interval", "0", "1e309"]),
    st.uuids().map(str),
)


@FIXTURES
@given(command=st.sampled_from(_COMMANDS), args=st.lists(_arg, max_size=4))
def test_cli_arguments_work_or_exit_nonzero_with_one_line(app: Celery, command: str, args: list[str]) -> None:
    if command == "watch":
        args = [*args, "--timeout", "0.1"]
    if command == "prune":
        args = [*args, "--dry-run"]
    result = CliRunner().invoke(fanin_cli, [command, *args], obj=SimpleNamespace(app=app))
    if result.exit_code == 0:
        return
    assert result.exception is None or isinstance(result.exception, SystemExit), (
        f"{command} {args}: {result.exception!r}"
    )
    lines = [line for line in result.output.splitlines() if line.startswith("Error")]
    assert len(lines) == 1, result.output
    assert not math.isnan(result.exit_code) and result.exit_code in (1, 2), result.output
