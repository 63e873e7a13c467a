"""The PPO actor with the fork's rollout correction as its policy loss.

Trace from flag to metric: `--algo.correction.*` (cli/fork_flags.py) is resolved once in the driver
(cli/resolve.py) into the run spec's CorrectionConfig, which Ray hands the actor with its arguments (`fork.spec`);
`CorrectionActorPPOTrainer` reads it (run_spec/plans.py `run_spec`), `CorrectionPolicyLoss` (trainer/policy_loss.py)
runs `correction.policy_loss` in place of upstream's `PolicyLoss` (PPO's token ratio, or GSPO's sequence ratio),
and the `mismatch/*` / `correction/*` metrics ride in `experience.info`, which upstream's `training_step`
already merges into the status dict that reaches its loggers and the run store.

Upstream seams used:
- `PolicyModelActor` is a Ray actor class; Ray forbids subclassing it, so the plain class it wraps is
  subclassed and wrapped again (`ray.remote(num_gpus=1)`, as upstream does). patches/fork_classes.py
  points `openrlhf.trainer.ray.ppo_actor.PolicyModelActor` at it before `train()` runs.
- `init_model_from_pretrained` builds its `ActorPPOTrainer` by name with no factory seam, so the
  instance is re-classed to the fork's subclass right after construction and finishes its set-up there.
- Bypass mode skips the π_old forward on the controller (trainer/bypass.py); each training step here
  sets π_old := μ again. The actor's own `forward` stays exact: the weight-sync check scores with it.

Routing replay (`--vllm.routing_replay r3` / `r2`, trainer/moe_replay.py): the actor's MoE routers are re-classed once
the model is built; each training step (forward and backward) replays the samples' routed experts, and `ppo_train` adds
the step's `moe/*` metrics (with `measure` nothing is replayed: the routers' own choice is compared with the
engines'). The π_old `forward` replays them too (r3: the engines'), or records its own routing and returns it with
the log-probs (r2), which then ride with the samples to the training steps.

Per-token dumps (trainer/token_dumps.py): `set_token_dump` takes the controller's plan for a step,
`append` keeps each replay-buffer item's sample id, and `ppo_train` collects and writes the planned rows, read off
the loss's own output (computed with details on the dumped micro-batches only); in a replay run each row also carries
the MoE layers whose routing differed between the engine and the routers' own choice in that forward.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import ray
import torch
import torch.distributed as dist
from openrlhf.trainer.ray.ppo_actor import ActorPPOTrainer
from openrlhf.trainer.ray.ppo_actor import PolicyModelActor as _UpstreamActorClass
from openrlhf.utils.loss_utils import _get_dp_group

from openrlhf_tis.correction import compute_correction, kept_weight_totals
from openrlhf_tis.metric_names import TOKEN_DUMP_SECONDS, TOKEN_DUMP_TOKENS
from openrlhf_tis.moe.routing_batch import ROUTED_EXPERTS
from openrlhf_tis.ray_classes import ray_actor_class
from openrlhf_tis.run_spec import run_spec
from openrlhf_tis.runs.identity import write_checkpoint_identity
from openrlhf_tis.runs.tokens import TokenDumpWriter
from openrlhf_tis.trainer.bypass import rollout_as_old
from openrlhf_tis.trainer.moe_replay import ActorRouting, ReplayedBatch, replay_training_step, unwrapped_model
from openrlhf_tis.trainer.policy_loss import CorrectionPolicyLoss
from openrlhf_tis.trainer.token_dumps import (
    TokenDumpCollector,
    TokenDumpPlan,
    capture_response_entropy,
    dp_rank_and_size,
    dump_part,
)
from openrlhf_tis.upstream_guards import PatchTargetMissingError, reclass

_UpstreamPolicyModelActor = ray_actor_class(_UpstreamActorClass)
_THIS_FILE = "openrlhf_tis/trainer/ppo_actor.py"  # named by the guards' errors: the file to review


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


# ── the actor-side trainer ─────────────────────────────────────────────────────────────────────────

class CorrectionActorPPOTrainer(ActorPPOTrainer):
    """Upstream's ActorPPOTrainer with the fork's correction as its policy loss."""

    moe_routing: ActorRouting | None = None
    """The routing replay's state when the run replays (else None; a trainer built without __init__ has none)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._setup_correction()
        self._setup_routing_replay()

    def _setup_routing_replay(self) -> None:
        """Re-class the actor's MoE routers for replay when the run asks for it (trainer/moe_replay.py)."""
        self.moe_routing = None
        mode = run_spec(self.args).rollout.routing_replay
        if mode != "off":
            self.moe_routing = ActorRouting(unwrapped_model(self.actor), packed=bool(self.args.ds.packing_samples),
                                            k3_by_cause=mode != "r2", replays=mode != "measure")

    def _setup_correction(self) -> None:
        """Replace the policy loss, PPO's or GSPO's: the mismatch is measured and dumped whatever the loss.

        Upstream's `training_step` calls `self.actor_loss_fn`, which its `__init__` set: an upstream that no longer
        does either is refused, since the fork's loss would silently not be the one trained with."""
        if "actor_loss_fn" not in vars(self) or "actor_loss_fn" not in ActorPPOTrainer.training_step.__code__.co_names:
            raise PatchTargetMissingError(
                f"patch {_THIS_FILE!r}: openrlhf.trainer.ray.ppo_actor.ActorPPOTrainer no longer trains with "
                "self.actor_loss_fn; review the patch")
        self.correction = run_spec(self.args).correction
        self.token_dump_plan: TokenDumpPlan | None = None  # set by the controller before a dumped step's fit
        self._token_dump: TokenDumpCollector | None = None  # live only inside ppo_train of a dumped step
        self._token_writer: TokenDumpWriter | None = None
        self._local_sample_ids = False  # True when the step's samples came without upstream's index
        self.actor_loss_fn = CorrectionPolicyLoss(
            self.correction,
            clip_eps_low=self.args.actor.eps_clip_low_high[0],
            clip_eps_high=self.args.actor.eps_clip_low_high[1],
            dual_clip=self.args.actor.dual_clip,
            token_level_loss=self.args.actor.loss_agg_mode == "token-mean",
            sequence_ratio=self.args.actor.policy_loss_type == "gspo",
            allreduce=dp_allreduce(self.strategy),
        )

    def ppo_train(self, kl_ctl: float):
        self._token_dump = self._start_token_dump()
        try:
            with self.actor_loss_fn.normalized_by(self._replay_buffer_normalizer()):
                status = super().ppo_train(kl_ctl)
            if self._token_dump is not None:
                status.update(self._write_token_dump(self._token_dump))
            if self.moe_routing is not None:
                status.update(self.moe_routing.step_metrics(self.actor_loss_fn.allreduce, self._device()))
            return status
        finally:
            self._token_dump = None
            self._local_sample_ids = False  # the buffer is cleared after fit; the next step tags afresh

    def training_step(self, experience, kl_ctl: float, step: int, loss_batch_info=None):
        if self.moe_routing is not None and ROUTED_EXPERTS in experience.info:
            return replay_training_step(
                self.moe_routing, experience,
                lambda routing: self._corrected_step(experience, kl_ctl, step, loss_batch_info, routing))
        return self._corrected_step(experience, kl_ctl, step, loss_batch_info)

    def _device(self):
        return torch.cuda.current_device() if run_spec(self.args).cluster.device == "cuda" else "cpu"

    def _corrected_step(self, experience, kl_ctl: float, step: int, loss_batch_info,
                        routing: ReplayedBatch | None = None):
        if self.correction.bypass and experience.rollout_log_probs is not None:
            # π_old := μ, also for the KL loss (the experience maker already set it; this keeps it exact).
            experience.action_log_probs = rollout_as_old(experience.rollout_log_probs, experience.action_mask)
        dump = self._token_dump
        rows = dump.rows_to_collect(experience) if dump is not None else []
        with self.actor_loss_fn.micro_batch(experience.info, details=bool(rows)) as call:
            if not rows:
                return super().training_step(experience, kl_ctl, step, loss_batch_info)
            with capture_response_entropy(self.actor, rows) as found:
                status = super().training_step(experience, kl_ctl, step, loss_batch_info)
        started = time.perf_counter()
        mismatch = routing.mismatch_by_position() if routing is not None else None
        dump.add(experience, rows, call, found.get("entropy"), mismatch)
        dump.seconds += time.perf_counter() - started + found.get("seconds", 0.0)
        return status

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
        return {TOKEN_DUMP_SECONDS: dump.seconds, TOKEN_DUMP_TOKENS: float(rows)}

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
            totals = allreduce(totals.to(self._device())).cpu()
        total, count = totals.tolist()
        return torch.tensor(total / count) if count > 0 and total > 0 else None


# ── the Ray actor ──────────────────────────────────────────────────────────────────────────────────

class _CorrectionPolicyModelActor(_UpstreamPolicyModelActor):
    def init_model_from_pretrained(self, strategy, pretrain, max_steps=None, vllm_engines=None):
        super().init_model_from_pretrained(strategy, pretrain, max_steps=max_steps, vllm_engines=vllm_engines)
        # Upstream constructed a plain ActorPPOTrainer (its vLLM sync group is already up); the fork's
        # subclass only adds methods, so re-classing the instance finishes the job without a second init.
        reclass(self.trainer, CorrectionActorPPOTrainer, supported="==0.11.2", patch=_THIS_FILE,
                overrides=("ppo_train", "training_step"))
        self.trainer._setup_correction()
        self.trainer._setup_routing_replay()

    def forward(self, sequences, action_mask=None, attention_mask=None, packed_seq_lens=None,
                mm_train_inputs_list=None, routed_experts=None, record_routing=False):
        """Upstream's π_old forward; inside the samples' replayed routing when the experience maker sends it (r3), or
        recording the routers' own choice when it asks (`record_routing`, r2: returns (log-probs, one routing per
        sample)); trainer/moe_replay.py. Otherwise (the weight-sync check's scoring) it routes on its own."""
        def forward():
            return super(_CorrectionPolicyModelActor, self).forward(
                sequences, action_mask, attention_mask, packed_seq_lens=packed_seq_lens,
                mm_train_inputs_list=mm_train_inputs_list)

        if record_routing:
            return self.trainer.moe_routing.record_own(forward, attention_mask)
        if routed_experts is None:
            return forward()
        with self.trainer.moe_routing.replaying(routed_experts, attention_mask):
            return forward()

    def append(self, experience) -> None:
        self.trainer.append_experience(experience)

    def set_token_dump(self, plan: TokenDumpPlan | None) -> None:
        """The controller's plan for the step about to be trained (None: no dump)."""
        self.trainer.token_dump_plan = plan

    def save_checkpoint(self, tag, client_states=None, metric_value=None, metric_key=None):
        # Stamp the checkpoint with the run it belongs to, so no later history resumes from it (runs/identity.py).
        # Before DeepSpeed writes it: DeepSpeed points `latest` at a tag only once the tag is whole, so a kill at any
        # moment leaves either the previous checkpoint current or this one current and stamped, never unstamped.
        args = self.strategy.args
        run_id = getattr(args.logger, "run_id", None)
        if run_id and not self.disable_ds_ckpt and self.strategy.is_rank_0():
            step = (client_states or {}).get("global_step", 0)
            tag_dir = Path(args.ckpt.path) / "_actor" / tag
            tag_dir.mkdir(parents=True, exist_ok=True)
            write_checkpoint_identity(tag_dir, run_id, step)
        super().save_checkpoint(tag, client_states, metric_value=metric_value, metric_key=metric_key)


PolicyModelActor = ray.remote(num_gpus=1)(_CorrectionPolicyModelActor)
