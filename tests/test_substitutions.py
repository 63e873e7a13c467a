"""patches/README.md's table is the list of every substitution of upstream behaviour, wherever it lives.

The package, patches/ included, is scanned for the ways the fork substitutes upstream code (`scan_substitutions`);
each place found must be named in the table's `where` column, and every place the table names must exist. The guard
helpers themselves (openrlhf_tis/upstream_guards.py) are the mechanism, not a substitution: their call sites are
scanned, and so is every place that checks upstream with a guard, since a guard is there because something of
upstream is relied on or changed. The kinds, each with a sample below: the helpers' substitutions (`replace`, `swapped`,
`reclass`, import hooks); assignments to upstream modules and classes, by statement or `setattr`; a function of ours
assigned over an object's method; `__class__` / `__bases__`; `sys.modules`; `runpy`; a fork class placed below an
upstream one in a class's bases, and its methods that rely on upstream's `super()` call; a component upstream's
constructor built, replaced on the live object (`self.X`, read from upstream's installed source); a value upstream
reads set and restored around one call (`finally`); a patch wired in from the fork's code; a guard, or a guard's
error raised by hand. The guards the table names refuse an upstream they were not written for, naming the fork file
to review.
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import importlib.util
import re
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from openrlhf_tis.upstream_guards import PatchTargetMissingError, UnsupportedUpstreamError, reclass, require_super_chain

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "openrlhf_tis"
PATCHES = PACKAGE / "patches"
"""The patch package. The repository's top-level `patches` links here: the table names its files `patches/x.py`."""
TABLE = PATCHES / "README.md"
GUARD_HELPERS = PACKAGE / "upstream_guards.py"

UPSTREAM_PACKAGES = {"openrlhf", "vllm", "torch", "deepspeed", "transformers", "ray", "flash_attn"}
"""Top-level packages whose attributes the fork must not assign outside the table."""
SUBSTITUTING_HELPERS = {"replace", "add", "swapped", "reclass", "after_import", "around_import"}
"""Helpers of openrlhf_tis/upstream_guards.py and openrlhf_tis/import_hooks.py that change upstream objects or
imports."""
GUARDS = {"require_version", "require_super_chain"}
"""Guards of openrlhf_tis/upstream_guards.py: a place that checks upstream before it relies on or changes it is a
substitution's."""
GUARD_ERRORS = {"PatchTargetMissingError", "PatchConflictError", "UnsupportedUpstreamError"}
"""Raised by hand outside the helpers, one of these is a hand-written guard: its place is a substitution's too."""
HELPER_MODULES = ("upstream_guards", "import_hooks")
PATCH_PACKAGE = "openrlhf_tis.patches"
PATCH_ENTRY = "apply_platform_patches"
"""The documented way in to the platform patches (patches/README.md's first paragraph). Any other call from the fork
into a patch module wires that patch in at the caller's place, which the table must name."""
CODE_RUNNERS = {("runpy", "run_module"), ("runpy", "run_path"), ("importlib", "reload")}
CLASS_SURGERY = {"__class__", "__bases__"}


# ── the scan ─────────────────────────────────────────────────────────────────────────────────────────────


def _root(node: ast.AST) -> str | None:
    """The name an attribute chain starts from (`torch` for torch.cuda.x), None when it starts elsewhere."""
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _dotted(node: ast.AST) -> str:
    return f"{_dotted(node.value)}.{node.attr}" if isinstance(node, ast.Attribute) else getattr(node, "id", "")


def _defined_in(node: ast.AST) -> set[str]:
    """Names of the functions defined directly in `node`'s body (a module's, or a function's nested ones)."""
    return {n.name for n in ast.walk(node) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n is not node
            and (not isinstance(node, ast.Module) or n in node.body)}


def _assigned(node: ast.AST) -> list[ast.AST]:
    """The targets a statement assigns (`a.b = c = ...`, `a.b: T = ...`), tuples unpacked."""
    targets = [*node.targets] if isinstance(node, ast.Assign) else [node.target] if isinstance(
        node, ast.AnnAssign) else []
    flat = []
    while targets:
        target = targets.pop()
        if isinstance(target, (ast.Tuple, ast.List)):
            targets.extend(target.elts)
        else:
            flat.append(target)
    return flat


def _self_attributes(cls: ast.ClassDef) -> set[tuple[str, str]]:
    """(method, X) for each `self.X` that a method of `cls` assigns."""
    return {(method.name, t.attr) for method in cls.body if isinstance(method, (ast.FunctionDef, ast.AsyncFunctionDef))
            for n in ast.walk(method) for t in _assigned(n)
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}


def _super_method(node: ast.AST) -> str | None:
    """M when `node` is a call `super().M(...)`."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Call):
        called = node.func.value.func
        return node.func.attr if isinstance(called, ast.Name) and called.id == "super" else None
    return None


def _calls_super(function: ast.AST) -> bool:
    return any(_super_method(n) for n in ast.walk(function))


@functools.cache
def _upstream_module(module: str) -> tuple[ast.Module, bool] | None:
    """An installed upstream module's syntax tree (and whether it is a package), read without importing it."""
    top, *rest = module.split(".")
    spec = importlib.util.find_spec(top)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]).joinpath(*rest)
    for file, package in ((path.with_suffix(".py"), False), (path / "__init__.py", True)):
        if file.is_file():
            return ast.parse(file.read_text(encoding="utf-8")), package
    return None


def _imported(tree: ast.Module, module: str, package: bool) -> dict[str, tuple[str, str]]:
    """`from m import X as Y` in `module`: Y -> (absolute m, X)."""
    names = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            base = module.split(".")[:len(module.split(".")) + package - node.level] if node.level else []
            source = ".".join([*base, *([node.module] if node.module else [])])
            names.update({alias.asname or alias.name: (source, alias.name) for alias in node.names})
    return names


@functools.cache
def upstream_attributes(module: str, name: str) -> frozenset[tuple[str, str]]:
    """(method, X) for the attributes (`self.X = ...`) that upstream class `module.name` and its upstream bases set,
    read from the installed source. Bases written as a dotted path (`nn.Module`) are not followed."""
    found = _upstream_module(module)
    if found is None:
        return frozenset()
    tree, package = found
    imported = _imported(tree, module, package)
    cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name), None)
    if cls is None:  # re-exported from where it is defined
        origin = imported.get(name)
        return upstream_attributes(*origin) if origin and origin[0] != module else frozenset()
    attributes = set(_self_attributes(cls))
    for base in cls.bases:
        if isinstance(base, ast.Name):
            origin = imported.get(base.id, (module, base.id))
            if origin[0].split(".")[0] in UPSTREAM_PACKAGES and origin != (module, name):
                attributes |= upstream_attributes(*origin)
    return frozenset(attributes)


class _Scanner(ast.NodeVisitor):
    """Collects (file, place) for each substitution in one module; a place is `function`, `Class.method` or
    `Class` (nested functions count as the function they are defined in)."""

    def __init__(self, tree: ast.Module):
        self.hits: set[str] = set()
        self.scope: list[tuple[str, str]] = []  # ("class" | "def", name), outermost first
        self.upstream_names: set[str] = set()  # names bound to an upstream package, a module of it or a member
        self.helper_names: set[str] = set()  # SUBSTITUTING_HELPERS as imported here
        self.helper_modules: set[str] = set()  # `upstream_guards` / `import_hooks` imported as modules
        self.local_functions: list[set[str]] = [_defined_in(tree)]  # the functions each scope defines
        self.functions: list[ast.AST] = []  # the function statements being visited, outermost first
        self.fork_classes = {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
        self.upstream_classes: dict[str, tuple[str, str]] = {}  # name -> (upstream module, class) it stands for
        self.guard_errors: set[str] = set()  # GUARD_ERRORS as imported here
        self.patch_modules: set[str] = set()  # patch modules (and the patch package) imported by the fork
        self.patch_functions: set[str] = set()  # functions imported from a patch module by the fork
        self.module_names: set[str] = set()  # names bound by `import x` of any module (`sys`, `os`, ...)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    self.module_names.add(alias.asname or alias.name.split(".")[0])
                    if alias.name.split(".")[0] in UPSTREAM_PACKAGES:
                        self.upstream_names.add(alias.asname or alias.name.split(".")[0])
            elif isinstance(node, ast.ImportFrom):
                module = node.module or ""
                for alias in node.names:
                    bound = alias.asname or alias.name
                    if module.split(".")[0] in UPSTREAM_PACKAGES and node.level == 0:
                        self.upstream_names.add(bound)
                        self.upstream_classes[bound] = (module, alias.name)
                    elif module.split(".")[-1] in HELPER_MODULES and alias.name in SUBSTITUTING_HELPERS | GUARDS:
                        self.helper_names.add(bound)
                    elif module.split(".")[-1] in HELPER_MODULES and alias.name in GUARD_ERRORS:
                        self.guard_errors.add(bound)
                    elif alias.name in HELPER_MODULES:
                        self.helper_modules.add(bound)
                    elif node.level == 0 and PATCH_PACKAGE in (module, f"{module}.{alias.name}"):
                        self.patch_modules.add(bound)  # `from openrlhf_tis.patches import x`, or the package
                    elif node.level == 0 and module.startswith(f"{PATCH_PACKAGE}.") and (
                            module.split(".")[-1] not in HELPER_MODULES):
                        self.patch_functions.add(bound)  # `from openrlhf_tis.patches.x import f`
                    elif module.split(".")[0] == "openrlhf_tis" or node.level:
                        self.fork_classes.add(bound)
        # module-level names derived from upstream ones (`_Upstream = ray_actor_class(UpstreamClass)`)
        for node in tree.body:
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and any(
                    _root(arg) in self.upstream_names for arg in node.value.args):
                self.upstream_names.update(t.id for t in node.targets if isinstance(t, ast.Name))
                self.fork_classes.difference_update(t.id for t in node.targets if isinstance(t, ast.Name))
                origin = next((self.upstream_classes[a.id] for a in node.value.args
                               if isinstance(a, ast.Name) and a.id in self.upstream_classes), None)
                if origin:
                    self.upstream_classes.update((t.id, origin) for t in node.targets if isinstance(t, ast.Name))
        self._read_classes(tree)

    def _read_classes(self, tree: ast.Module) -> None:
        """What the module's class statements combine: for each fork class, the attributes that the upstream classes
        it is built with set (its upstream bases, and those of any class here that has it among its bases); and
        the methods, calling super(), of a fork class placed below an upstream one (they run only while upstream's
        override calls super(): the class-order trick)."""
        classes = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
        bases = {name: [_root(b) for b in node.bases] for name, node in classes.items()}

        def fork_bases(name: str) -> set[str]:  # the classes defined here that `name` is built on, itself included
            return {name}.union(*(fork_bases(b) for b in bases[name] if b in classes and b != name))

        def upstream_of(name: str) -> set[tuple[str, str]]:
            return {self.upstream_classes[b] for c in fork_bases(name) for b in bases[c] if b in self.upstream_classes}

        self.upstream_attributes: dict[str, frozenset[tuple[str, str]]] = {}
        for name in classes:
            partners = set().union(*(upstream_of(d) for d in classes if name in fork_bases(d)))
            self.upstream_attributes[name] = frozenset().union(*(upstream_attributes(*u) for u in partners))
        self.below_upstream: set[str] = set()  # `Class.method` places that rely on upstream's super() chain
        for name in classes:
            first = next((i for i, b in enumerate(bases[name]) if b in self.upstream_names), None)
            for below in bases[name][first + 1:] if first is not None else []:
                if below in classes:
                    self.below_upstream.update(
                        f"{below}.{f.name}" for f in classes[below].body
                        if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and _calls_super(f))

    def _place(self) -> str:
        """The scope's first function, with its class when it is a method; a class statement: the class."""
        names = []
        for kind, name in self.scope:
            names.append(name)
            if kind == "def":
                break
        return ".".join(names) or "<module>"

    def _hit(self) -> None:
        self.hits.add(self._place())

    def _scoped(self, node, kind: str, name: str) -> None:
        self.scope.append((kind, name))
        self.generic_visit(node)
        self.scope.pop()

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        # A fork class placed after an upstream one among the bases runs *below* upstream in the MRO: it works only
        # while upstream's override calls super() (the class-order trick).
        bases = [_root(b) for b in node.bases]
        first_upstream = next((i for i, b in enumerate(bases) if b in self.upstream_names), None)
        self.scope.append(("class", node.name))
        if first_upstream is not None and any(b in self.fork_classes for b in bases[first_upstream + 1:]):
            self._hit()
        self.generic_visit(node)
        self.scope.pop()

    def visit_FunctionDef(self, node) -> None:
        if self.scope and self.scope[-1][0] == "class" and f"{self.scope[-1][1]}.{node.name}" in self.below_upstream:
            self.hits.add(f"{self.scope[-1][1]}.{node.name}")
        self.local_functions.append(_defined_in(node))
        self.functions.append(node)
        self._scoped(node, "def", node.name)
        self.functions.pop()
        self.local_functions.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def _substitutes(self, target: ast.AST, value: ast.AST | None) -> bool:
        if isinstance(target, ast.Attribute):
            if target.attr in CLASS_SURGERY:
                return True  # obj.__class__ = ..., cls.__bases__ = ...
            if _root(target) in self.upstream_names:
                return True  # upstream_module.attr = ..., torch.cuda.x = ...
            if isinstance(value, ast.Lambda) or (isinstance(value, ast.Name) and value.id in self.local_functions[-1]):
                return True  # obj.method = a function of ours: an instance's or a module's method replaced
        if isinstance(target, ast.Subscript) and _dotted(target.value) == "sys.modules":
            return True
        return False

    def _replaces_upstream_component(self, target: ast.AST) -> bool:
        """`self.X = ...` in a fork class's method M, where X is an attribute the upstream classes it is built with
        set: a component upstream built, replaced on the live object. Not when only upstream's own M sets X and the
        fork's M does not first run upstream's (`super().M(...)` as a statement of its own): then the override sets
        it instead of upstream, as any override does."""
        classes = [name for kind, name in self.scope if kind == "class"]
        if not (classes and self.functions and isinstance(target, ast.Attribute)
                and isinstance(target.value, ast.Name) and target.value.id == "self"):
            return False
        method = self.functions[-1]
        setters = {m for m, x in self.upstream_attributes.get(classes[-1], ()) if x == target.attr}
        runs_upstream_first = any(isinstance(n, ast.Expr) and _super_method(n.value) == method.name
                                  for n in method.body)
        return bool(setters - {method.name}) or (bool(setters) and runs_upstream_first)

    def visit_Assign(self, node: ast.Assign) -> None:
        if any(self._substitutes(t, node.value) or self._replaces_upstream_component(t) for t in _assigned(node)):
            self._hit()
        self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if node.value is not None and self._replaces_upstream_component(node.target):
            self._hit()
        self.generic_visit(node)

    def visit_Try(self, node: ast.Try) -> None:
        """An object's attribute set, then restored in `finally`: `swapped` written out (a value upstream
        reads, changed for one call). A module's attribute (`sys.stderr`) is not an upstream object, nor is the fork
        object's own state (`self.X`; an upstream attribute of self is caught as a replaced component)."""
        restored = {_dotted(t) for n in node.finalbody for t in _assigned(n) if isinstance(t, ast.Attribute)
                    and _root(t) not in self.module_names and _dotted(t.value) != "self"}
        function = self.functions[-1] if self.functions else node
        changed = {_dotted(t) for n in ast.walk(function) for t in _assigned(n)
                   if isinstance(t, ast.Attribute) and not any(n is f for f in node.finalbody)}
        if restored & changed:
            self._hit()
        self.generic_visit(node)

    def visit_Raise(self, node: ast.Raise) -> None:
        if isinstance(node.exc, ast.Call) and isinstance(node.exc.func, ast.Name) and (
                node.exc.func.id in self.guard_errors):
            self._hit()
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        name = _dotted(func)
        if isinstance(func, ast.Name) and func.id in self.helper_names:
            self._hit()
        elif isinstance(func, ast.Attribute) and _root(func) in self.helper_modules and (
                func.attr in SUBSTITUTING_HELPERS):
            self._hit()
        elif tuple(name.rsplit(".", 1)) in CODE_RUNNERS:
            self._hit()
        elif (isinstance(func, ast.Name) and func.id in self.patch_functions) or (
                isinstance(func, ast.Attribute) and _root(func) in self.patch_modules and func.attr != PATCH_ENTRY):
            self._hit()  # a patch wired in by the fork, at this place
        elif name in ("sys.modules.update", "sys.modules.setdefault"):
            self._hit()
        elif name == "setattr" and len(node.args) == 3:
            target = ast.Attribute(value=node.args[0], attr="?", ctx=ast.Store())
            if self._substitutes(target, node.args[2]):
                self._hit()
        self.generic_visit(node)


def _python_files() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if p != GUARD_HELPERS)


def _table_name(path: Path) -> str:
    """How the table names a file of the package: a patch by its top-level path, any other from the repository."""
    return f"patches/{path.relative_to(PATCHES)}" if path.is_relative_to(PATCHES) else str(path.relative_to(REPO))


def scan_source(source: str) -> set[str]:
    """The places in one module's source where the scan finds a substitution."""
    tree = ast.parse(source)
    scanner = _Scanner(tree)
    scanner.visit(tree)
    return scanner.hits


def scan_substitutions() -> set[tuple[str, str]]:
    """(file relative to the repository, place) of every substitution the scan recognises."""
    return {(_table_name(path), place)
            for path in _python_files() for place in scan_source(path.read_text(encoding="utf-8"))}


# ── the table ────────────────────────────────────────────────────────────────────────────────────────────

PLACE = re.compile(r"(?P<file>[\w/]+\.py):(?P<places>[\w.]+(?:, [\w.]+)*)")


def table_rows() -> list[list[str]]:
    """The substitution table's rows, as cells."""
    lines = TABLE.read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| where |"))
    header = [cell.strip() for cell in lines[start].strip("|").split("|")]
    assert header == ["where", "upstream target (version read)", "what and why", "scope", "guard", "upstreamable?"]
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        assert len(cells) == len(header), f"a row of patches/README.md's table has {len(cells)} cells: {line[:80]}"
        rows.append(cells)
    return rows


def table_places() -> set[tuple[str, str]]:
    """(file, place) for every place the `where` column names (`path.py:function, Class.method, ...`)."""
    places = set()
    for cells in table_rows():
        spans = re.findall(r"`([^`]+)`", cells[0])
        assert spans, f"a row names no place: {cells[0]!r}"
        for span in spans:
            match = PLACE.fullmatch(span)
            assert match, f"`where` entry {span!r} is not `file.py:function[, Class.method ...]`"
            places.update((match["file"], place) for place in match["places"].split(", "))
    return places


def _defines(path: Path, place: str) -> bool:
    """Whether `path` defines `place`: a top-level function or class, or `Class.method`."""
    body = ast.parse(path.read_text(encoding="utf-8")).body
    *owner, name = place.split(".")
    if owner:
        classes = [n for n in body if isinstance(n, ast.ClassDef) and n.name == owner[0]]
        body = classes[0].body if len(owner) == 1 and classes else []
    return any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.name == name for n in body)


def test_every_place_the_table_names_exists():
    missing = [f"{file}:{place}" for file, place in sorted(table_places())
               if not (REPO / file).is_file() or not _defines(REPO / file, place)]
    assert not missing, f"patches/README.md names places that do not exist: {missing}"


def test_every_substitution_found_is_in_the_table():
    unlisted = sorted(scan_substitutions() - table_places())
    assert not unlisted, ("substitutions of upstream behaviour missing from patches/README.md's table (add a row, "
                          "guarded: see openrlhf_tis/upstream_guards.py): "
                          f"{[f'{file}:{place}' for file, place in unlisted]}")


def test_top_level_patches_is_the_patch_package():
    """The repository's top-level patches/ (docs and the table name files by it) is the package's own folder."""
    assert (REPO / "patches").is_symlink() and (REPO / "patches").resolve() == PATCHES
    assert Path(importlib.util.find_spec("openrlhf_tis.patches").origin).resolve() == PATCHES / "__init__.py"


def test_every_patch_module_has_a_row():
    named = {file for file, _ in table_places()}
    modules = {_table_name(p) for p in PATCHES.glob("*.py")
               if "\nNAME = " in p.read_text(encoding="utf-8")}
    assert modules and modules <= named, sorted(modules - named)


# ── the scan itself ──────────────────────────────────────────────────────────────────────────────────────

SAMPLE = textwrap.dedent("""
    import runpy
    import sys

    import openrlhf.trainer.ppo_trainer as upstream
    from openrlhf.models import Actor

    from openrlhf_tis.upstream_guards import reclass
    from openrlhf_tis.trainer.mixins import Mixin


    def module_attribute():
        upstream.PPOTrainer = object


    def instance_method(actor):
        def wrapper(*args):
            return args
        actor.forward = wrapper


    def by_setattr(model):
        setattr(model, "load_weights", lambda weights: None)


    def helper(obj):
        reclass(obj, Mixin, supported="==0.11.2", patch="sample")


    def class_surgery(obj):
        obj.__class__ = Mixin


    def runs_upstream_main():
        runpy.run_module("openrlhf.cli.train_ppo_ray", run_name="__main__")


    def stands_in_for_a_module():
        sys.modules["flash_attn"] = object()


    class Below(Actor, Mixin):
        pass


    class Above(Mixin, Actor):
        def plain(self, args, value):
            args.x = value
            self.y = len
            return Above
""")

SAMPLE_OF_CONTROL_FLOW = textwrap.dedent("""
    import sys

    from openrlhf.trainer.ppo_trainer import BasePPOTrainer, PPOTrainer
    from openrlhf.trainer.ray.ppo_actor import ActorPPOTrainer

    from openrlhf_tis import patches
    from openrlhf_tis.patches import rollout_engine
    from openrlhf_tis.upstream_guards import PatchTargetMissingError, require_version
    from openrlhf_tis.patches.upstream_cli import upstream_parser


    def checks_upstream():
        require_version("openrlhf", "==0.11.2", patch="sample")


    def refuses_upstream():
        raise PatchTargetMissingError("sample")


    def refuses_the_input(value):
        raise ValueError(value)


    def wires_a_patch_in(path):
        rollout_engine.apply(path)


    def uses_a_patched_parser():
        return upstream_parser()


    def applies_the_platform_patches():
        patches.apply_platform_patches("cpu")


    def changes_a_value_upstream_reads_for_one_call(args):
        chunk = args.rollout.batch_size
        args.rollout.batch_size = 64
        try:
            return chunk
        finally:
            args.rollout.batch_size = chunk


    def swaps_a_stream():
        stream = sys.stderr
        sys.stderr = sys.__stderr__
        try:
            return stream
        finally:
            sys.stderr = stream


    class Controller:
        def __init__(self):
            super().__init__()
            self.samples_generator = None
            self.parts = []

        def scoped(self, value):
            self.pending = value
            try:
                return value
            finally:
                self.pending = None


    class Hooks(BasePPOTrainer):
        def broadcast_to_vllm(self):
            super().broadcast_to_vllm()

        def plain(self):
            return self


    class Combined(Controller, PPOTrainer, Hooks):
        pass


    class LossReplaced(ActorPPOTrainer):
        def setup(self):
            self.actor_loss_fn = None


    class Override(ActorPPOTrainer):
        def __init__(self, *args):
            self.actor_loss_fn = None
""")
"""Each kind of control flow by substitution: placed in `Controller.__init__`, replacing the sample generator that
upstream's PPOTrainer.__init__ built; the class-order hook below upstream's PPOTrainer; a loss replaced after
upstream's set-up; guards; a patch wired in; a value upstream reads, changed for one call. And what is none: the
documented entry to the platform patches, a plain error, a module attribute swapped, the fork's own attributes, an
override that sets an attribute instead of upstream's same method."""


def test_the_scan_finds_each_kind_of_substitution_and_nothing_else():
    assert scan_source(SAMPLE) == {
        "module_attribute", "instance_method", "by_setattr", "helper", "class_surgery", "runs_upstream_main",
        "stands_in_for_a_module", "Below"}
    assert scan_source(SAMPLE_OF_CONTROL_FLOW) == {
        "checks_upstream", "refuses_upstream", "wires_a_patch_in", "uses_a_patched_parser",
        "changes_a_value_upstream_reads_for_one_call", "Controller.__init__", "Hooks.broadcast_to_vllm", "Combined",
        "LossReplaced.setup"}


def test_upstream_attributes_are_read_from_upstreams_source():
    """Where the installed openrlhf sets what the fork replaces (ppo_trainer.py's PPOTrainer.__init__; ppo_actor.py's
    ActorPPOTrainer.__init__), and that a re-exported class is followed to its definition."""
    assert ("__init__", "samples_generator") in upstream_attributes("openrlhf.trainer.ppo_trainer", "PPOTrainer")
    assert ("__init__", "actor_loss_fn") in upstream_attributes("openrlhf.trainer.ray.ppo_actor", "ActorPPOTrainer")
    assert upstream_attributes("openrlhf.models", "Actor") == upstream_attributes("openrlhf.models.actor", "Actor")
    assert ("__init__", "model") in upstream_attributes("openrlhf.models", "Actor")


# ── the guards refuse an upstream they were not written for, naming the fork file ─────────────────────────


@pytest.fixture()
def openrlhf_moved(monkeypatch):
    """An installed openrlhf other than 0.11.2, the release every substitution was read in."""
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.12.0" if name == "openrlhf" else real(name))


class _Policy(torch.nn.Module):
    def forward(self, sequences, action_mask=None, attention_mask=None, return_output=False):
        return sequences


def test_entropy_capture_refuses_another_openrlhf_and_touches_nothing(openrlhf_moved):
    from openrlhf_tis.trainer.token_dumps import capture_response_entropy

    policy = _Policy()
    with pytest.raises(UnsupportedUpstreamError, match=r"trainer/token_dumps\.py.*openrlhf==0\.11\.2.*0\.12\.0"):
        with capture_response_entropy(policy, [0]):
            pass
    assert "forward" not in vars(policy)


def test_entropy_capture_refuses_a_forward_of_another_shape():
    from openrlhf_tis.trainer.token_dumps import capture_response_entropy

    class Renamed(torch.nn.Module):
        def forward(self, input_ids, mask=None):
            return input_ids

    with pytest.raises(PatchTargetMissingError, match=r"trainer/token_dumps\.py.*Renamed\.forward"):
        with capture_response_entropy(Renamed(), [0]):
            pass
    with pytest.raises(PatchTargetMissingError, match=r"token_dumps\.py.*forward no longer exists"):
        from openrlhf_tis.upstream_guards import swapped

        with swapped(SimpleNamespace(), "forward", None, patch="openrlhf_tis/trainer/token_dumps.py"):
            pass


def test_entropy_capture_restores_the_forward_on_error():
    from openrlhf_tis.trainer.token_dumps import capture_response_entropy

    policy = _Policy()
    with pytest.raises(KeyError), capture_response_entropy(policy, [0]):
        assert "forward" in vars(policy)
        raise KeyError
    assert "forward" not in vars(policy)


class _Model(torch.nn.Module):
    def load_weights(self, weights):
        raise AssertionError("collected, not loaded")


def test_the_cuda_receive_refuses_a_model_without_load_weights_and_a_receive_that_bypasses_it(openrlhf_moved,
                                                                                            monkeypatch):
    import vllm.model_executor.model_loader.reload as vllm_reload

    from openrlhf_tis.rollout.weight_sync.receive_cuda import QuantizedCUDAWorkerExtension

    def update_weight(*_args):  # upstream's receive, which now loads some other way
        pass

    worker = QuantizedCUDAWorkerExtension()
    model_config = SimpleNamespace(dtype=torch.bfloat16)
    worker.model_runner = SimpleNamespace(model=_Model(), model_config=model_config,
                                          vllm_config=SimpleNamespace(model_config=model_config))
    with pytest.raises(UnsupportedUpstreamError, match=r"weight_sync/receive_cuda\.py.*openrlhf==0\.11\.2"):
        worker._received(update_weight, (), last=False)
    monkeypatch.undo()
    monkeypatch.setattr(vllm_reload, "initialize_layerwise_reload", lambda model: None)  # vLLM 0.29's signature
    with pytest.raises(PatchTargetMissingError, match=r"receive_cuda\.py.*WorkerWrap\.update_weight.*load_weights"):
        worker._received(update_weight, (), last=False)
    assert "load_weights" not in vars(worker.model_runner.model)
    worker.model_runner.model = torch.nn.Linear(1, 1)
    with pytest.raises(PatchTargetMissingError, match=r"weight_sync/receive_cuda\.py.*load_weights no longer"):
        worker._received(update_weight, (), last=False)


def test_the_sync_hooks_are_refused_when_upstream_stops_calling_super(monkeypatch):
    from openrlhf.trainer.ppo_trainer_async import TrainingActor

    from openrlhf_tis.ray_classes import ray_actor_class
    from openrlhf_tis.trainer.ppo_trainer import check_sync_hooks_reached

    check_sync_hooks_reached()  # upstream 0.11.2 as installed
    monkeypatch.setattr(ray_actor_class(TrainingActor), "broadcast_to_vllm", lambda self: None)
    with pytest.raises(PatchTargetMissingError,
                       match=r"trainer/ppo_trainer\.py.*TrainingActor\.broadcast_to_vllm no longer calls super"):
        check_sync_hooks_reached()


def test_require_super_chain_reads_the_overrides_above_the_fork_class():
    class Base:
        def hook(self):
            return "base"

    class Inner(Base):
        def hook(self):
            return super().hook()

    class Upstream(Base):
        def hook(self):
            return super().hook()

    class Fork(Upstream, Inner):
        pass

    require_super_chain(Fork, "hook", Inner, patch="fork.py")
    Upstream.hook = lambda self: "upstream"
    with pytest.raises(PatchTargetMissingError, match=r"'fork\.py'.*Upstream\.hook no longer calls super"):
        require_super_chain(Fork, "hook", Inner, patch="fork.py")


def test_reclass_refuses_an_upstream_that_renamed_an_overridden_method(monkeypatch):
    from openrlhf.utils.agent import SingleTurnAgentExecutor

    from openrlhf_tis.rollout.reward_executor import LoudRewardExecutor, make_rewards_loud

    executor = object.__new__(SingleTurnAgentExecutor)
    monkeypatch.delattr(SingleTurnAgentExecutor, "_fetch_rewards_via_func")
    with pytest.raises(PatchTargetMissingError,
                       match=r"rollout/reward_executor\.py.*SingleTurnAgentExecutor no longer has "
                             r"_fetch_rewards_via_func, which LoudRewardExecutor overrides"):
        make_rewards_loud(executor)
    assert type(executor) is SingleTurnAgentExecutor
    monkeypatch.undo()
    assert make_rewards_loud(executor) and type(executor) is LoudRewardExecutor
    reclass(executor, LoudRewardExecutor, supported="==0.11.2", patch="x", overrides=("gone",))  # idempotent


def test_the_actor_trainer_refuses_an_upstream_without_its_loss_attribute():
    from openrlhf_tis.trainer.ppo_actor import CorrectionActorPPOTrainer

    with pytest.raises(PatchTargetMissingError, match=r"trainer/ppo_actor\.py.*ActorPPOTrainer.*actor_loss_fn"):
        object.__new__(CorrectionActorPPOTrainer)._setup_correction()


def test_fp32_choices_are_added_once_and_refused_without_the_flag():
    import argparse

    from openrlhf_tis.cli.fork_flags import allow_fp32_training

    parser = argparse.ArgumentParser()
    parser.add_argument("--ds.param_dtype", choices=["bf16", "fp16"], default="bf16")
    allow_fp32_training(parser)
    allow_fp32_training(parser)
    assert parser._option_string_actions["--ds.param_dtype"].choices == ["bf16", "fp16", "fp32"]
    with pytest.raises(PatchTargetMissingError, match=r"cli/fork_flags\.py.*--ds\.param_dtype"):
        allow_fp32_training(argparse.ArgumentParser())


def test_whole_set_eval_refuses_another_openrlhf(openrlhf_moved):
    from openrlhf_tis.trainer.eval_samples import whole_set_eval

    with pytest.raises(UnsupportedUpstreamError, match=r"trainer/eval_samples\.py.*openrlhf==0\.11\.2"):
        whole_set_eval(SimpleNamespace())


def test_a_hook_on_a_module_that_cannot_be_hooked_is_refused(monkeypatch):
    import importlib.machinery

    from openrlhf_tis import import_hooks

    class NoLoader:
        def find_spec(self, fullname, path, target=None):
            return importlib.machinery.ModuleSpec(fullname, None) if fullname == "openrlhf_tis_unhookable" else None

    monkeypatch.setattr(sys, "meta_path", [*sys.meta_path, NoLoader()])
    monkeypatch.setattr(import_hooks, "_after", {})
    import_hooks.after_import("openrlhf_tis_unhookable", lambda module: None)
    with pytest.raises(PatchTargetMissingError, match="openrlhf_tis_unhookable.*cannot be hooked"):
        importlib.import_module("openrlhf_tis_unhookable")
