"""mkdocs hooks: the repository's RELIABILITY.md, BENCHMARKS.md and SECURITY.md as pages of the documentation site.

Why: they stay at the top of the repository, where a reader of the repository (and GitHub's security tab) finds
them and where `make bench` rewrites BENCHMARKS.md's figures; a copy under docs/ would drift. Their links are
written for the repository (`docs/concepts/trust.md`, `bench/report/bench-redis.png`): the pages are taken from
the top of the repository, so the images resolve as they are, and links into docs/ are rewritten here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

ROOT = Path(__file__).resolve().parent
PAGES = ("RELIABILITY.md", "BENCHMARKS.md", "SECURITY.md")
ASSETS = ("bench/report/bench-redis.png", "bench/report/bench-rabbitmq.png")


def on_files(files: Files, config: Any) -> Files:
    for name in (*PAGES, *ASSETS):
        files.append(File(name, str(ROOT), config["site_dir"], config["use_directory_urls"]))
    return files


def on_page_markdown(markdown: str, page: Page, config: Any, files: Files) -> str:
    if page.file.src_uri in PAGES:
        return markdown.replace("](docs/", "](")
    return markdown
