"""docs/gpu.md is runnable as written: its training commands are the recipe files it links (each checked by
tests/test_gpu_recipes.py on the GPUs it is written for), every flag the page names exists (with its
value, where one is given), each row of the OpenRLHF tables resolves to one configuration on both sides (OpenRLHF
0.11.0's removed flags: refused, naming the 0.11.2 flags of their row), and each verl preset row resolves to what its
name says."""

from __future__ import annotations

import fnmatch
import re
import shlex
from pathlib import Path

import pytest

from openrlhf_tis.cli import train_ppo_ray
from openrlhf_tis.cli.checks import UPSTREAM_0110_FLAGS, refuse_upstream_0110_flags
from openrlhf_tis.cli.resolve import resolve_correction
from openrlhf_tis.errors import UsageError

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
    return resolve_correction(parser.parse_args([*base, *span.split(), "--vllm.num_engines", "1"]))


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
        if any(t in UPSTREAM_0110_FLAGS for t in tokens):  # OpenRLHF 0.11.0's: refused before argparse sees them
            with pytest.raises(UsageError):
                refuse_upstream_0110_flags(tokens)
            continue
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


OPENRLHF = PROSE[PROSE.index("## Coming from OpenRLHF"):PROSE.index("## Coming from verl")]
GSPO = "--actor.policy_loss_type gspo "


def test_each_openrlhf_row_resolves_to_one_configuration_on_both_sides(parser):
    rows = re.findall(rf"^\| `((?:{GSPO})?--algo\.advantage\.is_correction_level [^`]+)` \| "
                      rf"`((?:{GSPO})?--algo\.correction\.[^`]+)` \|", OPENRLHF, re.M)
    assert len(rows) == 7 and sum(upstream.startswith(GSPO) for upstream, _ in rows) == 1
    for upstream, fork in rows:
        assert upstream.startswith(GSPO) == fork.startswith(GSPO)
        assert _resolve(parser, upstream) == _resolve(parser, fork), (upstream, fork)


def test_each_openrlhf_0110_row_is_refused_naming_its_0112_flags_which_resolve_to_the_forks(parser):
    rows = re.findall(r"^\| `(--algo\.advantage\.is_correction_enable [^`]+)` \| `(--algo\.advantage\.[^`]+)` \| "
                      r"`(--algo\.correction\.[^`]+)` \|", OPENRLHF, re.M)
    assert [old.split()[-1] for old, _, _ in rows] == ["tis", "icepop", "seq-mask-tis"]
    for old, new, fork in rows:
        with pytest.raises(UsageError) as refusal:
            refuse_upstream_0110_flags(old.split())
        assert refusal.value.flag == "--algo.advantage.is_correction_enable" and new in str(refusal.value)
        assert _resolve(parser, new) == _resolve(parser, fork), (new, fork)


def test_each_verl_preset_row_resolves_to_what_its_name_says(parser):
    """The verl preset table against the presets' definitions (verl/trainer/config/algorithm.py): the loss from the
    prefix; IS weights from `token`/`seq` + `is`/`tis` (truncated at 2) or `icepop` (zeroed outside [0.5, 5]), else
    none; rejection from `_rs` (Geo-RS: geometric mean of μ/π_old in [0.999, 1.001], symmetric up to 1e-6; K3: mean
    k3 ≤ 0.01; `seq_is_rs`: μ/π_old's product in [0.5, 2]); the denominator shrinks with decoupled rejection only
    (verl edits response_mask before the update; in bypass mode it rejects inside the loss)."""
    section = PROSE[PROSE.index("verl's presets ("):PROSE.index("verl's older keys (")]
    rows = re.findall(r"^\| `(\w+)\(\)` \| `(--[^`]+)`[^|]*\|$", section, re.M)
    assert len(rows) == 19
    for name, span in rows:
        cfg = _resolve(parser, span)
        loss = ("bypass_ppo" if name.startswith("bypass_ppo_clip") else
                "bypass_reinforce" if name.startswith("bypass_pg") else "decoupled")
        if "icepop" in name:
            weights = ("token", "mask", 0.5, 5.0)
        elif re.search(r"seq_t?is|pg_is", name):
            weights = ("sequence", "truncate", None, 2.0)
        elif re.search(r"token_t?is", name):
            weights = ("token", "truncate", None, 2.0)
        else:
            weights = None
        rejection = (("ratio", "mean", 0.999, 1.001) if "geo_rs" in name else ("k3", "mean", None, 0.01)
                     if "k3_rs" in name else ("ratio", "sum", 0.5, 2.0) if name.endswith("_rs") else None)
        assert cfg.loss == loss, (name, span)
        if weights is None:
            assert cfg.mode == "none", (name, span)
        else:
            lower = cfg.lower_bound if cfg.mode in ("clip", "mask") else None
            assert (cfg.level, cfg.mode, lower, cfg.upper) == weights, (name, span)
        got = [(c.statistic, c.agg, c.lower, c.upper) for c in cfg.rejection]
        assert got == ([] if rejection is None else [rejection]), (name, span)
        assert cfg.denominator == ("kept" if rejection and loss == "decoupled" else "all"), (name, span)
        assert cfg.veto_threshold is None and cfg.opsm_delta is None and not cfg.batch_normalize, (name, span)
