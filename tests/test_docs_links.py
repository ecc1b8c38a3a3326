"""Every relative link in the README and docs/ reaches a file, and every anchor a heading there."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]\n]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.MULTILINE)


def prose(text: str) -> str:
    """The page without its code blocks, where a ``](`` is not a link."""
    return FENCE.sub("", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text, lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading's anchor, with GitHub's -1, -2 … for repeated ones."""
    seen: dict[str, int] = {}
    found = set()
    for heading in HEADING.findall(prose(page.read_text())):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(page: Path) -> list[str]:
    return LINK.findall(CODE_SPAN.sub("", prose(page.read_text())))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_reach_a_file_and_a_heading(page: Path) -> None:
    broken = []
    for target in links(page):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: …: not ours to check
            continue
        path, _, anchor = target.partition("#")
        into = (page.parent / path).resolve() if path else page
        if not into.exists():
            broken.append(f"{target}: no such file")
        elif anchor and into.suffix == ".md" and anchor not in anchors(into):
            broken.append(f"{target}: no heading #{anchor} in {into.relative_to(ROOT)}")
    assert not broken, broken


def test_the_readme_stays_short_and_links_every_docs_page() -> None:
    readme = ROOT / "README.md"
    assert len(readme.read_text().splitlines()) <= 250
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in links(readme)}
    pages = {p.resolve() for p in (ROOT / "docs").glob("*.md")}
    assert pages <= linked, sorted(str(p.relative_to(ROOT)) for p in pages - linked)
