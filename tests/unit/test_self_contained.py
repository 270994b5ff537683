"""The repository stands alone: nothing in it cites a file outside it, and every docs/ page it cites exists."""
from __future__ import annotations

import re
import subprocess

from tests import tools

REPO = tools.REPO_ROOT
# Notes that lived beside the repository while it was written; their facts belong in docs/.
OUTSIDE = ["DESIGN" + ".md", "STYLE" + ".md", "../" + "shared", "notes/" + "local-cluster"]


def tracked_text_files() -> list:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    files = [REPO / p for p in out.decode().split("\0") if p]
    return [f for f in files if f.is_file() and f.suffix not in (".png", ".gz", ".tgz")]


def test_nothing_cites_files_outside_the_repository():
    found = []
    for f in tracked_text_files():
        text = f.read_text(errors="replace")
        found += [f"{f.relative_to(REPO)}: {needle}" for needle in OUTSIDE if needle in text]
    assert found == []


def test_every_cited_docs_page_exists():
    missing = []
    for f in tracked_text_files():
        for page in re.findall(r"\bdocs/([\w./-]+\.md)\b", f.read_text(errors="replace")):
            if not (REPO / "docs" / page).exists():
                missing.append(f"{f.relative_to(REPO)} cites docs/{page}")
    assert missing == []
