"""docs/gpu.md is runnable as written: its training commands are the recipe files it links (each checked by
tests/test_gpu_recipes.py on the GPUs it is written for), every flag the page names exists (with its
value, where one is given), and each row of the OpenRLHF table resolves to one configuration on both sides."""

from __future__ import annotations

import fnmatch
import re
import shlex
from pathlib import Path

import pytest

from openrlhf_tis.cli import train_ppo_ray
from openrlhf_tis.cli.checks import check_correction

DOC = (Path(__file__).resolve().parents[1] / "docs" / "gpu.md").read_text(encoding="utf-8")
MODULE = "openrlhf_tis.cli.train_ppo_ray"
PROSE = re.sub(r"```.*?```", "", DOC, flags=re.S)  # inline code outside the fenced blocks


@pytest.fixture(scope="module")
def parser():
    parser = train_ppo_ray.build_parser()

    def error(message: str):
        raise ValueError(message)

    parser.error = error
    return parser


def _commands() -> list[list[str]]:
    """The training CLI's arguments in each command of the page's bash blocks (continuation lines joined)."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", DOC, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            tokens = shlex.split(line, comments=True)
            if MODULE in tokens:
                commands.append(tokens[tokens.index(MODULE) + 1:])
    return commands


def _flag_spans(text: str) -> list[str]:
    return [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", text) if span.startswith("--")]


# What makes a correction active; a span of other fields alone (prose: "add `--algo.correction.denominator kept`")
# is read on top of one, as the text means it (alone the fork refuses a field the resolved correction never reads).
SOURCES = ("--algo.correction.preset", "--algo.correction.mode", "--algo.correction.loss",
           "--algo.correction.rejection", "--algo.advantage.is_correction")


def _resolve(parser, span: str):
    """The CorrectionConfig a span of flags resolves to (an engine added: a correction needs rollout log-probs)."""
    base = [] if any(source in span for source in SOURCES) else ["--algo.correction.preset", "tis"] + (
        ["--algo.correction.batch_normalize"] if "normalize_scope" in span else [])
    return check_correction(parser.parse_args([*base, *span.split(), "--vllm.num_engines", "1"]))


def test_the_page_runs_its_recipes_from_files_that_exist():
    """Its training commands are the recipe files (tests/test_gpu_recipes.py checks each against the CLI on the
    cluster it is written for); the page shows none inline that could drift from them."""
    assert _commands() == []
    linked = set(re.findall(r"\(\.\./scripts/gpu/([\w.]+)\)", DOC))
    recipes = {path.name for path in (Path(__file__).resolve().parents[1] / "scripts" / "gpu").iterdir()}
    assert linked == recipes and {"one_node_colocated.sh", "multi_node_ray_job.sh", "slurm.sbatch"} <= linked
    assert all(f"bash scripts/gpu/{name}" in DOC for name in ("one_node_colocated.sh",))


def test_every_flag_the_page_names_exists_and_takes_the_value_it_is_given(parser):
    options = {option for action in parser._actions for option in action.option_strings}
    spans = _flag_spans(PROSE)
    assert len(spans) > 60  # the tables' cells are here: a regex that lost them must fail
    for span in spans:
        tokens = span.split()
        unknown = [t for t in tokens if t.startswith("--") and not fnmatch.filter(options, t)]  # `--x.*`: a family
        assert not unknown, f"docs/gpu.md names {unknown} in `{span}`"
        if any(not t.startswith("--") for t in tokens):  # flags with values: parsed, corrections resolved
            try:
                if "correction" in span:
                    _resolve(parser, span)
                else:
                    parser.parse_args(tokens)
            except Exception as err:
                raise AssertionError(f"docs/gpu.md: `{span}` is refused: {err}") from None


def test_each_openrlhf_row_resolves_to_one_configuration_on_both_sides(parser):
    section = PROSE[PROSE.index("## Coming from OpenRLHF"):PROSE.index("## Coming from verl")]
    rows = re.findall(r"^\| `(--algo\.advantage\.[^`]+)` \| `(--algo\.correction\.[^`]+)` \|", section, re.M)
    assert len(rows) == 6
    for upstream, fork in rows:
        assert _resolve(parser, upstream) == _resolve(parser, fork), (upstream, fork)
