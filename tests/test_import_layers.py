"""The package's imports flow one way (docs/design.md §2): no module cycle, no upward import.

Every `.py` file under `openrlhf_tis/` (the top-level `patches/` links to `openrlhf_tis/patches/`) is parsed
with `ast`; every `import` / `from ... import` of an `openrlhf_tis.*` module is an edge, wherever it sits
(module level, inside a function, under `if TYPE_CHECKING:`): a function-local import only hides a cycle
from the interpreter, it does not remove the dependency. Relative imports are resolved against the
importing module. An import of a package is an edge to its `__init__`; `from openrlhf_tis.a import b`
is an edge to `openrlhf_tis.a.b` when `b` is a submodule, to `openrlhf_tis.a` otherwise.

A dependency written as a string counts the same: a string constant naming a module of the package
(`"openrlhf_tis.demo.tiny_model"` run with `python -m`, a `"module:attribute"` or `"module.attribute"`
reference such as Ray's setup hook) is an edge, and a call of `importlib.import_module`, `__import__`,
`runpy.run_module` or `runpy.run_path` whose target is not such a literal is refused outright: it would
hide an edge from this test.

Package `__init__` files that re-export their own submodules (`from .config import X` in
`correction/__init__.py`) are the standard Python pattern, and a submodule importing a sibling never goes
through its package's `__init__` here (edges point at the submodule itself), so such re-exports create no
cycle unless a submodule imports its own package by name, which is then reported like any other cycle.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ROOT = REPO / "openrlhf_tis"


def _module_files() -> dict[str, tuple[Path, bool]]:
    """Module name -> (file, is_package)."""
    modules = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        modules[".".join(["openrlhf_tis", *parts])] = (path, is_package)
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


_MODULE_STRING = re.compile(r"openrlhf_tis(\.[A-Za-z_]\w*)+(:[A-Za-z_]\w*)?")
_DYNAMIC_IMPORTS = {"import_module", "__import__", "run_module", "run_path"}


def _tree(module: str) -> ast.Module:
    path, _ = MODULES[module]
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _string_target(text: str) -> str | None:
    """The module of the package a string names (itself, or the owner of its last `.attr` / `:attr`), or None."""
    if not _MODULE_STRING.fullmatch(text):
        return None
    name = text.split(":")[0]
    if name in MODULES:
        return name
    owner = name.rpartition(".")[0]
    return owner if ":" not in text and owner in MODULES else None


def _constants(tree: ast.Module) -> dict[str, str]:
    """Module-level `NAME = "text"` assignments, to resolve a dynamic import's target named by a constant."""
    return {target.id: node.value.value for node in tree.body if isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
            for target in node.targets if isinstance(target, ast.Name)}


def _dynamic_targets(tree: ast.Module) -> list[str | None]:
    """The target of every dynamic import call in a module: its string, or None where no literal names it."""
    constants = _constants(tree)
    targets = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
        if name not in _DYNAMIC_IMPORTS:
            continue
        arg = node.args[0]
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            targets.append(arg.value)
        else:
            targets.append(constants.get(arg.id) if isinstance(arg, ast.Name) else None)
    return targets


def _imports(module: str) -> set[str]:
    """Modules of the package that `module` imports, anywhere in its file, or names in a string."""
    _, is_package = MODULES[module]
    package = module if is_package else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(_tree(module)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            target = _string_target(node.value)
            if target is not None and target != module:
                found.add(target)
            continue
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
    assert "openrlhf_tis.demo.tiny_model" in GRAPH["openrlhf_tis.pipeline.train"]  # a `python -m` string
    assert "openrlhf_tis.patches" in GRAPH["openrlhf_tis.cli.ray_cluster"]  # "openrlhf_tis.patches.ray_worker_setup"


def test_strings_naming_modules_are_edges():
    assert _string_target("openrlhf_tis.pipeline.train:run_training") == "openrlhf_tis.pipeline.train"
    assert _string_target("openrlhf_tis.rollout.weight_sync.receive.CPUWorkerExtension") == \
        "openrlhf_tis.rollout.weight_sync.receive"
    assert _string_target("openrlhf_tis.viz") == "openrlhf_tis.viz"
    assert _string_target("openrlhf_tis.token_dump.schema_version") is None  # a key, not a module
    assert _string_target("openrlhf_tis.cli.train_ppo_ray: error: ") is None
    tree = ast.parse("import importlib, runpy\nM = 'openrlhf_tis.viz'\nimportlib.import_module(M)\n"
                     "runpy.run_module(f'{M}.x')\n__import__('openrlhf_tis.runs')\n")
    assert _dynamic_targets(tree) == ["openrlhf_tis.viz", None, "openrlhf_tis.runs"]


def test_no_dynamic_import_hides_a_dependency():
    """importlib / runpy / __import__ on anything but a literal would be an edge this test cannot see."""
    hidden = [m for m in MODULES for target in _dynamic_targets(_tree(m)) if target is None]
    assert not hidden, f"dynamic imports without a literal target in: {sorted(set(hidden))}"


def test_find_cycle_finds_cycles():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_no_import_cycle():
    cycle = _find_cycle(GRAPH)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def _folder(module: str) -> str:
    """The folder a module sits in (`openrlhf_tis.trainer`; nested ones count as theirs), or `openrlhf_tis` for the
    package's own bottom modules."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 or MODULES[module][1] else parts[0]


FOLDER_GRAPH = {folder: set() for folder in map(_folder, MODULES)}
for _module, _targets in GRAPH.items():
    FOLDER_GRAPH[_folder(_module)].update(_folder(t) for t in _targets if _folder(t) != _folder(_module))


def test_no_folder_cycle():
    """Folders import one way too: two folders that import each other form no module cycle, yet neither can be read,
    tested or moved without the other (the guards every layer uses are bottom modules for that reason)."""
    cycle = _find_cycle(FOLDER_GRAPH)
    assert cycle is None, "folder cycle: " + " -> ".join(cycle)
    assert {"openrlhf_tis", "openrlhf_tis.rollout"} <= FOLDER_GRAPH["openrlhf_tis.patches"]  # guards the test


def test_core_layers_import_nothing_above_them():
    upward = _upward(("openrlhf_tis.correction", "openrlhf_tis.runs"),
                     ("openrlhf_tis.cli", "openrlhf_tis.trainer", "openrlhf_tis.rollout", "openrlhf_tis.pipeline",
                      "openrlhf_tis.viz"))
    assert not upward, "\n".join(upward)


def test_the_store_and_the_plots_read_metric_names_not_the_correction():
    """runs/ and viz/ read metrics.jsonl and token dumps: the keys come from the bottom module metric_names, so
    neither needs the correction core (nor torch through it) to read a run."""
    upward = _upward(("openrlhf_tis.runs", "openrlhf_tis.viz"), ("openrlhf_tis.correction",))
    assert not upward, "\n".join(upward)
    assert "openrlhf_tis.metric_names" in GRAPH["openrlhf_tis.runs.summary"]  # guards the test


def test_the_study_and_the_dashboard_are_the_top_layer():
    """The study drives the pipeline and the dashboard serves it; nothing below imports either."""
    tops = ("openrlhf_tis.study", "openrlhf_tis.dashboard")
    below = tuple(sorted({".".join(m.split(".")[:2]) for m in MODULES if "." in m} - set(tops)))
    upward = _upward(below, tops)
    assert not upward, "\n".join(upward)
    assert "openrlhf_tis.pipeline.sweep" in GRAPH["openrlhf_tis.study.dose_response"]  # guards the test


def test_library_layers_import_no_entry_point():
    upward = _upward(("openrlhf_tis.rollout", "openrlhf_tis.trainer"), ("openrlhf_tis.cli", "openrlhf_tis.pipeline"))
    assert not upward, "\n".join(upward)


def test_viz_imports_no_pipeline():
    """The plots and widgets sit below the notebook pipelines: a notebook's parameter table sits with its code and
    the checks are the bottom layer's (openrlhf_tis.params)."""
    upward = _upward(("openrlhf_tis.viz",), ("openrlhf_tis.pipeline", "openrlhf_tis.cli"))
    assert not upward, "\n".join(upward)


def test_patches_import_rollout_and_trainer_never_the_reverse():
    """Patches wire the fork's rollout and trainer classes into upstream; no layer below the entry points uses a
    patch: the guards and import hooks every layer uses are bottom modules (upstream_guards, import_hooks)."""
    below = ("openrlhf_tis.correction", "openrlhf_tis.runs", "openrlhf_tis.rollout", "openrlhf_tis.trainer",
             "openrlhf_tis.moe", "openrlhf_tis.run_spec", "openrlhf_tis.demo", "openrlhf_tis.viz")
    upward = _upward(below, ("openrlhf_tis.patches",))
    assert not upward, "\n".join(upward)
    assert "openrlhf_tis.rollout.fp32_head" in GRAPH["openrlhf_tis.patches.cpu_fp32_head"]  # guards the test
    assert "openrlhf_tis.upstream_guards" in GRAPH["openrlhf_tis.trainer.ppo_trainer"]  # guards the test


def test_bottom_modules_import_only_each_other():
    """The top-level modules (errors, params, model_files, ...) are the layer every other may use."""
    bottom = {m for m, (path, is_package) in MODULES.items() if m.count(".") == 1 and not is_package}
    assert {"openrlhf_tis.errors", "openrlhf_tis.params", "openrlhf_tis.upstream_guards"} <= bottom
    upward = sorted(f"{m} imports {t}" for m in bottom for t in GRAPH[m] - bottom)
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
