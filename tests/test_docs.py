"""The documentation builds: `mkdocs build --strict` (broken links, missing pages, unknown API names and snippet
files that do not exist all fail it). mkdocs is in the `dev` extra; without it this test fails rather than skips."""

from __future__ import annotations

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
