"""A plain `pytest` in a clone runs what `make test` runs: the chaos suite (it restarts the machine's services) and
the breakages (minutes) are deselected by pyproject's addopts, and selected again by the `-m` that `make chaos`,
`make breakages` and a user pass (pytest keeps the last -m given)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.workers import ROOT

PATHS = ["tests/chaos", "tests/model/test_breakages.py"]


def _collected(*args: str) -> tuple[int, int]:
    """(selected, deselected) of a collection of PATHS with `args`, in a pytest of its own."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--collect-only",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:randomly",
            *PATHS,
            *args,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=90,
    )
    last = done.stdout.strip().splitlines()[-1]
    match = re.search(r"(?:(\d+)/)?(\d+) tests? collected(?: \((\d+) deselected\))?", last) or re.search(
        r"no tests collected \((\d+) deselected\)", last
    )
    assert match, done.stdout + done.stderr
    if last.startswith("no tests"):
        return 0, int(match.group(1))
    selected = int(match.group(1) or match.group(2))
    return selected, int(match.group(3) or 0)


@pytest.mark.timeout(120)
def test_chaos_and_breakages_run_only_when_asked() -> None:
    selected, deselected = _collected()
    assert selected == 0 < deselected, "a plain pytest collects none of them"
    chaos, _ = _collected("-m", "chaos")
    breakages, _ = _collected("-m", "breakages")
    assert chaos > 0 and breakages > 0 and chaos + breakages == deselected
