"""Every command in a fenced bash block of README.md and docs/*.md still parses, in a dry form that runs nothing:
the training CLI's own parser, the study's --dry_run, the main job up to where it would start training, the
argument parser of every other command, papermill's parameters against the notebook's, pytest's marker
expression against the registered markers, pip's extras against setup.py. A flag renamed, a module moved, an
extra dropped or a marker unregistered fails here, naming the page and the command. CI runs exactly the
README's test command (.ci/run), checked here too."""

from __future__ import annotations

import argparse
import ast
import importlib
import re
import shlex
import tomllib
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SHELL_BLOCK = re.compile(r"^```(?:bash|sh|shell)\n(.*?)^```", re.M | re.S)
ENV_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")


@dataclass(frozen=True)
class Command:
    page: str
    line: str

    @property
    def argv(self) -> list[str]:
        tokens = shlex.split(self.line, comments=True)
        while tokens and ENV_ASSIGNMENT.match(tokens[0]):  # OPENRLHF_TIS_STUDY=... bash ...
            tokens.pop(0)
        return tokens


def commands(text: str, page: str = "") -> list[Command]:
    """The commands of a page's bash blocks: continuation lines joined, comments and blank lines left out."""
    found = []
    for block in SHELL_BLOCK.findall(text):
        for line in block.replace("\\\n", " ").splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                found.append(Command(page, line.strip()))
    return found


ALL = [c for page in PAGES for c in commands(page.read_text(encoding="utf-8"), str(page.relative_to(REPO)))]


class Parsed(Exception):
    """The command line parsed; its dry form stops here."""


@contextmanager
def stop_after_parsing():
    """argparse parses as usual, then raises Parsed instead of returning: nothing after parsing runs."""
    original = argparse.ArgumentParser.parse_args

    def parse_args(self, args=None, namespace=None):
        raise Parsed(original(self, args, namespace))

    with mock.patch.object(argparse.ArgumentParser, "parse_args", parse_args):
        yield


def _drop_ellipsis(args: list[str]) -> list[str]:
    """`... ` standing for "your other flags" (not a flag's value) is left out."""
    return [a for i, a in enumerate(args) if not (a == "..." and (i == 0 or not args[i - 1].startswith("-")))]


def _module_command(module: str, args: list[str], tmp: Path) -> str:
    """Run `python -m module args` in its dry form; returns what was checked."""
    args = _drop_ellipsis(args)
    if not module.startswith("openrlhf_tis."):
        return f"not this project's ({module})"
    if module == "openrlhf_tis.cli.train_ppo_ray":  # its main() would start Ray: its own parser only
        from openrlhf_tis import patches
        from openrlhf_tis.cli.train_ppo_ray import build_parser

        patches.apply_platform_patches("cpu")
        build_parser().parse_args(args)
        return "parsed by the training CLI's parser"
    if module == "openrlhf_tis.study.dose_response" and "--report" not in args:
        from openrlhf_tis.study import dose_response as study

        study.main([*args, "--out", str(tmp / "study"), "--dry_run"])
        return "study --dry_run"
    target = importlib.import_module(module)
    if module == "openrlhf_tis.pipeline.main_job":  # checked up to the training notebook, which never starts
        with mock.patch.object(target, "run_main_job", side_effect=Parsed), pytest.raises(Parsed):
            target.main([*args, "--out", str(tmp / "main_job")])
        return "main job checked, training flags parsed"
    with stop_after_parsing(), pytest.raises(Parsed):
        target.main(args)
    return "parsed"


def _console_scripts() -> dict[str, str]:
    """setup.py's console scripts: name -> module."""
    found = re.findall(r'"([\w-]+)=([\w.]+):main"', (REPO / "setup.py").read_text())
    return dict(found)


def _extras() -> set[str]:
    tree = ast.parse((REPO / "setup.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "extras_require":
            return {k.value for k in node.value.keys}
    raise AssertionError("setup.py: no extras_require")


def _markers() -> set[str]:
    ini = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    return {re.split(r"[:(]", m, maxsplit=1)[0].strip() for m in ini.get("markers", [])}


def _pytest_args(args: list[str]) -> str:
    from _pytest.mark.expression import Expression

    for flag, value in zip(args, args[1:], strict=False):
        if flag == "-m":
            Expression.compile(value)  # a syntax error raises here
            names = set(re.findall(r"[\w.]+", value)) - {"and", "or", "not"}
            assert names <= _markers(), f"-m {value!r}: unregistered markers {sorted(names - _markers())}"
    return "pytest arguments checked"


def _papermill(args: list[str]) -> str:
    """The notebook exists and every -p NAME VALUE is one of its parameters with a valid value."""
    import nbformat
    from papermill.cli import _resolve_type

    notebook = REPO / args[0]
    assert notebook.is_file(), f"no notebook {args[0]}"
    check = next(c.source for c in nbformat.read(notebook, as_version=4).cells if ".from_notebook(" in c.source)
    module, name = re.search(r"from (\S+) import (\w+)", check).groups()  # the notebook's parameters class
    values = {args[i + 1]: _resolve_type(args[i + 2]) for i, a in enumerate(args) if a == "-p"}
    getattr(importlib.import_module(module), name).checked(values, where=args[0])
    return "papermill parameters checked"


def _script_command(script: Path, args: list[str]) -> str:
    """Run a repository script as `python SCRIPT args` would, up to its argument parsing."""
    import runpy
    import sys

    assert script.is_file(), f"no script {script.relative_to(REPO)}"
    # as python does: the script's own folder first on sys.path (a benchmark imports its neighbours)
    with stop_after_parsing(), mock.patch.object(sys, "argv", [str(script), *args]), \
            mock.patch.object(sys, "path", [str(script.parent), *sys.path]):
        try:
            runpy.run_path(str(script), run_name="__main__")
        except Parsed:
            return "the script's arguments parsed"
    raise AssertionError(f"{script.relative_to(REPO)} ran without parsing arguments")


def dry_run(argv: list[str], tmp: Path) -> str:
    """Check one command line without running it; returns what was checked, raises on a fault."""
    head, args = argv[0], argv[1:]
    tool = Path(head).name
    if tool == "bash":
        script = REPO / args[0]
        assert script.is_file(), f"no script {args[0]}"
        if script.name == "run_tests.sh":
            return _pytest_args(args[1:])
        module = re.search(r"-m (openrlhf_tis[\w.]+)", script.read_text())
        return _module_command(module.group(1), args[1:], tmp) if module else "script exists (the set-up)"
    if re.fullmatch(r"python(3(\.\d+)?)?", tool):
        if args[0].endswith(".py"):  # a script of the repository (benchmarks/)
            return _script_command(REPO / args[0], args[1:])
        assert args[0] == "-m", "only `python -m MODULE` and `python SCRIPT.py` commands are checked"
        if args[1] in ("venv", "pip"):
            return "Python's own module"
        return _module_command(args[1], args[2:], tmp)
    if tool in _console_scripts():
        return _module_command(_console_scripts()[tool], args, tmp)
    if tool == "pip":
        extras = re.findall(r"\.\[([\w,]+)\]", " ".join(args))
        if not extras:
            return "packages from the registry"
        wanted = set(extras[0].split(","))
        assert wanted <= _extras(), f"setup.py has no extras {sorted(wanted - _extras())}"
        return "extras exist"
    if tool == "ray":
        if "--" in args:  # `ray job submit ... -- COMMAND`: the job's command
            return dry_run(args[args.index("--") + 1:], tmp)
        return "Ray's own command"
    if tool == "papermill":
        return _papermill(args)
    raise AssertionError(f"no dry form for `{head}`: teach tests/test_docs_commands.py to check it")


def test_commands_are_extracted_as_a_reader_would_type_them():
    text = ("```bash\nbash scripts/study.sh --quick      # a comment\n# only a comment\n\n"
            "python -m m \\\n  --a 1 \\\n  --b 2\n```\n```python\nnot_a_command()\n```\n")
    assert [c.line for c in commands(text)] == ["bash scripts/study.sh --quick      # a comment",
                                                 "python -m m    --a 1    --b 2"]
    assert Command("", "OPENRLHF_TIS_STUDY=$PWD/x bash s.sh --y 'a b'  # c").argv == ["bash", "s.sh", "--y", "a b"]
    assert _drop_ellipsis(["-m", "x", "--flag", "...", "..."]) == ["-m", "x", "--flag", "..."]


def test_a_command_that_no_longer_parses_fails(tmp_path):
    for argv, fault in ((["python", "-m", "openrlhf_tis.cli.train_ppo_ray", "--algo.correction.preset", "nope"],
                         SystemExit),
                        (["bash", "scripts/main_job.sh", "--vllm.rollout_precisoin", "int8"], SystemExit),
                        (["bash", "scripts/study.sh", "--doses", "w3a8"], SystemExit),
                        (["bash", "scripts/run_tests.sh", "-m", "not e2ee"], AssertionError),
                        (["pip", "install", "-e", ".[cuda]"], AssertionError),
                        (["bash", "scripts/nope.sh"], AssertionError),
                        (["make", "all"], AssertionError)):
        with pytest.raises(fault):
            dry_run(argv, tmp_path)


def test_the_pages_hold_the_commands_this_test_is_for():
    lines = [c.line for c in ALL]
    assert "bash scripts/run_tests.sh     # the test suite (CI runs exactly this via .ci/run)" in lines
    assert any("openrlhf_tis.cli.train_ppo_ray" in line and "--algo.correction.preset tis" in line for line in lines)


def test_ci_runs_exactly_the_readmes_test_command():
    ci = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.startswith(("#", "set ", "cd "))]
    readme = [c.argv for c in ALL if c.page == "README.md"]
    assert len(ci) == 1 and shlex.split(ci[0]) in readme, f".ci/run runs {ci}, not a command of the README"


@pytest.mark.parametrize("command", ALL, ids=lambda c: f"{c.page}: {c.line[:60]}")
def test_every_command_parses(command, tmp_path, capsys):
    try:
        checked = dry_run(command.argv, tmp_path)
    except SystemExit as err:  # argparse's usage error, or the command's own one-line refusal
        pytest.fail(f"{command.page}: `{command.line}` does not parse (exit {err.code}):\n{capsys.readouterr().err}")
    assert checked
