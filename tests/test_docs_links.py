"""Every relative link in README.md and docs/*.md points at a file that exists, and an anchor at a heading of it
(GitHub's heading slugs). A page moved or a heading renamed without its links fails here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
CODE_SPAN = re.compile(r"(`+).+?\1", re.S)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)


def prose(text: str) -> str:
    """The text less fenced blocks and code spans, where a bracket is not a link."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: link text kept, lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    for heading in HEADING.findall(FENCE.sub("", path.read_text(encoding="utf-8"))):
        base = slug(heading)
        name, n = base, 0
        while name in found:  # GitHub numbers repeated headings: x, x-1, x-2
            n += 1
            name = f"{base}-{n}"
        found.add(name)
    return found


def broken_links(page: Path) -> list[str]:
    """`target: why` for each relative link of `page` that leads nowhere."""
    broken = []
    for target in LINK.findall(prose(page.read_text(encoding="utf-8"))):
        if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
            continue
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page
        if not dest.exists():
            broken.append(f"{target}: no such file {dest.relative_to(REPO) if dest.is_relative_to(REPO) else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with anchor #{anchor} in {dest.name}")
    return broken


def test_slugs_follow_githubs_rule():
    # by hand, from GitHub's rendering of these headings
    assert slug("§5 The CPU stack and its traps") == "5-the-cpu-stack-and-its-traps"
    assert slug("Coarser weight grids: a mismatch dose axis (`--vllm.int8_weight_bits 6|5|4`)") == \
        "coarser-weight-grids-a-mismatch-dose-axis---vllmint8_weight_bits-654"
    assert slug("The `--quick` pilot (4 steps, 2 seeds)") == "the---quick-pilot-4-steps-2-seeds"


def test_the_checker_finds_a_broken_file_a_broken_anchor_and_skips_code(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# Title\n## Same\n## Same\n")
    page = tmp_path / "README.md"
    page.write_text("[ok](docs/a.md#title) [dup](docs/a.md#same-1) [self](#top) [web](https://x.org/y)\n"
                    "[gone](docs/b.md) [bad anchor](docs/a.md#nope)\n`[not a link](nowhere.md)`\n"
                    "```\n[nor this](nowhere.md)\n```\n# Top\n")
    assert broken_links(page) == [f"docs/b.md: no such file {tmp_path / 'docs' / 'b.md'}",
                                  "docs/a.md#nope: no heading with anchor #nope in a.md"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(page):
    assert not broken_links(page), f"{page.relative_to(REPO)}: broken links:\n" + "\n".join(broken_links(page))
