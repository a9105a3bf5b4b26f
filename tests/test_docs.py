"""The documentation builds: `mkdocs build --strict` (broken links, missing pages, unknown API names and snippet
files that do not exist all fail it). mkdocs is in the `dev` extra; without it this test fails rather than skips.
And every test RELIABILITY.md cites as evidence exists."""

from __future__ import annotations

import ast
import fnmatch
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


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
    # The SQL files tests/test_roles.py runs are included in the page, not copied into it.
    assert "CREATE ROLE fanin_owner LOGIN;" in roles_page
    assert "GRANT USAGE ON SEQUENCE fanin_outbox_id_seq TO fanin_relay;" in roles_page
    api_page = (site / "reference" / "api" / "index.html").read_text()
    assert "fan_in_group" in api_page and "BatchOutcome" in api_page


# A cited test: `tests/<path>.py` alone (the module), or `tests/<path>.py::name`, where `name` may end in `*` (every
# test it matches, at least one) or carry a parameter id (`name[redis]`).
CITED = re.compile(r"`(tests/[\w/]+\.py)(?:::([\w*]+)(?:\[[\w-]+\])?)?`")


def _test_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    return {
        node.name
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test_")
    }


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
