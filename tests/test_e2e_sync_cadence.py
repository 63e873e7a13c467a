"""A run with a known lag: `--vllm.sync_every 2` on the tiny model, 3 steps, through Ray, DeepSpeed and
vLLM. The engines get the weights after step 2 only, so step 1 and step 3 train on lag-0 samples and step 2 on
samples one version behind π_old; the metrics split the mismatch by that lag, and the sync check runs on the sync
that happened."""

from __future__ import annotations

import os
import subprocess

import pytest
from _support import read_steps, train_argv

from openrlhf_tis.demo.task import write_prompts
from openrlhf_tis.metric_names import STALENESS_MAX, SYNC_GAP_MEAN, mismatch_lag_key

pytestmark = pytest.mark.e2e
STEPS = 3


@pytest.fixture(scope="module")
def cadence_run(tiny_model_dir, tmp_path_factory):
    work = tmp_path_factory.mktemp("cadence")
    write_prompts(work / "prompts.jsonl", 4 * STEPS)
    argv = train_argv(tiny_model_dir, work, STEPS, dump_every=0, save_steps=-1, load=False)
    argv += ["--vllm.sync_every", "2"]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run(argv, cwd=work, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return read_steps(work / "run")


def test_each_steps_samples_carry_the_lag_the_cadence_sets(cadence_run):
    assert [step[STALENESS_MAX] for step in cadence_run] == [0.0, 1.0, 0.0]


def test_the_mismatch_is_split_by_lag(cadence_run):
    first, second, third = cadence_run
    for synced in (first, third):
        assert mismatch_lag_key("k3", 0) in synced and mismatch_lag_key("k3", "stale") not in synced
    assert mismatch_lag_key("k3", 0) not in second  # every sample of step 2 is one version behind
    assert second[mismatch_lag_key("k3", 1)] == second[mismatch_lag_key("k3", "stale")] >= 0
    assert second[mismatch_lag_key("tokens", 1)] > 0


def test_only_the_syncs_that_happen_are_checked(cadence_run):
    assert [SYNC_GAP_MEAN in step for step in cadence_run] == [False, True, False]
