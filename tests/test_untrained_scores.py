"""The untrained scores' cache (trainer/untrained_scores.py, StartEvalPart): its key, its file, its reuse rule.

The key is built from the real training command (TrainParams.argv through the fork's parser), so what a study
varies between cells is tested as the CLI spells it. tests/test_e2e_repeat.py shows on real runs that a
reused score is the one the run computes itself.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from openrlhf_tis import cpu_features
from openrlhf_tis.cli import train_ppo_ray
from openrlhf_tis.cli.checks import check_outputs
from openrlhf_tis.errors import UsageError
from openrlhf_tis.params import ParameterError
from openrlhf_tis.pipeline.sweep import UNTRAINED_DIR, load_grid, run_cell
from openrlhf_tis.pipeline.train_params import TrainParams
from openrlhf_tis.trainer.step_part import StartEvalPart
from openrlhf_tis.trainer.untrained_scores import (
    UntrainedCache,
    cache_path,
    may_reuse,
    read_scores,
    untrained_key,
    write_scores,
)

REVISION, VERSIONS = {"revision": "abc", "dirty": False}, {"vllm": "0.32"}
HOST = {"capability": "AVX512", "kernels": [], "cpus": 2}


@pytest.fixture(scope="module")
def parser():
    return train_ppo_ray.build_parser()


@pytest.fixture
def files(tmp_path):
    """A model folder, held-out and reward files: the inputs the key reads by content."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"layers": 2}')
    (model / "model.safetensors").write_bytes(b"\x00" * 64)
    (tmp_path / "eval.jsonl").write_text('{"input": "1+1", "label": "2"}\n')
    (tmp_path / "reward.py").write_text("def reward_func(q, p, l):\n    return {'rewards': [0.0]}\n")
    return tmp_path


def _key(parser, files: Path, run: str = "run", host: dict = HOST, revision: dict = REVISION,
         versions: dict = VERSIONS, **values) -> str:
    params = TrainParams(**{"eval_prompts": str(files / "eval.jsonl"), "reward": str(files / "reward.py"),
                            "train_dtype": "fp32", **values})
    argv = params.argv(files / "model", files / f"{run}.prompts.jsonl", files / run)[3:]
    return untrained_key(parser.parse_args(argv), revision, versions, host)


# What a study varies between the cells of one seed: none of it acts before the untrained evaluation.
SAME = [{"lr": 5e-5}, {"correction": "off"}, {"sync_every": 8}, {"steps": 48}, {"eval_every": 4},
        {"token_dump_every": 0}, {"untrained_cache": "/x/elsewhere"}, {"extra_args": ["--algo.kl.init_coef", "0.1"]}]
# What the untrained scores depend on.
DIFFERENT = [{"seed": 2}, {"eval_samples": 4}, {"max_new_tokens": 17}, {"rollout_precision": "int8"},
             {"extra_args": ["--vllm.fp32_lm_head"]}, {"extra_args": ["--eval.temperature", "0.7"]},
             {"extra_args": ["--reward.stop_properly_penalty_coef", "0"]}, {"train_dtype": "bf16"}]


@pytest.mark.parametrize("values", SAME, ids=lambda v: next(iter(v)))
def test_what_acts_after_the_untrained_evaluation_keeps_the_key(parser, files, values):
    assert _key(parser, files, run="other", **values) == _key(parser, files)


@pytest.mark.parametrize("values", DIFFERENT, ids=lambda v: json.dumps(v))
def test_what_the_untrained_scores_depend_on_changes_the_key(parser, files, values):
    assert _key(parser, files, **values) != _key(parser, files)


@pytest.mark.parametrize("change", ["model weights", "model config", "eval file", "reward file", "revision",
                                    "dirty", "versions", "cpu", "cpu kernels"])
def test_the_files_content_the_code_and_the_machine_change_the_key(parser, files, change):
    before = _key(parser, files)
    context = {}
    if change == "model weights":
        (files / "model" / "model.safetensors").write_bytes(b"\x01" + b"\x00" * 63)  # same size, same name
    elif change == "model config":
        (files / "model" / "config.json").write_text('{"layers": 3}')
    elif change == "eval file":
        (files / "eval.jsonl").write_text('{"input": "1+2", "label": "3"}\n')
    elif change == "reward file":
        (files / "reward.py").write_text("def reward_func(q, p, l):\n    return {'rewards': [1.0]}\n")
    else:
        context = {"revision": {"revision": {**REVISION, "revision": "abd"}},
                   "dirty": {"revision": {**REVISION, "dirty": True}},
                   "versions": {"versions": {"vllm": "0.33"}}, "cpu": {"host": {**HOST, "capability": "AVX2"}},
                   "cpu kernels": {"host": {**HOST, "kernels": ["amx_bf16"]}}}[change]
    assert _key(parser, files, **context) != before


def _pair_set(*pairs):
    return SimpleNamespace(prompts=[p for p, _ in pairs], labels=[label for _, label in pairs])


def test_scores_are_reused_only_when_no_held_out_question_is_trained_on():
    held_out = _pair_set(("1+1", "2"), ("2+2", "4"))
    assert may_reuse(held_out, _pair_set(("3+3", "6"), ("1+1", "3")))  # same question, another label: another key
    assert not may_reuse(held_out, _pair_set(("3+3", "6"), ("2+2", "4")))
    assert not may_reuse(held_out, None)  # the training prompts are not in this process (async training)


scores = st.dictionaries(st.sampled_from(["eval_default_pass1", "eval_default_pass4", "eval_response_length_mean",
                                          "eval_truncated_rate"]),
                         st.floats(allow_nan=False, allow_infinity=False), min_size=1)


@settings(max_examples=50, deadline=None)
@given(logs=scores)
def test_stored_scores_read_back_bit_for_bit(tmp_path_factory, logs):
    folder = tmp_path_factory.mktemp("cache")
    write_scores(folder, "k1", logs, seconds=3.0)
    back = read_scores(folder, "k1")
    assert back == logs and all(repr(back[k]) == repr(v) for k, v in logs.items())
    assert read_scores(folder, "k2") is None


def test_a_damaged_or_foreign_file_is_no_score(tmp_path):
    cache_path(tmp_path, "k").write_text('{"schema": 1, "logs": {"eval_')
    assert read_scores(tmp_path, "k") is None
    cache_path(tmp_path, "k").write_text('{"schema": 99, "logs": {"eval_pass1": 0.5}}')
    assert read_scores(tmp_path, "k") is None


class _Controller:
    """What StartEvalPart calls: the evaluation (counted) and the hand-out of logs to the parts (recorded)."""

    def __init__(self, logs):
        self.logs, self.evaluated, self.published = logs, [], []

    def evaluate(self, step):
        self.evaluated.append(step)
        self.publish(step, self.logs, 12.0)
        return self.logs

    def publish(self, step, logs, seconds):
        self.published.append((step, dict(logs), seconds))


def test_the_first_run_evaluates_and_stores_a_later_one_reuses_the_same_logs(tmp_path):
    logs = {"eval_default_pass1": 0.27734375, "eval_response_length_mean": 21.7421875}
    first, later = _Controller(logs), _Controller({"eval_default_pass1": -1.0})
    cache = UntrainedCache(tmp_path, "key", reusable=True)
    StartEvalPart(first.evaluate, cache, first.publish).on_start(0)
    assert first.evaluated == [0] and read_scores(tmp_path, "key") == logs
    StartEvalPart(later.evaluate, cache, later.publish).on_start(0)
    assert later.evaluated == []
    [(step, published, seconds)] = later.published
    assert step == 0 and published == logs and 0 <= seconds < 12.0  # the lookup's time, not the evaluation's


def test_a_run_that_may_not_reuse_evaluates_and_a_resumed_run_does_neither(tmp_path):
    write_scores(tmp_path, "key", {"eval_default_pass1": 0.5}, seconds=1.0)
    controller = _Controller({"eval_default_pass1": 0.5})
    part = StartEvalPart(controller.evaluate, UntrainedCache(tmp_path, "key", reusable=False), controller.publish)
    part.on_start(4)
    assert controller.evaluated == []
    part.on_start(0)
    assert controller.evaluated == [0] and len(controller.published) == 1


def test_a_cache_needs_somewhere_to_publish(tmp_path):
    with pytest.raises(ValueError, match="publish"):
        StartEvalPart(lambda step: {}, UntrainedCache(tmp_path, "key", reusable=True))


def test_a_cache_folder_that_is_a_file_is_refused_naming_the_flag(tmp_path):
    (tmp_path / "taken").write_text("")
    args = SimpleNamespace(**{"ckpt.output_dir": str(tmp_path / "model"), "eval.dataset": None,
                              "ckpt.best_metric_key": "none", "ckpt.save_steps": -1, "ckpt.save_hf": False,
                              "logger.tensorboard_dir": None, "eval.untrained_cache": str(tmp_path / "taken")})
    with pytest.raises(UsageError, match="--eval.untrained_cache"):
        check_outputs(args)


def test_a_sweep_shares_one_folder_and_a_grid_may_not_set_it(tmp_path, monkeypatch):
    grid = tmp_path / "grid.toml"
    grid.write_text('[base]\nuntrained_cache = "/x"\n[grid]\nseed = [1]\n')
    with pytest.raises(ParameterError, match="untrained_cache"):
        load_grid(grid)
    grid.write_text("[grid]\nseed = [1, 2]\n")
    cells, ran = load_grid(grid), []
    monkeypatch.setattr(sys.modules[run_cell.__module__], "execute_stoppable",
                        lambda name, notebook, params, cwd: ran.append(params))
    results = [run_cell(cell, tmp_path / "out") for cell in cells]
    assert {p["untrained_cache"] for p in ran} == {str(tmp_path / "out" / UNTRAINED_DIR)}
    for result in results:  # the recorded parameters are the grid's: cells recorded before the cache stay done
        status = json.loads((result.run_dir.parent / "status.json").read_text())
        assert "untrained_cache" not in status["params"] and "run_dir" not in status["params"]


def test_the_machine_record_names_the_kernels_within_one_capability_level(monkeypatch):
    """torch's capability says AVX512 on Ice Lake (bf16 emulated) and Sapphire Rapids (AMX) alike: a score computed
    with AMX's kernels must not be reused where bf16 is emulated, so the record names the extensions."""
    caps = {"avx512_vnni": True, "amx_bf16": True, "avx512_bf16": False, "cpu_name": "test CPU"}
    monkeypatch.setattr(cpu_features, "_capabilities", lambda: caps)
    with_amx = cpu_features.machine()
    assert with_amx["kernels"] == ["amx_bf16", "avx512_vnni"]
    caps["amx_bf16"] = False
    without = cpu_features.machine()
    assert without["kernels"] == ["avx512_vnni"] and without["capability"] == with_amx["capability"]
    assert cpu_features.cpu_name() == "test CPU"


@pytest.mark.skipif(not Path("/proc/cpuinfo").is_file(), reason="reads Linux's /proc/cpuinfo")
def test_this_machines_kernels_agree_with_the_kernels_cpu_flags():
    flags = set(next(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("flags")).split(":", 1)[1].split())
    assert cpu_features.machine()["kernels"] == [f for f in cpu_features.KERNEL_FLAGS if f in flags]
