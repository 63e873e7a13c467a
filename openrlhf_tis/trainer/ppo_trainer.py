"""The fork's PPO controller: upstream's PPOTrainer plus weight-sync checks and the run store.

Upstream's class is a Ray actor; Ray forbids subclassing actor classes, so the plain class it wraps
is subclassed and wrapped again. patches/fork_classes.py points upstream's `train()` at it.
"""

from __future__ import annotations

import ray
import torch
from openrlhf.trainer.ppo_trainer import PPOTrainer as _UpstreamActorClass

from openrlhf_tis.runs.store import RunWriter
from openrlhf_tis.trainer.ppo_actor import install_bypass_experience_maker
from openrlhf_tis.trainer.sync_check import SyncChecker

_UpstreamPPOTrainer = _UpstreamActorClass.__ray_metadata__.modified_class.__ray_actor_class__


def rollout_logprob_coverage(experiences) -> float:
    """Fraction of response tokens that carry a finite rollout log-prob (1.0 when rollouts are whole)."""
    covered = total = 0
    for exp in experiences:
        mask = exp.action_mask.bool()
        total += int(mask.sum())
        lp = exp.rollout_log_probs
        if lp is not None and lp.shape == mask.shape:
            covered += int((torch.isfinite(lp) & mask).sum())
    return covered / max(total, 1)


class _TisPPOTrainer(_UpstreamPPOTrainer):
    def __init__(self, pretrain, strategy, actor_model_group, critic_model_group, reward_model_group,
                 reference_model_group, vllm_engines, **generate_kwargs):
        super().__init__(pretrain, strategy, actor_model_group, critic_model_group, reward_model_group,
                         reference_model_group, vllm_engines, **generate_kwargs)
        vllm = self.args.vllm
        # A sleeping engine has no KV cache right after a sync, so it cannot score the probe then.
        self._sync_every = vllm.sync_check_steps if vllm_engines and not vllm.enable_sleep else 0
        self._sync_checker = None
        if self._sync_every:
            self._sync_checker = SyncChecker(
                self.tokenizer, vllm_engines, actor_model_group,
                temperature=self.args.rollout.temperature, tolerance=vllm.sync_check_tolerance,
            )
        self._syncs = 0
        self._sync_metrics: dict[str, float] = {}
        self._run = RunWriter(self.args.logger.run_dir) if self.args.logger.run_dir else None
        # Bypass mode: the experience maker must not even dispatch the pi_old forward (see ppo_actor).
        install_bypass_experience_maker(self)

    def init_checkpoint_states(self) -> dict:
        states = super().init_checkpoint_states()
        if self._run is not None:
            # The history must be the one actually trained: steps after the checkpoint are redone.
            dropped = self._run.rewind(states["global_step"])
            if dropped:
                print(f"[openrlhf_tis] run store: dropped {dropped} record(s) after step {states['global_step']}, "
                      "which this run trains again")
        return states

    def broadcast_to_vllm(self) -> None:
        self._syncs += 1
        due = self._sync_checker is not None and self._syncs % self._sync_every == 0
        probe = self._sync_checker.before_sync() if due else None
        super().broadcast_to_vllm()
        if due:
            self._sync_metrics.update(self._sync_checker.after_sync(probe))

    def _compute_rollout_stats(self, experiences) -> dict:
        stats = super()._compute_rollout_stats(experiences)
        stats["rollout/logprob_coverage"] = rollout_logprob_coverage(experiences)
        return stats

    def train_step(self, rollout_samples, global_step: int):
        status, global_step = super().train_step(rollout_samples, global_step)
        status.update(self._sync_metrics)
        self._sync_metrics = {}
        return status, global_step

    def save_logs_and_checkpoints(self, global_step: int, logs_dict=None, client_states=None) -> None:
        if self._run is not None and logs_dict:
            self._run.append_metrics(global_step, logs_dict)
        super().save_logs_and_checkpoints(global_step, logs_dict, client_states)


TisPPOTrainer = ray.remote(_TisPPOTrainer)
