"""Verify every DeepSpeed -> vLLM weight sync by what the engines compute, not by what was sent.

A sync can fail silently (docs/design.md §5: a disabled NCCL group leaves NaN weights, a stale tied lm_head,
per-tensor loads that never reach packed CPU kernels) and the run still exits 0. So after a sync the
engines score a fixed probe text, and the trainer scores the same tokens:

- `sync/vllm_vs_trainer_mean_abs_logprob` (and `_max_`): |log mu - log pi| on tokens each engine
  sampled after the sync, at the rollout temperature (the same processed log-probs rollouts use);
  it should be at the level of the rollout mismatch (bf16 vs bf16 kernels), not larger.
- `sync/vllm_logprob_change_mean_abs`: how far the engine's prompt log-probs moved through the sync;
  zero with a training step that changed the weights means the engine kept its old weights.
A non-finite score or a mean gap above `--vllm.sync_check_tolerance` stops the run.
"""

from __future__ import annotations

from dataclasses import dataclass

import ray
import torch

PROBE_TEXT = "The quick brown fox jumps over the lazy dog. Question: what is 12 + 7? Answer: 19."


class WeightSyncError(RuntimeError):
    """The engines do not compute with the weights the trainer just sent."""


@dataclass
class SyncProbe:
    """Prompt log-probs (temperature 1, unprocessed) each engine gives the probe before a sync."""

    prompt_logprobs: list[torch.Tensor]


def _prompt_logprobs(output) -> torch.Tensor:
    ids = output.prompt_token_ids
    return torch.tensor([output.prompt_logprobs[i][tok].logprob for i, tok in enumerate(ids) if i > 0])


def _sampled_logprobs(output) -> tuple[list[int], torch.Tensor]:
    completion = output.outputs[0]
    ids = list(completion.token_ids)
    return ids, torch.tensor([completion.logprobs[i][tok].logprob for i, tok in enumerate(ids)])


class SyncChecker:
    """Scores the probe on the engines before a sync and on engines + trainer after it."""

    def __init__(self, tokenizer, vllm_engines, actor_group, temperature: float, tolerance: float, new_tokens: int = 8):
        self.prompt_ids = tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"]
        self.engines = vllm_engines
        self.actor_group = actor_group
        self.temperature = temperature
        self.tolerance = tolerance
        self.new_tokens = new_tokens

    def _score(self, max_tokens: int) -> list:
        from vllm import SamplingParams

        params = SamplingParams(
            temperature=self.temperature, max_tokens=max_tokens, prompt_logprobs=0, logprobs=0, seed=1234,
            ignore_eos=True,
        )
        return ray.get([engine.generate.remote(self.prompt_ids, params) for engine in self.engines])

    def before_sync(self) -> SyncProbe:
        return SyncProbe([_prompt_logprobs(o) for o in self._score(max_tokens=1)])

    def after_sync(self, probe: SyncProbe | None) -> dict[str, float]:
        outputs = self._score(max_tokens=self.new_tokens)
        gaps, changes = [], []
        for i, output in enumerate(outputs):
            new_ids, engine_lp = _sampled_logprobs(output)
            sequence = torch.tensor([self.prompt_ids + new_ids])
            action_mask = torch.ones(1, len(new_ids), dtype=torch.bool)
            trainer_lp = ray.get(
                self.actor_group.async_run_method(
                    method_name="forward",
                    sequences=sequence,
                    action_mask=action_mask,
                    attention_mask=torch.ones_like(sequence),
                )
            )[0][0].float()
            gap = (engine_lp - trainer_lp).abs()
            if not torch.isfinite(gap).all():
                raise WeightSyncError(
                    f"weight sync: engine {i} gives non-finite log-probs after the sync "
                    f"(engine {engine_lp.tolist()}, trainer {trainer_lp.tolist()}): the engine did not load the weights"
                )
            if gap.mean().item() > self.tolerance:
                raise WeightSyncError(
                    f"weight sync: engine {i} and the trainer disagree by {gap.mean().item():.4f} mean |dlogp| on the "
                    f"probe after a sync (tolerance {self.tolerance}, --vllm.sync_check_tolerance): the engine does "
                    "not compute with the trained weights"
                )
            gaps.append(gap)
            if probe is not None:
                changes.append((_prompt_logprobs(output) - probe.prompt_logprobs[i]).abs())
        gap = torch.cat(gaps)
        metrics = {
            "sync/vllm_vs_trainer_mean_abs_logprob": gap.mean().item(),
            "sync/vllm_vs_trainer_max_abs_logprob": gap.max().item(),
        }
        if changes:
            metrics["sync/vllm_logprob_change_mean_abs"] = torch.cat(changes).mean().item()
        return metrics
