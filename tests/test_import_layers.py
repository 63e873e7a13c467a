"""The package's imports flow one way (docs/design.md §2): no module cycle, no upward import.

Every `.py` file under `openrlhf_tis/` and `patches/` (imported as `openrlhf_tis.patches`) is parsed
with `ast`; every `import` / `from ... import` of an `openrlhf_tis.*` module is an edge, wherever it sits
(module level, inside a function, under `if TYPE_CHECKING:`): a function-local import only hides a cycle
from the interpreter, it does not remove the dependency. Relative imports are resolved against the
importing module. An import of a package is an edge to its `__init__`; `from openrlhf_tis.a import b`
is an edge to `openrlhf_tis.a.b` when `b` is a submodule, to `openrlhf_tis.a` otherwise.

Package `__init__` files that re-export their own submodules (`from .config import X` in
`correction/__init__.py`) are the standard Python pattern, and a submodule importing a sibling never goes
through its package's `__init__` here (edges point at the submodule itself), so such re-exports create no
cycle unless a submodule imports its own package by name, which is then reported like any other cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ROOTS = {"openrlhf_tis": REPO / "openrlhf_tis", "openrlhf_tis.patches": REPO / "patches"}


def _module_files() -> dict[str, tuple[Path, bool]]:
    """Module name -> (file, is_package)."""
    modules = {}
    for prefix, root in ROOTS.items():
        for path in sorted(root.rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts = parts[:-1]
            modules[".".join([prefix, *parts])] = (path, is_package)
    return modules


MODULES = _module_files()


def _known(name: str) -> str | None:
    """The longest prefix of `name` that is a module of the package (None outside it)."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in MODULES:
            return candidate
    return None


def _imports(module: str) -> set[str]:
    """Modules of the package that `module` imports, anywhere in its file."""
    path, is_package = MODULES[module]
    package = module if is_package else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            # `from a import b`: an edge to a.b when b is a submodule, to a otherwise
            targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in MODULES else source
                       for alias in node.names]
        else:
            continue
        for target in targets:
            known = _known(target)
            if known is not None and known != module:
                found.add(known)
    return found


GRAPH = {module: _imports(module) for module in MODULES}


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a path [a, b, ..., a], or None (iterative depth-first search)."""
    WHITE, GREY, BLACK = 0, 1, 2
    colour = dict.fromkeys(graph, WHITE)
    for start in sorted(graph):
        if colour[start] != WHITE:
            continue
        stack = [(start, iter(sorted(graph[start])))]
        colour[start] = GREY
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                colour[node] = BLACK
                stack.pop()
            elif colour[child] == GREY:
                path = [n for n, _ in stack]
                return path[path.index(child):] + [child]
            elif colour[child] == WHITE:
                colour[child] = GREY
                stack.append((child, iter(sorted(graph[child]))))
    return None


def _under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _upward(lower: tuple[str, ...], upper: tuple[str, ...]) -> list[str]:
    return sorted(f"{m} imports {t}" for m, targets in GRAPH.items() if any(_under(m, p) for p in lower)
                  for t in targets if any(_under(t, p) for p in upper))


def test_graph_sees_the_package():
    """Guards the test itself: files were found and known edges were recorded."""
    assert "openrlhf_tis.correction.config" in MODULES and "openrlhf_tis.patches" in MODULES
    assert "openrlhf_tis.correction.config" in GRAPH["openrlhf_tis.correction"]  # relative, from the __init__
    assert "openrlhf_tis.runs.layout" in GRAPH["openrlhf_tis.runs.store"]


def test_find_cycle_finds_cycles():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_no_import_cycle():
    cycle = _find_cycle(GRAPH)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_core_layers_import_nothing_above_them():
    upward = _upward(("openrlhf_tis.correction", "openrlhf_tis.runs"),
                     ("openrlhf_tis.cli", "openrlhf_tis.trainer", "openrlhf_tis.rollout", "openrlhf_tis.pipeline",
                      "openrlhf_tis.viz"))
    assert not upward, "\n".join(upward)


def test_library_layers_import_no_entry_point():
    upward = _upward(("openrlhf_tis.rollout", "openrlhf_tis.trainer"), ("openrlhf_tis.cli", "openrlhf_tis.pipeline"))
    assert not upward, "\n".join(upward)


def _reachable(module: str) -> set[str]:
    seen, todo = set(), [module]
    while todo:
        for target in GRAPH[todo.pop()] - seen:
            seen.add(target)
            todo.append(target)
    return seen


def test_controller_does_not_import_the_actor():
    """The PPO controller (a Ray actor of its own) needs the dump plan and the bypass maker, not the actor's loss."""
    assert "openrlhf_tis.trainer.ppo_actor" not in _reachable("openrlhf_tis.trainer.ppo_trainer")
    assert "openrlhf_tis.trainer.token_dumps" in _reachable("openrlhf_tis.trainer.ppo_trainer")  # guards the test
