"""Each fork flag is declared once (openrlhf_tis/flags.py) and everything else is a view of that declaration.

The rule for "a default stated twice": a dataclass that holds flags as given (a run-spec plan: it has a field made
with `flag(...)`) states no default of its own. Each of its fields is a flag's declaration (`flag(...)`), a nested
plan (`field(...)`), or a decided value whose default says "nothing decided" (None or an empty tuple). A literal
there would be a second statement of some flag's default, free to drift from it (DumpPlan said 0/0 where the CLI said
10/8). The other checks: an empty command line resolves to each plan's own defaults, the parser's defaults are the
declarations', and a notebook parameter that becomes a fork flag has the flag's types and choices.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "openrlhf_tis"
NOTHING_DECIDED = (None, ())


def _called(node: ast.expr | None) -> str | None:
    """The name a default calls (`flag`, `field`, `dataclasses.field`), or None when it is no call."""
    if not isinstance(node, ast.Call):
        return None
    return node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)


def restated_defaults(source: str) -> list[str]:
    """`Class.field = default` for every default a flag-holding dataclass in `source` states of its own."""
    found = []
    for cls in (n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef)):
        fields = [n for n in cls.body if isinstance(n, ast.AnnAssign) and n.value is not None]
        if not any(_called(f.value) == "flag" for f in fields):
            continue
        for f in fields:
            if _called(f.value) in ("flag", "field"):
                continue
            try:
                if ast.literal_eval(f.value) in NOTHING_DECIDED:
                    continue
            except ValueError:
                pass
            found.append(f"{cls.name}.{ast.unparse(f.target)} = {ast.unparse(f.value)}")
    return found


def test_no_flag_default_is_stated_twice():
    offences = [f"{path.relative_to(PACKAGE)}: {offence}" for path in sorted(PACKAGE.rglob("*.py"))
                for offence in restated_defaults(path.read_text(encoding="utf-8"))]
    assert not offences, "a plan states a default of its own; declare the flag in its field instead: " + \
        "; ".join(offences)
    assert "flag(" in (PACKAGE / "run_spec" / "plans.py").read_text(encoding="utf-8")  # guards the test


def test_the_rule_catches_a_planted_duplicate():
    planted = '''
@dataclass(frozen=True)
class SyncPlan:
    every: int = flag("--vllm.sync_every", 1, "help")
    check_steps: int = 1
    decided: int | None = None
    parts: tuple = ()
    nested: Other = field(default_factory=Other)
'''
    assert restated_defaults(planted) == ["SyncPlan.check_steps = 1"]
    assert restated_defaults(planted.replace('flag("--vllm.sync_every", 1, "help")', "1")) == []  # no flag: no plan


@pytest.fixture(scope="module")
def fork_parser():
    from openrlhf_tis.cli.train_ppo_ray import build_parser

    return build_parser()


def test_an_empty_command_line_resolves_to_each_plans_own_defaults(fork_parser):
    from openrlhf_tis.cli.cluster_device import assumed_cluster
    from openrlhf_tis.cli.resolve import resolve
    from openrlhf_tis.run_spec import RunSpec

    spec = resolve(fork_parser.parse_args([]), set(), assumed_cluster(cuda=False))
    plans = {f.name: f.default_factory() for f in dataclasses.fields(RunSpec)
             if f.default_factory is not dataclasses.MISSING}
    assert set(plans) == {"rollout", "sync", "dumps", "reward", "staleness"}  # guards the test
    assert {name: getattr(spec, name) for name in plans} == plans


def test_the_parser_takes_every_fork_flag_from_its_declaration(fork_parser):
    from openrlhf_tis.cli.fork_flags import FLAGS, FORK_FLAGS
    from openrlhf_tis.run_spec import spec_flags

    assert len(FLAGS) == len(FORK_FLAGS), "a flag is declared twice"
    assert set(spec_flags()) <= set(FLAGS)
    actions = {a.option_strings[0]: a for a in fork_parser._actions if a.option_strings}
    for name, declared in FLAGS.items():
        action = actions[name]
        assert action.default == (bool(declared.default) if declared.switch else declared.default), name
        assert action.help == declared.help, name
        assert (None if action.choices is None else tuple(action.choices)) == declared.choices, name


def test_a_notebook_parameter_that_becomes_a_fork_flag_has_its_type_and_choices():
    from openrlhf_tis.cli.fork_flags import FLAGS
    from openrlhf_tis.pipeline.train_params import TrainParams

    become = {name: p for name, p in TrainParams.spec().items() if p.flag in FLAGS}
    assert {"rollout_precision", "int8_weight_bits", "sync_every", "token_dump_every"} <= set(become)  # guards
    for name, p in become.items():
        declared = FLAGS[p.flag]
        assert p.types == ((bool,) if declared.switch else (declared.type,)), name
        assert p.choices == declared.choices, name
