"""docs/design.md §2, the one module map, against the tree: every module, benchmark and doc is listed, and
nothing listed is gone. A module added without a line in the map fails here, and so does a second copy of the
map in the README (two maps drift)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "openrlhf_tis"


def _code_block(path: Path, heading: str) -> str:
    text = path.read_text(encoding="utf-8")
    start = text.index("```\n", text.index(heading)) + 4
    return text[start:text.index("```", start)]


DESIGN = _code_block(REPO / "docs" / "design.md", "## §2 Layers and data flow")
README = REPO / "README.md"


def _sections(block: str) -> dict[str, str]:
    """The map's sections: a line at column 0 that starts with `name/` opens one; indented lines continue it, and an
    indented `sub/` line opens the nested section `name/sub/` for the lines indented deeper than itself.
    Lines at column 0 without a slash (the top-level modules) fall in section ''."""
    sections: dict[str, str] = {"": ""}
    current, nested, nested_indent = "", None, 0
    for line in block.splitlines():
        indent = len(line) - len(line.lstrip())
        head = line.split()[0] if line.strip() else ""
        if line and not indent:
            current, nested = (head if head.endswith("/") else ""), None
        elif nested is not None and indent <= nested_indent:
            nested = None
        if indent and head.endswith("/") and nested is None:
            nested, nested_indent = current + head, indent
            sections[current] = sections.get(current, "") + line + "\n"
            continue
        key = nested or current
        sections[key] = sections.get(key, "") + line + "\n"
    return sections


def _modules() -> list[Path]:
    """Every module of the package but the patches (patches/README.md is their table)."""
    return sorted(p.relative_to(PACKAGE) for p in PACKAGE.rglob("*.py")
                  if p.name != "__init__.py" and "patches" not in p.relative_to(PACKAGE).parts)


def _packages() -> list[str]:
    """Every package under the package root, nested ones as `rollout/weight_sync` (patches/ has its own table)."""
    return sorted(str(p.parent.relative_to(PACKAGE)) for p in PACKAGE.glob("**/__init__.py")
                  if p.parent != PACKAGE and "patches" not in p.parent.relative_to(PACKAGE).parts)


def _listed(section: str, name: str) -> bool:
    """`name` starts a line of the section (a module's own line in the map)."""
    return re.search(rf"^\s*{re.escape(name)}\s", section, re.M) is not None


def test_the_tree_is_what_the_test_expects():
    # guards the test itself: it sees the package, the benchmarks and the docs
    assert Path("metric_names.py") in _modules() and "trainer" in _packages()
    assert (REPO / "benchmarks" / "bench_correction.py").is_file() and (REPO / "docs" / "design.md").is_file()


@pytest.mark.parametrize("module", _modules(), ids=str)
def test_design_lists_every_module(module):
    section = _sections(DESIGN)[f"{module.parent}/" if module.parent != Path() else ""]
    assert _listed(section, module.name), f"docs/design.md §2: add a line for {module} under its package"


def test_design_lists_nothing_that_is_gone():
    sections = _sections(DESIGN)
    for package in [*_packages(), ""]:
        for name in re.findall(r"^\s*(\w+\.py)\s", sections.get(f"{package}/" if package else "", ""), re.M):
            assert (PACKAGE / package / name).is_file(), f"docs/design.md §2 lists {package}/{name}, which is gone"
    for name in re.findall(r"^\s*(\w+\.py)\s", sections["benchmarks/"], re.M):
        assert (REPO / "benchmarks" / name).is_file(), f"docs/design.md §2 lists benchmarks/{name}, which is gone"


def test_the_readme_links_the_map_and_holds_no_copy_of_it():
    text = README.read_text(encoding="utf-8")
    assert "docs/design.md" in text, "README: link docs/design.md, where the module map lives"
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", text, re.M | re.S)
    copied = [line for block in blocks for line in block.splitlines()
              if re.match(rf"(openrlhf_tis/)?({'|'.join(_packages())})/\s", line)]
    assert not copied, f"README: a copy of the module map ({copied[:2]}); it lives only in docs/design.md §2"


def _benchmarks() -> list[str]:
    return sorted(p.name for p in (REPO / "benchmarks").glob("*.py"))


def _docs() -> list[str]:
    docs = REPO / "docs"
    return sorted([p.name for p in docs.glob("*.md")] + [f"{p.name}/" for p in docs.iterdir() if p.is_dir()])


def test_every_benchmark_is_listed():
    for name in _benchmarks():
        assert _listed(_sections(DESIGN)["benchmarks/"], name), f"docs/design.md §2: add benchmarks/{name}"


def test_every_doc_is_listed():
    for name in _docs():
        assert name in _sections(DESIGN)["docs/"], f"docs/design.md §2: add docs/{name}"
