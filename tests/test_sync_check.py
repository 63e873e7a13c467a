"""The sync check on a real W4A8 vLLM-CPU engine: a coarse but correct sync passes, real failures do not.

The engine-vs-trainer gap of a correct W4A8 sync is the quantization itself, so a fixed tolerance stopped
healthy runs. SyncRule judges against the gap measured when both sides held the same weights,
and against whether the engine moved when the trainer did. The trainer here is the HF model in fp32 (the
DeepSpeed actor's forward, log-softmax of logits / temperature); the failures are the ones docs/design.md §5
lists: a sync that never reaches the engine, float weights cast unscaled into int8 parameters, NaN weights.
"""

from __future__ import annotations

import gc

import pytest
import torch
from _support import start_engine, take_training_step, trainer_model

from openrlhf_tis.rollout.checkpoint import write_rollout_model
from openrlhf_tis.rollout.weight_sync.reload import reload_into_engine
from openrlhf_tis.trainer.sync_check import (
    PROBE_TEXT,
    ProbeScore,
    SyncRule,
    WeightSyncError,
    probe_sampling_params,
    probe_score,
    trainer_sequence,
)

TEMPERATURE = 1.0


def _fork_sync(worker, named):
    reload_into_engine(worker.model_runner, named)  # quantizes onto the run's grid, then reloads


def _unquantized_sync(worker, named):
    """Upstream's path into an int8 engine: float weights land in int8 parameters unscaled (trap 5)."""
    worker.model_runner.reload_weights(weights_iterator=iter(named))


def _scores(llm, model, prompt_ids):
    """One engine's ProbeScore, with the trainer's side computed as the actor's forward does."""
    from vllm.inputs import TokensPrompt

    output = llm.generate(TokensPrompt(prompt_token_ids=prompt_ids), probe_sampling_params(TEMPERATURE, 8),
                          use_tqdm=False)[0]
    sequence, n = trainer_sequence(output)
    with torch.no_grad():
        logits = model(sequence).logits[0, :-1].float() / TEMPERATURE
    trainer_lp = torch.log_softmax(logits, -1).gather(-1, sequence[0, 1:, None])[:, 0]
    assert len(trainer_lp) == n
    return [probe_score(output, trainer_lp)]


@pytest.fixture(scope="module")
def sharp_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with its weights tripled: peaked distributions like a trained model's, where a 4-bit
    weight grid costs nats (the random tiny model is nearly uniform, so any grid costs little there)."""
    from _support import save_as_source

    model = trainer_model(tiny_model_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0)
    return save_as_source(model.to(torch.bfloat16), tiny_model_dir, tmp_path_factory.mktemp("sharp") / "model")


# The two diagnoses of an engine computing garbage after a sync; which one fires depends on the CPU's int8 kernel.
GARBAGE_SYNC = (r"disagree by .* more than when both held the same weights"
                r"|non-finite log-probs on the probe after the sync")


@pytest.mark.engine
def test_the_check_passes_a_coarse_sync_and_stops_failed_ones(sharp_model_dir, tmp_path):
    from transformers import AutoTokenizer

    prompt_ids = AutoTokenizer.from_pretrained(sharp_model_dir)(PROBE_TEXT, add_special_tokens=False)["input_ids"]
    model = trainer_model(sharp_model_dir)
    llm = start_engine(write_rollout_model(sharp_model_dir, tmp_path / "w4a8", precision="int8", weight_bits=4),
                       logprobs_mode="processed_logprobs", max_logprobs=1)
    try:
        rule = SyncRule(tolerance=0.5)
        baseline = rule.start(_scores(llm, model, prompt_ids))["sync/baseline_mean_abs_logprob"]
        assert baseline > 0.5, baseline  # the old fixed tolerance would stop a correct W4A8 run right away

        # 1. Correct W4A8 syncs of small and large steps pass, with their metrics.
        for scale in (0.002, 0.02):
            llm.collective_rpc(_fork_sync, args=(take_training_step(model, scale=scale, seed=int(scale * 1e3)),))
            metrics = rule.judge(_scores(llm, model, prompt_ids))
            print(f"W4A8 sync, step {scale}: {metrics}")
            assert metrics["sync/baseline_mean_abs_logprob"] == baseline
            assert metrics["sync/vllm_vs_trainer_excess"] < 0.5, metrics
            assert metrics["sync/vllm_probe_change_mean_abs"] > 0 and metrics["sync/trainer_probe_change_mean_abs"] > 0

        # 2. The sync never reaches the engine (a disabled weight-sync group, trap 1): the trainer moved, the
        #    engine computes bit-identical log-probs.
        take_training_step(model, scale=0.002, seed=3)
        with pytest.raises(WeightSyncError, match="kept its old weights"):
            rule.judge(_scores(llm, model, prompt_ids))

        # 3. Float weights cast unscaled into the int8 parameters (trap 5): garbage. What garbage the int8 kernel
        #    computes depends on the CPU (finite log-probs far beyond the baseline on AVX-512, NaN on plain AVX2):
        #    either way the check must stop the sync and say it failed.
        named = take_training_step(model, scale=0.002, seed=4)
        llm.collective_rpc(_unquantized_sync, args=(named,))
        with pytest.raises(WeightSyncError, match=GARBAGE_SYNC):
            rule.judge(_scores(llm, model, prompt_ids))

        # 4. NaN weights (an uninitialised sync buffer) through the fork's own sync.
        nan = [(n, torch.full_like(t, float("nan"))) for n, t in named]
        llm.collective_rpc(_fork_sync, args=(nan,))
        with pytest.raises(WeightSyncError, match="non-finite"):
            rule.judge(_scores(llm, model, prompt_ids))
    finally:
        del llm
        gc.collect()


def _score(gap, engine, trainer) -> list[ProbeScore]:
    return [ProbeScore(torch.tensor(gap), torch.tensor(engine), torch.tensor(trainer))]


def test_the_rule_on_hand_made_numbers():
    rule = SyncRule(tolerance=0.5)
    assert rule.start(_score([2.0, 1.0], [-1.0, -2.0], [-1.1, -2.1])) == {"sync/baseline_mean_abs_logprob": 1.5}
    metrics = rule.judge(_score([1.9, 2.0], [-1.2, -2.0], [-1.3, -2.1]))  # mean 1.95 <= 1.5 + 0.5 * 1.5
    assert metrics == pytest.approx({
        "sync/vllm_vs_trainer_mean_abs_logprob": 1.95, "sync/vllm_vs_trainer_max_abs_logprob": 2.0,
        "sync/baseline_mean_abs_logprob": 1.5, "sync/vllm_vs_trainer_excess": 0.45,
        "sync/vllm_probe_change_mean_abs": 0.1, "sync/trainer_probe_change_mean_abs": 0.1})
    rule.judge(_score([2.3, 2.1], [-1.0, -2.0], [-1.3, -2.1]))  # 2.2: within 1.5 + 0.5 x 1.5 (the gap is noisy)
    with pytest.raises(WeightSyncError, match="disagree by 2.3000"):
        rule.judge(_score([2.4, 2.2], [-1.1, -2.0], [-1.3, -2.1]))
    # Engine unchanged: stale only when the trainer moved beyond STALE_DRIFT (a frozen actor does not).
    rule.judge(_score([1.9, 2.0], [-1.2, -2.0], [-1.3, -2.1]))
    with pytest.raises(WeightSyncError, match="kept its old weights"):
        rule.judge(_score([1.9, 2.0], [-1.2, -2.0], [-1.3, -2.2]))
    with pytest.raises(WeightSyncError, match="non-finite"):
        rule.judge(_score([float("nan"), 2.0], [-1.0, -2.0], [-1.3, -2.1]))
    # Below one nat the tolerance is absolute: 0.2 + 0.5.
    exact = SyncRule(tolerance=0.5)
    exact.start(_score([0.2], [-1.0], [-1.0]))
    exact.judge(_score([0.69], [-1.1], [-1.0]))
    with pytest.raises(WeightSyncError, match="disagree by 0.7100"):
        exact.judge(_score([0.71], [-1.2], [-1.0]))
    # A resumed run has no baseline: its first check's gap becomes the baseline.
    resumed = SyncRule(tolerance=0.5)
    assert resumed.judge(_score([3.0], [-1.0], [-1.0]))["sync/baseline_mean_abs_logprob"] == 3.0
