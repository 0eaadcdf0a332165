"""The README and the docs pages link to each other by file and heading: every relative link
names a file that exists and, with a #fragment, a heading of that page (GitHub's anchors)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^ *```.*?^ *```", re.S | re.M)


def anchors(page: Path) -> set[str]:
    """GitHub's anchor of each heading: lower case, punctuation dropped, spaces as hyphens."""
    text = FENCE.sub("", page.read_text())
    headings = re.findall(r"^#{1,6} +(.+?) *$", text, re.M)
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


def test_docs_pages_exist() -> None:
    assert len(PAGES) > 1, "docs/ holds no page"


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(REPO).as_posix() for p in PAGES])
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for target in LINK.findall(FENCE.sub("", page.read_text())):
        if re.match(r"^[a-z]+:", target):  # http(s), mailto: not ours to check
            continue
        path, _, fragment = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif fragment and linked.suffix == ".md" and fragment not in anchors(linked):
            broken.append(f"{target}: no such heading")
    assert not broken, broken
