"""The documentation matches the code: the site builds with `mkdocs build --strict` (broken links, missing pages,
unknown API names and snippet files that do not exist all fail it), and the claims a reader acts on are checked
against what they describe: the commands and their flags, the settings and their defaults, the public API, the
README's two commands, and the benchmark figures against the recorded reports. mkdocs is in the `dev` extra;
without it the build test fails rather than skips. And every test RELIABILITY.md cites as evidence exists."""

from __future__ import annotations

import ast
import dataclasses
import fnmatch
import functools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import click
import pytest

import celery_fanin
from celery_fanin.cli import fanin
from celery_fanin.context import Settings

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
# Every page a user reads: the README, the site's pages, the top-level documents, the example's README.
DOCS = sorted(
    [ROOT / "README.md", ROOT / "RELIABILITY.md", ROOT / "BENCHMARKS.md", ROOT / "SECURITY.md"]
    + [ROOT / "example_app" / "README.md"]
    + list((ROOT / "docs").rglob("*.md"))
)
# Settings read from app.conf outside `Settings` (each where it is used: the publish paths, the dashboard), with
# their documented defaults.
EXTRA_SETTINGS = {
    "fanin_bulk_publish": "True",
    "fanin_amqp_frames": "True",
    "fanin_dashboard_token": "None",
    "fanin_dashboard_refresh": "2.0",
}


@pytest.mark.timeout(180)
def test_mkdocs_build_strict(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=170,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    site = tmp_path / "site"
    assert (site / "how-to" / "database-roles" / "index.html").exists()
    roles_page = re.sub(r"<[^>]+>", "", (site / "how-to" / "database-roles" / "index.html").read_text())
    # The SQL files tests/store/test_roles.py runs are included in the page, not copied into it.
    assert "CREATE ROLE fanin_owner LOGIN;" in roles_page
    relay_reads = "fanin_batches, fanin_children, fanin_successors, fanin_successor_reruns, fanin_outbox"
    assert f"GRANT SELECT ON {relay_reads} TO fanin_relay;" in roles_page
    api_page = (site / "reference" / "api" / "index.html").read_text()
    assert "fan_in_group" in api_page and "BatchOutcome" in api_page
    assert "compensated" in api_page and "SagaResult" in api_page
    # The top-level documents are pages of the site, their images and links included (mkdocs_hooks.py).
    for page, text in (("RELIABILITY", "How to reproduce"), ("BENCHMARKS", "sizing"), ("SECURITY", "Trust model")):
        assert text in (site / page / "index.html").read_text(), page
    assert (site / "bench" / "report" / "bench-redis.png").exists()
    assert 'href="../concepts/trust/"' in (site / "SECURITY" / "index.html").read_text()


# A cited test: `tests/<path>.py` alone (the module), or `tests/<path>.py::name`, where `name` may end in `*` (every
# test it matches, at least one) or carry a parameter id (`name[redis]`).
CITED = re.compile(r"`(tests/[\w/]+\.py)(?:::([\w*]+)(?:\[[\w-]+\])?)?`")


@functools.cache
def _test_names(path: Path) -> frozenset[str]:
    """The test functions a module defines (parsed once: RELIABILITY.md cites most modules many times)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return frozenset(
        node.name
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test_")
    )


def test_every_test_reliability_md_cites_exists() -> None:
    text = (ROOT / "RELIABILITY.md").read_text()
    cited = CITED.findall(text)
    assert len(cited) >= 100, "RELIABILITY.md cites its tests as `tests/...py::name`"
    # Any other mention of a test module must be a full path too, so that the pattern above sees it.
    bare = set(re.findall(r"`([\w/]*test_\w+\.py)[:`]", text)) - {path for path, _ in cited}
    assert not {b for b in bare if not b.startswith("tests/")}, f"cite tests as tests/...: {sorted(bare)}"
    missing = []
    for path, name in cited:
        file = ROOT / path
        if not file.is_file():
            missing.append(path)
        elif name and not fnmatch.filter(_test_names(file), name):
            missing.append(f"{path}::{name}")
    assert missing == [], f"RELIABILITY.md cites tests that do not exist: {missing}"


# --- commands ------------------------------------------------------------------------------------------------------


def _commands(group: click.Group, prefix: str = "") -> dict[str, click.Command]:
    found: dict[str, click.Command] = {}
    for name, command in group.commands.items():
        path = f"{prefix}{name}"
        if isinstance(command, click.Group):
            found.update(_commands(command, f"{path} "))
        else:
            found[path] = command
    return found


COMMANDS = _commands(fanin)
INVOCATION = re.compile(r"celery -A \S+ fanin ((?:[a-z][a-z-]*)(?: [a-z][a-z-]*)?)((?:[^#`|\n])*)")


def _flags(command: click.Command) -> set[str]:
    return {opt for param in command.params for opt in getattr(param, "opts", []) if opt.startswith("-")}


def _resolve(words: str) -> tuple[str, click.Command] | None:
    """The command `words` names (`saga ack` or `status`), or None."""
    for candidate in (words, words.split(" ")[0]):
        if candidate in COMMANDS:
            return candidate, COMMANDS[candidate]
    return None


def test_every_command_the_docs_show_exists_with_its_flags() -> None:
    """`celery -A proj fanin CMD ... --flag` anywhere in the docs names a real command and real flags."""
    seen = 0
    for path in DOCS:
        for words, rest in INVOCATION.findall(path.read_text()):
            found = _resolve(words.strip())
            assert found is not None, f"{path.name}: `fanin {words}` is not a command"
            name, command = found
            for flag in re.findall(r"(?<![\w-])(--?[a-z][a-z-]*)", rest):
                assert flag in _flags(command), f"{path.name}: `fanin {name}` has no option {flag}"
            seen += 1
    assert seen > 20  # the pattern finds the invocations (a broken pattern would check nothing)


def test_the_readme_lists_every_command_and_its_flags() -> None:
    """The README's command table has one row per command (saga subcommands included), and every flag in a row
    is that command's."""
    section = README.split("\n## Commands\n", 1)[1].split("\n## ", 1)[0]
    listed: dict[str, str] = {}
    for cell in re.findall(r"^\| `([^`]+)` \| ", section, re.M):
        name = _resolve(" ".join(re.findall(r"^[a-z][a-z-]*(?: [a-z][a-z-]*)?", cell)))
        assert name is not None, f"README lists `{cell}`, which is not a command"
        listed[name[0]] = cell
    assert set(listed) == set(COMMANDS), set(COMMANDS) ^ set(listed)
    for name, cell in listed.items():
        for flag in re.findall(r"(?<![\w-])--?[a-z][a-z-]*", cell):
            assert flag in _flags(COMMANDS[name]), f"README: `fanin {name}` has no option {flag}"


def test_the_readme_commands_are_the_makefile_targets() -> None:
    """`make demo` and `make test` exist; `make test` leaves the machine's services alone (the chaos suite, which
    restarts them, is deselected by its marker and only `make chaos` selects it)."""
    assert "make demo" in README and "make test" in README
    makefile = (ROOT / "Makefile").read_text()
    recipes = dict(re.findall(r"^([a-z]+):[^\n]*\n\t([^\n]+)", makefile, re.M))
    assert "example_app.demo" in recipes["demo"]
    assert '-m "not chaos and not breakages"' in recipes["test"]
    assert "-m chaos" in recipes["chaos"]
    assert "-m breakages" in recipes["breakages"] and "make breakages" in (ROOT / ".ci" / "run").read_text()
    for module in (ROOT / "tests" / "chaos").glob("test_*.py"):
        tree = ast.parse(module.read_text())
        marks = [
            node
            for node in ast.walk(tree)
            if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in node.targets)
        ]
        assert marks and "pytest.mark.chaos" in ast.unparse(marks[0].value), module
    assert "make chaos" in (ROOT / ".ci" / "run").read_text()


# --- settings ------------------------------------------------------------------------------------------------------


def _settings_table() -> dict[str, str]:
    """`fanin_*` setting -> its documented default, from docs/reference/settings.md."""
    text = (ROOT / "docs" / "reference" / "settings.md").read_text()
    rows: dict[str, str] = {}
    for names, default in re.findall(r"^\| (`fanin_[a-z_]+`(?: / `fanin_[a-z_]+`)*) \| ([^|]+) \|", text, re.M):
        for name in re.findall(r"fanin_[a-z_]+", names):
            rows[name] = default.strip()
    return rows


def _default_shown(default: object) -> str:
    if isinstance(default, str):
        return f'"{default}"'
    return str(default)


def test_every_setting_is_documented_with_its_default() -> None:
    table = _settings_table()
    settings = {f"fanin_{f.name}": f.default for f in dataclasses.fields(Settings)}
    assert set(table) == set(settings) | set(EXTRA_SETTINGS), set(table) ^ (set(settings) | set(EXTRA_SETTINGS))
    for name, default in settings.items():
        if name == "fanin_database_url":
            continue  # from the environment
        shown = table[name].split(" ")[0].strip("`")
        assert shown == _default_shown(default), f"{name}: documented {table[name]!r}, code {default!r}"
    for name, default in EXTRA_SETTINGS.items():
        assert table[name] == default


def test_every_setting_read_from_app_conf_is_known() -> None:
    """A `fanin_*` key the package reads from `app.conf` is a documented setting (no undocumented switch)."""
    known = {f"fanin_{f.name}" for f in dataclasses.fields(Settings)} | set(EXTRA_SETTINGS)
    read = set()
    for module in (ROOT / "celery_fanin").rglob("*.py"):
        read |= set(re.findall(r"conf\.get\(\s*\"(fanin_[a-z_]+)\"", module.read_text()))
    assert read and read <= known, read - known


# --- the API reference ---------------------------------------------------------------------------------------------


def test_the_api_reference_covers_every_public_name() -> None:
    api = (ROOT / "docs" / "reference" / "api.md").read_text()
    documented = set(re.findall(r"^::: celery_fanin\.(\w+)$", api, re.M))
    assert set(celery_fanin.__all__) <= documented, set(celery_fanin.__all__) - documented


# --- benchmark figures ---------------------------------------------------------------------------------------------


def _reports() -> dict[str, dict]:  # type: ignore[type-arg]
    return {b: json.loads((ROOT / "bench" / "report" / f"bench-{b}.json").read_text()) for b in ("redis", "rabbitmq")}


def _block(text: str, name: str) -> str:
    return text.split(f"<!-- bench:{name}:start -->\n", 1)[1].split(f"\n<!-- bench:{name}:end -->", 1)[0]


def test_benchmarks_blocks_are_the_recorded_reports() -> None:
    """BENCHMARKS.md's figures are what `make bench` writes from the reports in bench/report (not hand-edited)."""
    from bench.run import markdown, targets_markdown

    text = (ROOT / "BENCHMARKS.md").read_text()
    reports = _reports()
    for broker, report in reports.items():
        assert _block(text, broker) == markdown(report, report["command"]), broker
    assert _block(text, "targets") == targets_markdown(reports)


def test_throughput_figures_quoted_in_prose_agree_with_the_reports() -> None:
    """The README and BENCHMARKS.md quote one batch's counter rate, rounded to the hundred, from the reports."""
    reports = _reports().values()

    def span(key: str) -> str:
        rates = sorted(round(r["throughput"][key], -2) for r in reports)
        return f"{rates[0]:,.0f}" if rates[0] == rates[-1] else f"{rates[0]:,.0f}-{rates[-1]:,.0f}"

    flat, tree = span("fanin_events_per_s"), span("fanin_tree_events_per_s")
    for name in ("README.md", "BENCHMARKS.md"):
        prose = " ".join((ROOT / name).read_text().split())
        assert f"about {flat} terminal reports a second" in prose, (name, flat)
        assert "16 leaf counters" in prose and f"about {tree}" in prose, (name, tree)
