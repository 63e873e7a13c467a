"""The fork's PPO controller: upstream's PPOTrainer plus weight-sync checks, reward screening and the run store.

Upstream's class is a Ray actor; Ray forbids subclassing actor classes, so the plain class it wraps
is subclassed and wrapped again. patches/fork_classes.py points upstream's `train()` at it.

Step numbering: upstream's `train_step(samples, global_step)` trains with `ppo_train(global_step)` and
returns `global_step + 1`, the number `save_logs_and_checkpoints` writes as the metrics line's `step`
(1 for the first step, and a resumed run continues from the checkpoint's number). The token dump of a
step therefore carries `global_steps + 1` of `ppo_train`, the same number as its metrics line.

Held-out evaluation (`--eval.dataset`, every `--eval.steps`): upstream evaluates after a step's metrics
were logged and sends the result to wandb/TensorBoard only, and never evaluates the untrained policy.
Here a fresh run is also evaluated before its first step (`eval_start/*` on step 1's line), the line
of an evaluated step is written once its evaluation is in (`eval/*`: upstream's `eval_*` keys), and
the whole held-out set goes to the engines in one dispatch (trainer/eval_samples.py).
"""

from __future__ import annotations

import os
import time

import ray
import torch
from openrlhf.trainer.ppo_trainer import PPOTrainer as _UpstreamActorClass

from openrlhf_tis.ray_classes import ray_actor_class
from openrlhf_tis.rollout.checkpoint import read_last_sync_stats
from openrlhf_tis.runs.layout import ROLLOUT_MODEL_DIR
from openrlhf_tis.runs.store import RunWriter
from openrlhf_tis.runs.tokens import select_samples, should_dump
from openrlhf_tis.trainer.bypass import install_bypass_experience_maker
from openrlhf_tis.trainer.eval_samples import whole_set_eval
from openrlhf_tis.trainer.rewards import RewardPolicy, screen_rewards
from openrlhf_tis.trainer.sync_check import SyncChecker
from openrlhf_tis.trainer.token_dumps import TokenDumpPlan

_UpstreamPPOTrainer = ray_actor_class(_UpstreamActorClass)


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


def token_dump_plan(args, step: int, num_samples: int) -> TokenDumpPlan | None:
    """The dump plan of `step` (a metrics-line step number), or None when the step is not dumped.

    Step 1 and every `--logger.token_dump_steps`-th; `--logger.token_dump_samples` samples chosen by
    (train seed, step), whole prompt groups, so a resumed run picks what the killed one would have.
    The CLI made the run directory absolute, so the actors' files land beside metrics.jsonl.
    """
    logger = args.logger
    run_dir = getattr(logger, "run_dir", None)
    if not run_dir or num_samples <= 0 or not should_dump(step, getattr(logger, "token_dump_steps", 0)):
        return None
    group = max(int(args.rollout.n_samples_per_prompt), 1)
    ids = select_samples(num_samples, logger.token_dump_samples, step, seed=args.train.seed, group_size=group)
    if len(ids) == 0:
        return None
    return TokenDumpPlan(step=step, run_dir=run_dir, sample_ids=tuple(int(i) for i in ids),
                         group_size=group)


def eval_metrics(logs: dict, prefix: str, seconds: float) -> dict[str, float]:
    """Upstream's eval logs (`eval_default_pass1`, ...) as run-store metrics (`<prefix>default_pass1`, ...)."""
    metrics = {prefix + key.removeprefix("eval_"): value for key, value in logs.items()}
    metrics[prefix + "seconds"] = seconds
    return metrics


class _TisPPOTrainer(_UpstreamPPOTrainer):
    def __init__(self, pretrain, strategy, actor_model_group, critic_model_group, reward_model_group,
                 reference_model_group, vllm_engines, **generate_kwargs):
        super().__init__(pretrain, strategy, actor_model_group, critic_model_group, reward_model_group,
                         reference_model_group, vllm_engines, **generate_kwargs)
        self.samples_generator = whole_set_eval(self.samples_generator)
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
        self._step_samples = 0  # samples of the step being trained (train_step), for the dump plan
        self._eval_start: dict[str, float] = {}  # the untrained policy's eval, logged on the first line
        self._held_line: tuple[int, dict] | None = None  # (step, metrics) waiting for that step's eval
        self._reward_policy = RewardPolicy.from_args(self.args)
        # Bypass mode: the experience maker must not even dispatch the pi_old forward (trainer/bypass.py).
        install_bypass_experience_maker(self)

    def init_checkpoint_states(self) -> dict:
        states = super().init_checkpoint_states()
        if self._run is not None:
            # The history must be the one actually trained: steps after the checkpoint are redone.
            dropped = self._run.rewind(states["global_step"])
            if dropped:
                print(f"[openrlhf_tis] run store: dropped {dropped} record(s) after step {states['global_step']}, "
                      "which this run trains again")
        # fit() calls this before its first rollout: the one point where a fresh run's policy is untrained,
        # and where engines and trainer hold the same weights (the sync check's baseline).
        if states["global_step"] == 0 and self._sync_checker is not None:
            self._sync_metrics.update(self._sync_checker.start())
        if states["global_step"] == 0 and self.eval_dataloader is not None and self.args.eval.steps != float("inf"):
            t0 = time.perf_counter()
            logs = self.evaluate(0, **self._eval_generate_kwargs())
            self._eval_start = eval_metrics(logs, "eval_start/", time.perf_counter() - t0)
        return states

    def _eval_generate_kwargs(self) -> dict:
        """What upstream's fit() passes to evaluate()."""
        return {**self.generate_kwargs, "temperature": self.args.eval.temperature,
                "n_samples_per_prompt": self.args.eval.n_samples_per_prompt}

    def evaluate(self, global_step, **generate_kwargs):
        t0 = time.perf_counter()
        logs = super().evaluate(global_step, **generate_kwargs)
        if self._held_line is not None and self._held_line[0] == global_step:
            step, line = self._held_line
            self._held_line = None
            self._run.append_metrics(step, {**line, **eval_metrics(logs, "eval/", time.perf_counter() - t0)})
        return logs

    def broadcast_to_vllm(self) -> None:
        # Upstream's `timing/broadcast` covers this whole method; `sync/weights_s` is the weight sync
        # alone and `sync/check_s` the probe scoring (not `timing/*`: step_total sums those).
        self._syncs += 1
        due = self._sync_checker is not None and self._syncs % self._sync_every == 0
        t0 = time.perf_counter()
        probe = self._sync_checker.before_sync() if due else None
        t1 = time.perf_counter()
        super().broadcast_to_vllm()
        t2 = time.perf_counter()
        if due:
            self._sync_metrics.update(self._sync_checker.after_sync(probe))
            self._sync_metrics["sync/check_s"] = t1 - t0 + time.perf_counter() - t2
        self._sync_metrics["sync/weights_s"] = t2 - t1
        self._sync_metrics.update(self._quantized_sync_metrics())

    def _quantized_sync_metrics(self) -> dict[str, float]:
        """INT8 engines log each re-quantization beside their checkpoint (single node: same filesystem)."""
        if getattr(self.args.vllm, "rollout_precision", "bf16") != "int8" or not self.args.logger.run_dir:
            return {}
        record = read_last_sync_stats(os.path.join(self.args.logger.run_dir, ROLLOUT_MODEL_DIR))
        if record is None:
            return {}
        return {f"rollout/int8_{key}": float(record[key])
                for key in ("saturated_fraction", "max_rel_error", "quantize_s") if key in record}

    def _compute_rollout_stats(self, experiences) -> dict:
        stats = super()._compute_rollout_stats(experiences)
        stats["rollout/logprob_coverage"] = rollout_logprob_coverage(experiences)
        return stats

    def train_step(self, rollout_samples, global_step: int):
        # NaN/inf rewards fail the step or drop their groups before upstream computes advantages from them.
        rollout_samples, reward_metrics = screen_rewards(rollout_samples, self._reward_policy, global_step + 1)
        self._step_samples = len(rollout_samples)  # upstream numbers them 0..n-1 (Experience.index)
        status, global_step = super().train_step(rollout_samples, global_step)
        status.update(reward_metrics)
        status.update(self._sync_metrics)
        self._sync_metrics = {}
        return status, global_step

    def ppo_train(self, global_steps: int) -> dict:
        # Called before upstream increments the step: the step being trained is logged as global_steps + 1.
        self._announce_token_dump(global_steps + 1, trains_actor=global_steps > self.args.critic.freezing_steps)
        return super().ppo_train(global_steps)

    def _announce_token_dump(self, step: int, trains_actor: bool) -> None:
        """Tell every actor the dump plan before its `fit`; nothing is sent on steps without a dump.

        A step whose actor is frozen (critic warm-up) is not announced: a plan left unconsumed would be
        applied to the next step's fit under the wrong step number.
        """
        if self.actor_model_group is None or not trains_actor:
            return
        plan = token_dump_plan(self.args, step, getattr(self, "_step_samples", 0))
        if plan is not None:
            ray.get(self.actor_model_group.async_run_method(method_name="set_token_dump", plan=plan))

    def save_logs_and_checkpoints(self, global_step: int, logs_dict=None, client_states=None) -> None:
        if self._run is not None and logs_dict:
            line = {**self._eval_start, **logs_dict}
            self._eval_start = {}
            # Upstream's fit() evaluates right after this call under exactly this condition.
            if global_step % self.args.eval.steps == 0 and self.eval_dataloader:
                self._held_line = (global_step, line)
            else:
                self._run.append_metrics(global_step, line)
        super().save_logs_and_checkpoints(global_step, logs_dict, client_states)


TisPPOTrainer = ray.remote(_TisPPOTrainer)
