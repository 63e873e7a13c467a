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
- Bypass mode skips the π_old forward: the controller's `RolloutAsOldExperienceMaker` (installed by
  `install_bypass_experience_maker`) never dispatches it and hands μ over as π_old, which also serves the
  reward's KL penalty. The actor's own `forward` stays exact: the weight-sync check scores with it.

Per-token dumps (run store, docs/design.md §6): before `fit` on a dumped step the controller hands the actors a
`TokenDumpPlan` (`set_token_dump`). Every replay-buffer item carries its sample id (`append` keeps
upstream's per-step sample index, which the buffer's split would drop); the planned samples are read
off their first training step of the step and each rank writes its rows as one Parquet file when
`ppo_train` ends. Steps without a plan take none of these paths and compute nothing extra.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
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
from openrlhf_tis.runs.schema import mask_reason_codes
from openrlhf_tis.runs.tokens import TokenDumpWriter, flatten_response_tokens

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
        self.capture: dict | None = None  # set for a micro-batch whose tokens are dumped: gets inputs + output

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
        if self.capture is not None:
            self.capture.update(log_probs=log_probs.detach(), old_log_probs=old_log_probs, advantages=advantages,
                                action_mask=action_mask, rollout_log_probs=rollout_log_probs, output=out)
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
        self.token_dump_plan: TokenDumpPlan | None = None  # set by the controller before a dumped step's fit
        self._token_dump: TokenDumpCollector | None = None  # live only inside ppo_train of a dumped step
        self._token_writer: TokenDumpWriter | None = None
        self._local_sample_ids = False  # True when the step's samples came without upstream's index
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
        self._token_dump = self._start_token_dump()
        try:
            status = super().ppo_train(kl_ctl)
            if self._token_dump is not None:
                status.update(self._write_token_dump(self._token_dump))
            return status
        finally:
            self._token_dump = None
            self._local_sample_ids = False  # the buffer is cleared after fit; the next step tags afresh

    def training_step(self, experience, kl_ctl: float, step: int, loss_batch_info=None):
        loss_fn = self.actor_loss_fn
        if not isinstance(loss_fn, CorrectionPolicyLoss):
            return super().training_step(experience, kl_ctl, step, loss_batch_info)
        loss_fn.info = experience.info
        if self.correction.bypass and experience.rollout_log_probs is not None:
            # π_old := μ, also for the KL loss (the experience maker already set it; this keeps it exact).
            experience.action_log_probs = rollout_as_old(experience.rollout_log_probs, experience.action_mask)
        dump = self._token_dump
        rows = dump.rows_to_collect(experience) if dump is not None else []
        try:
            if not rows:
                return super().training_step(experience, kl_ctl, step, loss_batch_info)
            loss_fn.capture = {}
            with capture_response_entropy(self.actor, rows) as found:
                status = super().training_step(experience, kl_ctl, step, loss_batch_info)
            started = time.perf_counter()
            dump.add(experience, rows, loss_fn.capture, found.get("entropy"))
            dump.seconds += time.perf_counter() - started + found.get("seconds", 0.0)
            return status
        finally:
            loss_fn.info = None
            loss_fn.capture = None

    # ── per-token dumps ──

    def append_experience(self, experience) -> None:
        """Add a batch to the replay buffer, each item keeping its sample id (`Experience.index`).

        Upstream's experience maker numbers the step's samples (`index`, in prompt order, groups of
        n_samples_per_prompt adjacent); the buffer's split drops that list, so it is put back on the items
        as a one-element list, which the collate step concatenates again. Batches re-packed by dynamic
        batching arrive without it: their items get rank-strided ids, unique across ranks, and no prompt id.
        """
        buffer = self.replay_buffer
        ids = experience.index
        n = len(experience.sequences)
        start = len(buffer.items)
        buffer.append(experience)
        if ids is None or len(ids) != n:
            self._local_sample_ids = True
            rank, world = dp_rank_and_size(self.strategy)
            ids = [(start + i) * world + rank for i in range(n)]
        new_items = buffer.items[-n:] if n else []
        for item, sample_id in zip(new_items, list(ids)[len(ids) - len(new_items):], strict=True):
            item.index = [int(sample_id)]

    def _start_token_dump(self) -> TokenDumpCollector | None:
        """Take the controller's plan for this step (consumed: a later step never reuses it)."""
        plan, self.token_dump_plan = self.token_dump_plan, None
        if plan is None:
            return None
        if not isinstance(self.actor_loss_fn, CorrectionPolicyLoss):
            warnings.warn(f"token dump of step {plan.step} skipped: dumps read the PPO correction loss, and "
                          f"--actor.policy_loss_type {self.args.actor.policy_loss_type} keeps upstream's loss",
                          stacklevel=2)
            return None
        return TokenDumpCollector(plan, self.correction, global_ids=not self._local_sample_ids)

    def _write_token_dump(self, dump: TokenDumpCollector) -> dict[str, float]:
        """Write this rank's rows of the step; any failure raises (the run stops, loudly).

        A dump that silently went missing or disagreed with the loss would mislead every later analysis
        of the run, and the run resumes from its last checkpoint, so stopping is the cheaper failure.
        """
        started = time.perf_counter()
        writes, part = dump_part(self.strategy)
        columns = dump.columns()
        rows = len(columns["token_id"]) if columns else 0
        if writes and rows:
            writer = self._token_writer
            if writer is None or writer.dir != Path(dump.plan.run_dir):
                writer = self._token_writer = TokenDumpWriter(dump.plan.run_dir, getattr(self, "tokenizer", None))
            writer.write_step(dump.plan.step, columns, part=part)
        dump.seconds += time.perf_counter() - started
        return {"run_store/token_dump_s": dump.seconds, "run_store/token_dump_tokens": float(rows)}

    @torch.no_grad()
    def _replay_buffer_normalizer(self) -> torch.Tensor | None:
        """Mean kept weight over the whole replay buffer of every rank (global self-normalization).

        In the decoupled loss the weights depend only on π_old and μ, both fixed for the step, so the
        mean can be taken once over the full data-parallel batch (docs/design.md §3). The bypass losses read
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


# ── per-token dumps ────────────────────────────────────────────────────────────────────────────────

@dataclass(frozen=True)
class TokenDumpPlan:
    """What the controller tells the actors before a dumped step: which step, where, which samples.

    `sample_ids` index the step's samples as upstream's experience maker numbers them (prompt order,
    the `group_size` samples of a prompt adjacent), so every rank picks its rows from one global choice.
    """

    step: int
    run_dir: str
    sample_ids: tuple[int, ...]
    group_size: int = 1


def dp_rank_and_size(strategy) -> tuple[int, int]:
    """(rank, size) of this process in the data-parallel group; (0, 1) without torch.distributed."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    group = _get_dp_group(strategy)
    return dist.get_rank(group=group), dist.get_world_size(group=group)


def dump_part(strategy) -> tuple[bool, int | None]:
    """Whether this rank writes its dump rows, and its part number (None: the only writer, no part suffix).

    Ranks of one ring-attention / tensor-parallel group train the same samples: only the first writes.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return True, None
    mesh = getattr(strategy, "ds_device_mesh", None)
    if mesh is None:
        return True, dist.get_rank()
    first = mesh["sp"].get_local_rank() == 0 and mesh["tp"].get_local_rank() == 0
    return first, mesh["dp"].get_local_rank()


ENTROPY_CHUNK_ELEMENTS = 1 << 24
"""Logits entries per entropy chunk: bounds the temporaries to ~64 MiB each, whatever the vocabulary."""


@torch.no_grad()
def logits_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last axis of (N, V) logits, in float32, chunked along N.

    Eager on purpose: upstream's `compute_entropy` is `torch.compile`d, which costs seconds of
    compilation in each process (measured 4.6 s on CPU) and again for new shapes.
    """
    chunk = max(1, ENTROPY_CHUNK_ELEMENTS // max(int(logits.shape[-1]), 1))
    parts = []
    for piece in logits.split(chunk):
        logp = torch.log_softmax(piece.float(), dim=-1)
        parts.append(-(logp.exp() * logp).sum(-1))
    return torch.cat(parts) if parts else logits.new_zeros(0, dtype=torch.float32)


def response_entropy(output: Any, sequences_shape: Sequence[int], width: int, rows: Sequence[int]) -> torch.Tensor:
    """(B, width) float32 entropy of the training policy at the response tokens of `rows`; NaN elsewhere.

    Read from the forward's own entropy when it computed one (--actor.entropy_coef), otherwise from its
    logits (already float32 and temperature-scaled by upstream's Actor), row by row without gradient, so
    the dump neither grows the autograd graph nor holds a (B, T, V) softmax. Packed or
    sequence-parallel outputs (no (B, T) layout here) give NaN.
    """
    batch, seq_len = int(sequences_shape[0]), int(sequences_shape[1])
    result = torch.full((batch, width), float("nan"))
    entropy = getattr(output, "entropy", None)
    if entropy is not None and tuple(entropy.shape[:2]) == (batch, seq_len - 1):
        result[list(rows)] = entropy.detach()[list(rows), -width:].float().cpu()
        return result
    logits = getattr(output, "logits", None)
    if logits is None or tuple(logits.shape[:2]) != (batch, seq_len):
        return result
    for row in rows:  # position t's logits predict token t+1: the response tokens are t = T-1-width .. T-2
        result[row] = logits_entropy(logits[row, seq_len - 1 - width: seq_len - 1]).cpu()
    return result


@contextmanager
def capture_response_entropy(actor: torch.nn.Module, rows: Sequence[int]) -> Iterator[dict]:
    """Within the block, the first `actor(...)` call also leaves its response entropy in the yielded dict.

    Upstream's `training_step` calls the actor with no seam for extras; an instance-level `forward`
    wraps the class's for the one micro-batch being dumped and is removed afterwards.
    """
    found: dict[str, Any] = {}
    own = actor.__dict__.get("forward")
    forward = actor.forward

    def capturing(sequences, action_mask=None, *args, **kwargs):
        result = forward(sequences, action_mask, *args, **kwargs)
        if "entropy" not in found and isinstance(result, tuple) and action_mask is not None:
            started = time.perf_counter()
            found["entropy"] = response_entropy(result[1], sequences.shape, action_mask.shape[1], rows)
            found["seconds"] = time.perf_counter() - started
        return result

    actor.forward = capturing
    try:
        yield found
    finally:
        if own is None:
            del actor.forward
        else:
            actor.forward = own


def correction_token_details(config: CorrectionConfig, captured: dict) -> dict[str, torch.Tensor]:
    """Per-token weights and masks of one micro-batch's loss, as the dump stores them ((B, A) tensors).

    `captured` holds the loss's own inputs and output (CorrectionPolicyLoss.capture). The final weight
    and the kept mask are the loss's; the raw weight and the reasons come from one eager re-run of
    `compute_correction(details=True)` on the same inputs (only on dumped micro-batches; `policy_loss`
    has no details switch). It runs without self-normalization, which changes neither raw weights nor
    masks, and so needs no all-reduce. Its mask must equal the loss's: a difference raises, except with
    --algo.correction.compile, whose fused kernels may round a token at a bound the other way (warned).

    is_weight is the factor the loss multiplied the token's term by, 0 where masked; 1 under bypass_ppo
    (its IS ratio π_θ/μ sits inside the clip) and when the correction is off (the loss is plain PPO,
    nothing is masked there, so every reason is 'kept').
    """
    lp = captured["log_probs"]
    old = captured["old_log_probs"]
    roll = captured["rollout_log_probs"]
    action = captured["action_mask"].bool()
    out = captured["output"].correction
    roll_used = roll if roll is not None else old  # as policy_loss: without μ only an inactive correction
    base = old if config.loss == "decoupled" else lp
    det = compute_correction(base, roll_used, captured["action_mask"],
                             config.replace(batch_normalize=False, compile=False), log_probs=lp,
                             advantages=captured["advantages"], with_metrics=False, details=True)
    reasons = {name: mask.bool() & action for name, mask in det.reasons.items()}
    raw = torch.where(reasons["nan"], float("nan"), det.raw_weights.float())
    if not config.enabled:
        return {"is_weight_raw": raw, "is_weight": action.float(), "keep": action, "reasons": {}}
    keep = out.mask.bool() & action
    detail_keep = det.mask.bool() & action
    if not torch.equal(keep, detail_keep):
        differ = int((keep != detail_keep).sum())
        message = (f"token dump: the re-computed correction masks {differ} token(s) differently from the loss")
        if not config.compile:
            raise RuntimeError(message + " (a bug: both ran the same eager code on the same inputs)")
        warnings.warn(message + " (compiled loss kernels round at a bound); the dump keeps the re-computed mask",
                      stacklevel=2)
        keep = detail_keep
    weight = keep.float() if config.loss == "bypass_ppo" else torch.where(keep, out.weights.float(), 0.0)
    return {"is_weight_raw": raw, "is_weight": weight, "keep": keep, "reasons": reasons}


def _per_sample(value: Any, batch: int) -> torch.Tensor:
    """A (B,) float tensor from a per-sample field (tensor, or upstream's list of 0-d tensors); NaN if absent."""
    if value is None:
        return torch.full((batch,), float("nan"))
    if isinstance(value, list):
        value = torch.stack([torch.as_tensor(v).reshape(()) for v in value]) if value else torch.empty(0)
    value = torch.as_tensor(value).detach().float().reshape(-1).cpu()
    return value if value.numel() == batch else torch.full((batch,), float("nan"))


class TokenDumpCollector:
    """The rows of one dumped step on one rank, gathered micro-batch by micro-batch inside `ppo_train`.

    A sample is read at its first training step of the step only (epoch 0: π_θ as that forward saw
    it); later epochs train it again but add nothing. Rows leave the device as numpy right away.
    """

    def __init__(self, plan: TokenDumpPlan, config: CorrectionConfig, global_ids: bool = True):
        self.plan = plan
        self.config = config
        self.global_ids = global_ids  # False: ids are rank-strided stand-ins, prompt ids unknown
        self.wanted = frozenset(int(i) for i in plan.sample_ids)
        self.done: set[int] = set()
        self.parts: list[dict[str, np.ndarray]] = []
        self.seconds = 0.0

    def rows_to_collect(self, experience) -> list[int]:
        """Batch rows of this micro-batch holding planned samples not collected yet."""
        ids = experience.index
        if not ids or len(ids) != len(experience.sequences):
            return []
        return [row for row, sample_id in enumerate(ids) if sample_id in self.wanted and sample_id not in self.done]

    def add(self, experience, rows: list[int], captured: dict, entropy: torch.Tensor | None) -> None:
        """Flatten the rows' response tokens into dump columns (see schema.COLUMNS).

        old_logprob is NaN under the bypass losses: π_old is never computed there, and μ, which stands in
        for it, is the rollout_logprob column already. entropy is NaN where the forward's output has no
        (B, T) layout (packed samples without --actor.entropy_coef).
        """
        if "output" not in captured:
            raise RuntimeError("token dump: the policy loss did not run on a dumped micro-batch")
        action_mask = captured["action_mask"]
        batch, width = action_mask.shape
        details = correction_token_details(self.config, captured)
        nan = torch.full((batch, width), float("nan"))
        roll = captured["rollout_log_probs"]
        per_token = {
            "token_id": experience.sequences[:, -width:],
            "rollout_logprob": roll if roll is not None else nan,
            "old_logprob": captured["old_log_probs"] if self.config.loss == "decoupled" else nan,
            "train_logprob": captured["log_probs"],
            "is_weight_raw": details["is_weight_raw"],
            "is_weight": details["is_weight"],
            "masked": ~details["keep"],
            "advantage": captured["advantages"],
            "entropy": entropy if entropy is not None else nan,
            **{f"reason_{name}": mask for name, mask in details["reasons"].items()},
        }
        ids = torch.tensor([int(i) for i in experience.index])
        prompts = ids // max(self.plan.group_size, 1) if self.global_ids else torch.full_like(ids, -1)
        reward = experience.rewards if experience.rewards is not None else experience.info.get("reward")
        per_sample = {"sample_id": ids, "prompt_id": prompts, "reward": _per_sample(reward, batch)}
        columns = flatten_response_tokens(action_mask, per_token, per_sample, rows=rows)
        reasons = {name[len("reason_"):]: columns.pop(name) for name in list(columns) if name.startswith("reason_")}
        columns["mask_reason"] = mask_reason_codes(len(columns["token_id"]), **reasons)
        self.parts.append(columns)
        self.done.update(int(experience.index[row]) for row in rows)

    def columns(self) -> dict[str, np.ndarray] | None:
        """All rows, in (sample, position) order (micro-batches arrive shuffled); None when there are none."""
        if not self.parts:
            return None
        columns = {name: np.concatenate([part[name] for part in self.parts]) for name in self.parts[0]}
        order = np.lexsort((columns["position"], columns["sample_id"]))
        return {name: array[order] for name, array in columns.items()}


# ── the Ray actor ──────────────────────────────────────────────────────────────────────────────────

class _CorrectionPolicyModelActor(_UpstreamPolicyModelActor):
    def init_model_from_pretrained(self, strategy, pretrain, max_steps=None, vllm_engines=None):
        super().init_model_from_pretrained(strategy, pretrain, max_steps=max_steps, vllm_engines=vllm_engines)
        # Upstream constructed a plain ActorPPOTrainer (its vLLM sync group is already up); the fork's
        # subclass only adds methods, so re-classing the instance finishes the job without a second init.
        self.trainer.__class__ = CorrectionActorPPOTrainer
        self.trainer._setup_correction()

    def append(self, experience) -> None:
        self.trainer.append_experience(experience)

    def set_token_dump(self, plan: TokenDumpPlan | None) -> None:
        """The controller's plan for the step about to be trained (None: no dump)."""
        self.trainer.token_dump_plan = plan


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
