"""Bad input, fuzzed (hypothesis): `fan_in_group`'s options and children, `BatchOutcome.from_message`, and the
CLI's arguments. Each input either works or is refused with one clear error (`InvalidFanIn`, `ValueError` for an
outcome, a nonzero exit with one line for the CLI), and a refused batch writes nothing."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
from datetime import timedelta, timezone
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import click
import psycopg
import pytest
from celery import Celery
from click.testing import CliRunner
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from psycopg import sql

from celery_fanin import BatchOutcome, InvalidFanIn, fan_in_group
from celery_fanin.cli import fanin as fanin_cli
from tests.clitools import leaf_commands
from tests.workers import ROOT, wait_for

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
    assert handle.batch_status().planned == len(built)


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


COMMANDS = leaf_commands()
# Run in a subprocess (`test_dashboard_arguments_...`): given good arguments it serves until stopped.
SERVING = {("dashboard",)}
# Options left out of the in-process fuzz, with the values tried instead: a good --metrics-port would start a
# metrics server in the test process for every example.
_ONLY_BAD = {"--metrics-port": ["-1", "65536", "port", "nan"]}
_values = st.one_of(
    st.text(max_size=40),
    st.sampled_from(
        ["-1", "0", "1", "2", "0.01", "nan", "inf", "-inf", "1e309", str(2**70), "", "\x00", "30d", "-5s", "1h30m"]
    ),
    st.sampled_from(["DEBUG", "bogus", "json", "text", "xml", "running", "stuck", "/nonexistent/dir/x.log"]),
    st.uuids().map(str),
)


def _tokens(command: click.Command, batch_ids: list[str]) -> st.SearchStrategy[str]:
    """Tokens for one command: its own options (and their edge values), anything, the batches that exist."""
    options = [o for p in command.params if isinstance(p, click.Option) for o in p.opts if o not in _ONLY_BAD]
    bad = [v for p in command.params for o in getattr(p, "opts", []) if o in _ONLY_BAD for v in (o, *_ONLY_BAD[o])]
    choices: list[st.SearchStrategy[str]] = [_values, st.sampled_from(batch_ids)]
    if options:
        choices.append(st.sampled_from(options))
    if bad:
        choices.append(st.sampled_from(bad))
    return st.one_of(*choices)


def _database(url: str) -> dict[str, str]:
    """A digest of every celery-fanin table's rows (for "nothing was written")."""
    with psycopg.connect(url) as conn:
        tables = [
            r[0]
            for r in conn.execute(
                "SELECT tablename FROM pg_tables WHERE schemaname = current_schema() AND tablename LIKE 'fanin%%'"
            )
        ]
        digests = {}
        for table in tables:
            query = sql.SQL("SELECT md5(coalesce(string_agg(t::text, '|' ORDER BY t::text), '')) FROM {} t")
            row = conn.execute(query.format(sql.Identifier(table))).fetchone()
            digests[table] = row[0] if row else ""
    return digests


@pytest.fixture
def batches_present(app: Celery) -> list[str]:
    """A running batch (children pending, nothing consumes them) and an empty one, for commands to act on."""
    running = fan_in_group(
        [app.signature("t.child", args=(i,)) for i in range(3)], then=app.signature("t.then"), app=app
    )
    empty = fan_in_group([], then=app.signature("t.then"), app=app)
    return [running.apply_async().batch_id, empty.apply_async().batch_id]


def test_the_fuzz_covers_every_command() -> None:
    """A command added to `celery fanin` is fuzzed without anyone listing it here."""
    assert {("status",), ("relay",), ("migrate",), ("saga", "ack"), ("dashboard",)} <= set(COMMANDS)
    assert set(COMMANDS) >= SERVING


def _invoke(app: Celery, path: tuple[str, ...], args: list[str], bounded: bool = True) -> Any:
    if path == ("watch",) and bounded:
        args = [*args, "--timeout", "0.1"]  # a good watch waits for the batch to finish (the last --timeout wins)
    if path == ("relay",):
        # A good relay runs until stopped. First, not last: a drawn `-f` or `--logfile` at the end would take
        # `--once` as its file name, and the relay would run on (past the test's timeout, which hypothesis then
        # takes for a failure to shrink, each shrink running forever in turn).
        args = ["--once", *args]
    with tempfile.TemporaryDirectory() as scratch, contextlib.chdir(scratch):  # where a good --logfile is written
        return CliRunner().invoke(fanin_cli, [*path, *args], obj=SimpleNamespace(app=app))


def _check_refusal(result: Any, what: str) -> None:
    assert result.exception is None or isinstance(result.exception, SystemExit), f"{what}: {result.exception!r}"
    lines = [line for line in result.output.splitlines() if line.startswith("Error")]
    assert len(lines) == 1, f"{what}: {result.output}"
    assert result.exit_code in (1, 2), f"{what}: {result.output}"


@FIXTURES
@given(data=st.data(), path=st.sampled_from(sorted(set(COMMANDS) - SERVING)))
def test_cli_arguments_work_or_exit_nonzero_with_one_line_and_write_nothing(
    app: Celery, clean_db: str, batches_present: list[str], data: st.DataObject, path: tuple[str, ...]
) -> None:
    args = data.draw(st.lists(_tokens(COMMANDS[path], batches_present), max_size=5), label="args")
    before = _database(clean_db)
    result = _invoke(app, path, args)
    if result.exit_code == 0:
        return
    _check_refusal(result, f"{' '.join(path)} {args}")
    assert _database(clean_db) == before, f"{' '.join(path)} {args} wrote to the database"


@pytest.mark.parametrize(
    ("path", "args"),
    [
        pytest.param(("relay",), ["--poll-interval", "nan"], id="relay-nan-poll"),
        pytest.param(("relay",), ["--poll-interval", "-1"], id="relay-negative-poll"),
        pytest.param(("relay",), ["--poll-interval", "inf"], id="relay-infinite-poll"),
        pytest.param(("watch",), ["{batch}", "--interval", "nan"], id="watch-nan-interval"),
        pytest.param(("watch",), ["{batch}", "--interval", "inf"], id="watch-infinite-interval"),
        pytest.param(("watch",), ["{batch}", "--timeout", "nan"], id="watch-nan-timeout"),  # looped forever
        pytest.param(("ls",), ["--older-than", "nan"], id="ls-nan-duration"),
        pytest.param(("ls",), ["--older-than", "inf"], id="ls-infinite-duration"),
        pytest.param(("ls",), ["--limit", str(2**70)], id="ls-huge-limit"),
        pytest.param(("prune",), ["--older-than", "1e309"], id="prune-infinite-duration"),
        pytest.param(("prune",), ["--older-than", "nan"], id="prune-nan-duration"),
        pytest.param(("prune",), ["--older-than", "1d", "--chunk", str(2**40)], id="prune-huge-chunk"),
        pytest.param(("failures",), ["{batch}", "--limit", str(2**70)], id="failures-huge-limit"),
        pytest.param(("status",), ["{batch}", "--tree-limit", str(2**70)], id="status-huge-tree-limit"),
    ],
)
def test_found_by_the_fuzz_is_refused_before_the_command_runs(
    app: Celery, clean_db: str, batches_present: list[str], path: tuple[str, ...], args: list[str]
) -> None:
    """Arguments the fuzz found taken as given and then failing in PostgreSQL (out of range), looping (a nan
    timeout) or running with a nan poll interval: now each is a usage error (exit 2) before anything runs."""
    args = [a.replace("{batch}", batches_present[0]) for a in args]
    before = _database(clean_db)
    result = _invoke(app, path, args, bounded="--timeout" not in args)
    _check_refusal(result, f"{' '.join(path)} {args}")
    assert result.exit_code == 2 and "Invalid value" in result.output, result.output
    assert _database(clean_db) == before


def test_dashboard_arguments_work_or_exit_nonzero_with_one_line(e2e_env: dict[str, str], tmp_path: Path) -> None:
    """The dashboard serves until stopped when its arguments are good, so each set runs as a real `celery fanin
    dashboard` process: it either exits nonzero with one `Error` line before serving, or serves (and is stopped)."""
    bad = [
        ["--port", "-1"],
        ["--port", "65536"],
        ["--port", "http"],
        ["--refresh", "nan"],
        ["--refresh", "inf"],
        ["--refresh", "0.1"],
        ["--host", "0.0.0.0"],  # not loopback, no token
        ["--host", "no such host \x01"],
        ["--bogus"],
    ]
    env = {**os.environ, **e2e_env, "PYTHONPATH": str(ROOT), "FANIN_DASHBOARD_TOKEN": ""}
    for args in [*bad, ["--port", "0", "--refresh", "0.5"]]:
        log = tmp_path / "dashboard.log"
        with log.open("w") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "tests.app", "fanin", "dashboard", *args],
                cwd=ROOT,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

            def started(proc: subprocess.Popen[bytes] = proc, log: Path = log) -> bool:
                return proc.poll() is not None or "dashboard at" in log.read_text()

            try:
                wait_for(started, 60, message=str(args))
            finally:
                serving = proc.poll() is None
                if serving:
                    proc.terminate()
                    proc.wait(30)
        output = log.read_text()
        if args in bad:
            assert not serving and proc.returncode in (1, 2), f"{args}: {output}"
            assert len([line for line in output.splitlines() if line.startswith("Error")]) == 1, f"{args}: {output}"
        else:
            assert serving, f"{args}: {output}"
