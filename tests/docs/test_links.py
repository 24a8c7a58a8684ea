"""Every relative link of README.md, docs/*.md and the benchmark history points to a file that exists, and
a `#anchor` to a heading that exists there (GitHub's rule: lower case, punctuation dropped, spaces to hyphens,
a repeated heading gets -1, -2, ...). Links inside code blocks and to URLs are not checked."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks/results/history.md"]
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def prose(text: str) -> list[str]:
    """The lines outside fenced code blocks, inline code spans blanked."""
    out, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append(re.sub(r"`[^`]*`", "``", line))
    return out


def slug(heading: str) -> str:
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found, seen = set(), {}
    fenced = False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            fenced = not fenced
        m = None if fenced else re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(page: Path) -> list[str]:
    return [m.group(1) for line in prose(page.read_text()) for m in LINK.finditer(line)]


def broken(page: Path) -> list[str]:
    bad = []
    for target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (page.parent / unquote(file_part)).resolve() if file_part else page
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and unquote(anchor) not in anchors(dest):
            bad.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    return bad


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    assert page.exists()
    assert not broken(page)


def test_the_checker_catches_a_missing_file_and_a_missing_anchor(tmp_path):
    (tmp_path / "b.md").write_text("# Title: `one`, two\n\n## Title: one, two\n\n```\n# not a heading\n```\n")
    page = tmp_path / "a.md"
    page.write_text("[ok](b.md#title-one-two) [dup](b.md#title-one-two-1) [gone](c.md) [no](b.md#not-a-heading)\n"
                    "[self](#top) [web](https://example.com/x.md)\n```\n[in code](nowhere.md)\n```\n# Top\n")
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        assert broken(page) == ["c.md: no such file", "b.md#not-a-heading: no heading #not-a-heading in b.md"]
    finally:
        ROOT = saved


def test_the_readme_is_a_front_page():
    text = (ROOT / "README.md").read_text()
    assert len(text.encode()) <= 12 * 1024
    assert not re.search(r"\b[0-9a-f]{7,40}\b", text), "a commit hash in the README"
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", text), "a date in the README"
