"""The PPO actor with the fork's rollout correction as its policy loss.

Trace from flag to metric: `--algo.correction.*` (cli/fork_flags.py) is resolved once in the driver
(cli/checks.py `check_correction`) into `args.algo.correction.resolved` (JSON of a CorrectionConfig);
`CorrectionActorPPOTrainer` reads it, `CorrectionPolicyLoss` runs `correction.policy_loss` in place of
upstream's `PolicyLoss`, and the `mismatch/*` / `correction/*` metrics ride in `experience.info`,
which upstream's `training_step` already merges into the status dict that reaches its loggers and the
run store.

Upstream seams used:
- `PolicyModelActor` is a Ray actor class; Ray forbids subclassing it, so the plain class it wraps is
  subclassed and wrapped again (`ray.remote(num_gpus=1)`, as upstream does). patches/fork_classes.py
  points `openrlhf.trainer.ray.ppo_actor.PolicyModelActor` at it before `train()` runs.
- `init_model_from_pretrained` builds its `ActorPPOTrainer` by name with no factory seam, so the
  instance is re-classed to the fork's subclass right after construction and finishes its set-up there.
- Bypass mode skips the π_old forward: the actor answers the experience maker's `forward` with a
  placeholder (replaced by μ before the loss), or, when the controller installs it,
  `RolloutAsOldExperienceMaker` does not dispatch the forward at all (`install_bypass_experience_maker`),
  which also gives the reward's KL penalty μ as π_old.
"""

from __future__ import annotations

from collections.abc import Callable

import ray
import torch
import torch.distributed as dist
from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker
from openrlhf.trainer.ray.ppo_actor import ActorPPOTrainer
from openrlhf.trainer.ray.ppo_actor import PolicyModelActor as _UpstreamActorClass
from openrlhf.utils.loss_utils import _get_dp_group

from openrlhf_tis.correction import (
    CorrectionConfig,
    compute_correction,
    from_upstream,
    kept_weight_totals,
    policy_loss,
)

_UpstreamPolicyModelActor = _UpstreamActorClass.__ray_metadata__.modified_class.__ray_actor_class__


# ── configuration ──────────────────────────────────────────────────────────────────────────────────

def correction_config_from_args(args) -> CorrectionConfig:
    """The resolved CorrectionConfig of a run (hierarchized args, as the Ray actors receive them).

    The fork's CLI stores it in `args.algo.correction.resolved`; without it (upstream's own CLI, unit
    tests) upstream's `--algo.advantage.is_correction_*` flags are mapped.
    """
    resolved = getattr(getattr(args.algo, "correction", None), "resolved", None)
    if resolved:
        return CorrectionConfig.from_json(resolved)
    adv = args.algo.advantage
    return from_upstream(adv.is_correction_level, adv.is_correction_mode, adv.is_correction_gating,
                         adv.is_correction_threshold)


def dp_allreduce(strategy) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """A hook summing a tensor over the data-parallel group, or None when there is a single process."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    group = _get_dp_group(strategy)
    if dist.get_world_size(group=group) == 1:
        return None

    def allreduce(t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
        return t

    return allreduce


# ── the policy loss ────────────────────────────────────────────────────────────────────────────────

class CorrectionPolicyLoss:
    """Drop-in for upstream's `PolicyLoss` call in `training_step`, backed by `correction.policy_loss`.

    Returns upstream's 5-tuple (loss, clip_ratio, ppo_kl, vllm_kl, is_filter_ratio) so upstream's
    `training_step` runs unchanged, and writes every correction metric into `self.info` (the current
    experience's info dict) as 0-d tensors, which upstream token-weights across micro-batches and ranks.
    """

    def __init__(self, config: CorrectionConfig, *, clip_eps_low: float, clip_eps_high: float,
                 dual_clip: float | None, token_level_loss: bool,
                 allreduce: Callable[[torch.Tensor], torch.Tensor] | None = None):
        self.config = config.validate(training=True)
        self.clip_eps_low, self.clip_eps_high, self.dual_clip = clip_eps_low, clip_eps_high, dual_clip
        self.token_level_loss = token_level_loss
        self.allreduce = allreduce
        self.normalizer: torch.Tensor | None = None  # a replay-buffer-wide mean weight (ppo_train)
        self.info: dict | None = None

    def __call__(self, log_probs, old_log_probs, advantages, action_mask=None, rollout_log_probs=None, dp_size=1,
                 batch_num_tokens=None, global_batch_size=None):
        cfg = self.config
        if rollout_log_probs is None and cfg.enabled:
            raise RuntimeError(
                "--algo.correction: the correction needs rollout log-probs, but this experience has none "
                "(were the samples generated by vLLM with logprobs?)"
            )
        out = policy_loss(
            log_probs, old_log_probs, advantages, action_mask, rollout_log_probs, cfg,
            clip_eps_low=self.clip_eps_low, clip_eps_high=self.clip_eps_high, dual_clip=self.dual_clip,
            token_level_loss=self.token_level_loss, dp_size=dp_size, batch_num_tokens=batch_num_tokens,
            global_batch_size=global_batch_size, allreduce=self.allreduce, normalizer=self.normalizer,
            with_metrics=rollout_log_probs is not None,
        )
        metrics = out.correction.metrics
        if self.info is not None:
            for key, value in metrics.items():
                self.info[key] = torch.tensor(value, dtype=torch.float32)
        if not metrics:
            return out.loss, out.clip_ratio, out.ppo_kl, None, None
        # Upstream's own names keep their meaning: KL(μ‖π_old) by k1, and the share of filtered tokens.
        vllm_kl = torch.tensor(metrics["mismatch/k1_kl"])
        filtered = torch.tensor(metrics["correction/masked_frac"])
        return out.loss, out.clip_ratio, out.ppo_kl, vllm_kl, filtered


# ── the actor-side trainer ─────────────────────────────────────────────────────────────────────────

class CorrectionActorPPOTrainer(ActorPPOTrainer):
    """Upstream's ActorPPOTrainer with the fork's correction as its policy loss."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._setup_correction()

    def _setup_correction(self) -> None:
        """Replace the policy loss (PPO only; GSPO keeps upstream's loss, see cli/checks.py)."""
        self.correction = correction_config_from_args(self.args)
        if self.args.actor.policy_loss_type != "ppo":
            return
        self.actor_loss_fn = CorrectionPolicyLoss(
            self.correction,
            clip_eps_low=self.args.actor.eps_clip_low_high[0],
            clip_eps_high=self.args.actor.eps_clip_low_high[1],
            dual_clip=self.args.actor.dual_clip,
            token_level_loss=self.args.actor.loss_agg_mode == "token-mean",
            allreduce=dp_allreduce(self.strategy),
        )

    def ppo_train(self, kl_ctl: float):
        loss_fn = self.actor_loss_fn
        if isinstance(loss_fn, CorrectionPolicyLoss):
            loss_fn.normalizer = self._replay_buffer_normalizer()
        return super().ppo_train(kl_ctl)

    def training_step(self, experience, kl_ctl: float, step: int, loss_batch_info=None):
        loss_fn = self.actor_loss_fn
        if not isinstance(loss_fn, CorrectionPolicyLoss):
            return super().training_step(experience, kl_ctl, step, loss_batch_info)
        loss_fn.info = experience.info
        if self.correction.bypass and experience.rollout_log_probs is not None:
            # π_old := μ (the actor-side forward returned a placeholder; the KL loss reads it too).
            experience.action_log_probs = rollout_as_old(experience.rollout_log_probs, experience.action_mask)
        try:
            return super().training_step(experience, kl_ctl, step, loss_batch_info)
        finally:
            loss_fn.info = None

    @torch.no_grad()
    def _replay_buffer_normalizer(self) -> torch.Tensor | None:
        """Mean kept weight over the whole replay buffer of every rank (global self-normalization).

        In the decoupled loss the weights depend only on π_old and μ, both fixed for the step, so the
        mean can be taken once over the full data-parallel batch (DESIGN §3). The bypass losses read
        π_θ, which moves within the step: they normalize per micro-batch across ranks instead.
        """
        cfg = self.correction
        if not (cfg.batch_normalize and cfg.normalize_scope == "global" and cfg.loss == "decoupled"):
            return None
        items = self.replay_buffer.items
        totals = torch.zeros(2, dtype=torch.float64)
        usable = [e for e in items if e.rollout_log_probs is not None and e.action_log_probs is not None]
        if usable:
            pad = torch.nn.utils.rnn.pad_sequence
            old = pad([e.action_log_probs.float().reshape(-1) for e in usable], batch_first=True)
            roll = pad([e.rollout_log_probs.float().reshape(-1) for e in usable], batch_first=True)
            mask = pad([e.action_mask.float().reshape(-1) for e in usable], batch_first=True)
            out = compute_correction(old, roll, mask, cfg.replace(batch_normalize=False), with_metrics=False)
            totals = kept_weight_totals(out.weights, out.mask, cfg.level).double()
        allreduce = self.actor_loss_fn.allreduce
        if allreduce is not None:
            device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
            totals = allreduce(totals.to(device)).cpu()
        total, count = totals.tolist()
        return torch.tensor(total / count) if count > 0 and total > 0 else None


# ── the Ray actor ──────────────────────────────────────────────────────────────────────────────────

class _CorrectionPolicyModelActor(_UpstreamPolicyModelActor):
    def init_model_from_pretrained(self, strategy, pretrain, max_steps=None, vllm_engines=None):
        super().init_model_from_pretrained(strategy, pretrain, max_steps=max_steps, vllm_engines=vllm_engines)
        # Upstream constructed a plain ActorPPOTrainer (its vLLM sync group is already up); the fork's
        # subclass only adds methods, so re-classing the instance finishes the job without a second init.
        self.trainer.__class__ = CorrectionActorPPOTrainer
        self.trainer._setup_correction()

    def forward(self, sequences, action_mask=None, attention_mask=None, packed_seq_lens=None,
                mm_train_inputs_list=None):
        """π_old for the experience maker; in bypass mode a placeholder, the forward itself is skipped.

        The placeholder is replaced by the rollout log-probs before the loss (training_step). Only the
        reward's KL penalty (--algo.kl.init_coef > 0 without --algo.kl.use_loss) reads π_old in the
        controller, so then the forward still runs unless the controller skips the dispatch altogether
        (RolloutAsOldExperienceMaker).
        """
        if self.trainer.correction.bypass and not reward_kl_reads_old(self.strategy.args):
            return torch.zeros(action_mask.shape, dtype=torch.float32)
        return super().forward(sequences, action_mask, attention_mask, packed_seq_lens, mm_train_inputs_list)


def reward_kl_reads_old(args) -> bool:
    """Whether the experience maker folds KL(π_old ‖ π_ref) into the reward (it then needs π_old)."""
    return args.algo.kl.init_coef > 0 and not args.algo.kl.use_loss


PolicyModelActor = ray.remote(num_gpus=1)(_CorrectionPolicyModelActor)


# ── controller side: bypass skips the π_old forward ────────────────────────────────────────────────

class RolloutAsOldExperienceMaker(RemoteExperienceMaker):
    """Bypass mode: π_old := μ, so the actor-group forward that computes π_old is never dispatched.

    `make_experience` dispatches one `forward` per model group; the actor group's answer is replaced
    by a ready object holding the rollout log-probs, in the layout upstream's own placeholder for
    absent models (`dummy_ref`) uses. Non-finite rollout log-probs become 0 here (they feed the reward's
    KL term); the correction masks those tokens from the loss anyway.
    """

    _bypass_samples = None

    def make_experience(self, samples_list):
        self._bypass_samples = samples_list
        try:
            return super().make_experience(samples_list)
        finally:
            self._bypass_samples = None

    def _dispatch_forward(self, group, sync_condition, **kwargs):
        samples = self._bypass_samples
        if group is not self.actor_model_group or samples is None:
            return super()._dispatch_forward(group, sync_condition, **kwargs)
        if any(s.rollout_log_probs is None for s in samples):
            raise RuntimeError("--algo.correction.loss bypass_*: rollout log-probs are missing, cannot skip π_old")
        duplicate = self.args.ds.ring_attn_size * self.args.ds.tensor_parallel_size
        old = [rollout_as_old(s.rollout_log_probs, s.action_mask) for s in samples]
        return ray.put([[lp] for lp in old for _ in range(duplicate)])


def rollout_as_old(rollout_log_probs: torch.Tensor, action_mask: torch.Tensor) -> torch.Tensor:
    """μ in the place of π_old: finite (NaN/inf -> 0) and zero off the action tokens, like the actor's output."""
    finite = torch.nan_to_num(rollout_log_probs.float(), nan=0.0, posinf=0.0, neginf=0.0)
    return finite * action_mask.to(finite.dtype)


def install_bypass_experience_maker(controller) -> bool:
    """In bypass mode, switch the controller's experience maker to `RolloutAsOldExperienceMaker`.

    Call at the end of the PPO controller's __init__ (it owns `experience_maker` and `args`); returns
    whether it switched. Re-classing keeps every attribute upstream's constructor set.
    """
    if not correction_config_from_args(controller.args).bypass:
        return False
    maker = controller.experience_maker
    if not isinstance(maker, RolloutAsOldExperienceMaker):
        maker.__class__ = RolloutAsOldExperienceMaker
    return True
