"""The fork's PPO controller: weight-sync checks, reward screening, staleness, the run store, held-out scoring.

One mixin, `ForkController`, carries all of it and serves both of upstream's controllers: the synchronous
`PPOTrainer` and async training's `TrainingActor` (`--train.async_enable`, ppo_trainer_async.py), whose
`fit` loops differ but which share `BasePPOTrainer`'s seams (`train_step`, `ppo_train`, `broadcast_to_vllm`,
`save_logs_and_checkpoints`, `init_checkpoint_states`). Upstream's classes are Ray actors; Ray forbids
subclassing actor classes, so the plain classes they wrap are subclassed and wrapped again.
patches/fork_classes.py points upstream's `train()` at them.

Class layout (method resolution order, outermost first):
    TisPPOTrainer     = ForkController, upstream PPOTrainer,                 EngineVersions, BasePPOTrainer
    TisTrainingActor  = ForkController, TrainerSideEval, upstream TrainingActor, EngineVersions, BasePPOTrainer
`EngineVersions` sits *below* upstream's classes so that its `broadcast_to_vllm` runs inside async
training's critical section (the vLLM lock, or paused generation with partial rollouts): each engine
learns the new policy version before it may generate again (trainer/staleness.py).

Step numbering: upstream's `train_step(samples, global_step)` trains with `ppo_train(global_step)` and
returns `global_step + 1`, the number `save_logs_and_checkpoints` writes as the metrics line's `step`
(1 for the first step, and a resumed run continues from the checkpoint's number). The token dump of a
step therefore carries `global_steps + 1` of `ppo_train`, the same number as its metrics line.

Held-out evaluation (`--eval.dataset`, every `--eval.steps`): upstream evaluates after a step's metrics
were logged and sends the result to wandb/TensorBoard only, and never evaluates the untrained policy.
Here a fresh run is also evaluated before its first step (`eval_start/*` on step 1's line), the line
of an evaluated step is written once its evaluation is in (`eval/*`: upstream's `eval_*` keys), and
the whole held-out set goes to the engines in one dispatch (trainer/eval_samples.py). Async training's
upstream evaluates in the sample generator when a later batch is requested, on whatever weights the
engines hold then, and never after the last step; here the trainer evaluates instead, right after the
sync of an evaluated step (`TrainerSideEval`), so both modes score the same policy at the same steps.
"""

from __future__ import annotations

import os
import time

import ray
import torch
from openrlhf.trainer.ppo_trainer import BasePPOTrainer, compute_eval_metrics, prepare_datasets
from openrlhf.trainer.ppo_trainer import PPOTrainer as _UpstreamSyncClass
from openrlhf.trainer.ppo_trainer_async import GenerateSamplesActor as _UpstreamGeneratorClass
from openrlhf.trainer.ppo_trainer_async import PPOTrainerAsync as _UpstreamAsyncClass
from openrlhf.trainer.ppo_trainer_async import TrainingActor as _UpstreamTrainingClass
from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator

from openrlhf_tis.metric_names import (
    EVAL_PREFIX,
    EVAL_START_PREFIX,
    INT8_SYNC_PREFIX,
    LOGPROB_COVERAGE,
    QUEUE_WAIT,
    SYNC_CHECK_SECONDS,
    SYNC_WEIGHTS_SECONDS,
)
from openrlhf_tis.ray_classes import ray_actor_class
from openrlhf_tis.rollout.checkpoint import read_last_sync_stats
from openrlhf_tis.runs.layout import ROLLOUT_MODEL_DIR
from openrlhf_tis.runs.store import RunWriter
from openrlhf_tis.runs.tokens import select_samples, should_dump
from openrlhf_tis.trainer.bypass import install_bypass_experience_maker
from openrlhf_tis.trainer.eval_samples import whole_set_eval
from openrlhf_tis.trainer.rewards import RewardPolicy, screen_rewards
from openrlhf_tis.trainer.staleness import LAG, drop_stale, sample_lags, spans_sync, staleness_metrics, stamp_lags
from openrlhf_tis.trainer.sync_check import make_sync_checker
from openrlhf_tis.trainer.token_dumps import TokenDumpPlan

_UpstreamPPOTrainer = ray_actor_class(_UpstreamSyncClass)
_UpstreamTrainingActor = ray_actor_class(_UpstreamTrainingClass)
_UpstreamGenerateSamplesActor = ray_actor_class(_UpstreamGeneratorClass)
_UpstreamPPOTrainerAsync = ray_actor_class(_UpstreamAsyncClass)


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


class EngineVersions(BasePPOTrainer):
    """Tells every engine the policy version it holds once a sync is in (see the module doc for its place)."""

    _actor_version = 0  # optimizer steps in the actor's weights; ForkController keeps it current

    def broadcast_to_vllm(self) -> None:
        super().broadcast_to_vllm()
        if self.vllm_engines:
            ray.get([engine.set_policy_version.remote(self._actor_version) for engine in self.vllm_engines])


class ForkController:
    """The fork's controller logic over either upstream controller (see the module doc)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.samples_generator = whole_set_eval(self.samples_generator) if self.samples_generator else None
        # Sleeping engines (--vllm.enable_sleep) are checked too: the checker wakes them to score.
        self._sync_checker = make_sync_checker(self.args, self.tokenizer, self.vllm_engines, self.actor_model_group)
        self._sync_every = self.args.vllm.sync_check_steps if self._sync_checker is not None else 0
        self._syncs = 0
        self._sync_metrics: dict[str, float] = {}
        self._run = RunWriter(self.args.logger.run_dir) if self.args.logger.run_dir else None
        self._step_samples = 0  # samples of the step being trained (train_step), for the dump plan
        self._eval_start: dict[str, float] = {}  # the untrained policy's eval, logged on the first line
        self._held_line: tuple[int, dict] | None = None  # (step, metrics) waiting for that step's eval
        self._reward_policy = RewardPolicy.from_args(self.args)
        self._max_lag = getattr(self.args.train, "async_max_lag", None)
        self._step_end = None  # when the previous step's line was handed over: the wait before the next
        # Bypass mode: the experience maker must not even dispatch the pi_old forward (trainer/bypass.py).
        install_bypass_experience_maker(self)

    def init_checkpoint_states(self) -> dict:
        states = super().init_checkpoint_states()
        self._actor_version = int(states["global_step"])
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
        if states["global_step"] == 0 and self._eval_due(None):
            t0 = time.perf_counter()
            logs = self.evaluate(0, **self._eval_generate_kwargs())
            self._eval_start = eval_metrics(logs, EVAL_START_PREFIX, time.perf_counter() - t0)
        return states

    def _eval_due(self, step: int | None) -> bool:
        """Held-out evaluation configured (step None), or due after `step` (upstream's own condition)."""
        configured = self.eval_dataloader is not None and self.args.eval.steps != float("inf")
        return configured and (step is None or step % self.args.eval.steps == 0)

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
            self._run.append_metrics(step, {**line, **eval_metrics(logs, EVAL_PREFIX, time.perf_counter() - t0)})
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
            self._sync_metrics[SYNC_CHECK_SECONDS] = t1 - t0 + time.perf_counter() - t2
        self._sync_metrics[SYNC_WEIGHTS_SECONDS] = t2 - t1
        self._sync_metrics.update(self._quantized_sync_metrics())

    def _quantized_sync_metrics(self) -> dict[str, float]:
        """INT8 engines log each re-quantization beside their checkpoint (single node: same filesystem)."""
        if getattr(self.args.vllm, "rollout_precision", "bf16") != "int8" or not self.args.logger.run_dir:
            return {}
        record = read_last_sync_stats(os.path.join(self.args.logger.run_dir, ROLLOUT_MODEL_DIR))
        if record is None:
            return {}
        return {INT8_SYNC_PREFIX + key: float(record[key])
                for key in ("saturated_fraction", "max_rel_error", "quantize_s") if key in record}

    def _compute_rollout_stats(self, experiences) -> dict:
        stats = super()._compute_rollout_stats(experiences)
        stats[LOGPROB_COVERAGE] = rollout_logprob_coverage(experiences)
        return stats

    def train_step(self, rollout_samples, global_step: int):
        waited = time.perf_counter() - self._step_end if self._step_end is not None else None
        # NaN/inf rewards fail the step or drop their groups before upstream computes advantages from them.
        rollout_samples, reward_metrics = screen_rewards(rollout_samples, self._reward_policy, global_step + 1)
        # π_old of this step is the actor after `global_step` steps; a sample's lag is how many steps older
        # its rollout policy was. Samples beyond --train.async_max_lag leave with their prompt groups.
        lags = sample_lags(rollout_samples, global_step)
        rollout_samples, lags, stale_metrics = drop_stale(rollout_samples, lags, self._max_lag,
                                                          self._reward_policy, global_step + 1)
        spanning = spans_sync(rollout_samples) if getattr(self.args.train, "partial_rollout_enable", False) else ()
        stamp_lags(rollout_samples, lags)
        self._step_samples = len(rollout_samples)  # upstream numbers them 0..n-1 (Experience.index)
        status, global_step = super().train_step(rollout_samples, global_step)
        status.pop(LAG, None)  # the actor logs every info key; staleness/* below says it whole
        status.update(reward_metrics)
        status.update(staleness_metrics(lags, spanning))
        status.update(stale_metrics)
        if waited is not None and isinstance(self, TrainerSideEval):
            status[QUEUE_WAIT] = waited  # async: blocked on the rollout queue (sync fit sums timing/*)
        status.update(self._sync_metrics)
        self._sync_metrics = {}
        return status, global_step

    def ppo_train(self, global_steps: int) -> dict:
        # Called before upstream increments the step: the step being trained is logged as global_steps + 1.
        self._announce_token_dump(global_steps + 1, trains_actor=global_steps > self.args.critic.freezing_steps)
        status = super().ppo_train(global_steps)
        self._actor_version = global_steps + 1  # the weights the coming sync sends
        return status

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
        eval_due = self._eval_due(global_step)
        if self._run is not None and logs_dict:
            line = {**self._eval_start, **logs_dict}
            self._eval_start = {}
            # Upstream's sync fit() evaluates right after this call under exactly this condition.
            if eval_due:
                self._held_line = (global_step, line)
            else:
                self._run.append_metrics(global_step, line)
        super().save_logs_and_checkpoints(global_step, logs_dict, client_states)
        if eval_due and isinstance(self, TrainerSideEval):  # upstream's async loop never evaluates here
            logs = self.evaluate(global_step, **self._eval_generate_kwargs())
            self.save_best_checkpoint(logs, global_step, dict(client_states or {}))
        self._step_end = time.perf_counter()


class TrainerSideEval:
    """Held-out evaluation in async training's trainer, as the sync controller has it (see the module doc).

    Async training's trainer has no sample generator or generate kwargs of its own (the generator actor
    holds them): it builds an evaluation-only generator over the same engines, and the fork's
    `PPOTrainerAsync` hands it the generate kwargs. Evaluating needs no lock: only this actor syncs
    weights, so they cannot change under the evaluation; a concurrent rollout batch just shares the engines.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.generate_kwargs: dict = {}
        _, self.eval_dataloader, _ = prepare_datasets(self.strategy, self.tokenizer)
        self.samples_generator = None  # ForkController makes it a whole-set evaluator
        if self.eval_dataloader is not None:
            self.samples_generator = SamplesGenerator(
                strategy=self.strategy, prompts_dataloader=None, eval_dataloader=self.eval_dataloader,
                tokenizer=self.tokenizer, vllm_engines=self.vllm_engines)

    def set_generate_kwargs(self, generate_kwargs: dict) -> None:
        self.generate_kwargs = dict(generate_kwargs)

    @torch.no_grad()
    def evaluate(self, global_step, **generate_kwargs):
        samples = self.samples_generator.generate_eval_samples(**generate_kwargs)
        logs = compute_eval_metrics(self.eval_dataloader, samples, generate_kwargs["n_samples_per_prompt"])
        if self.wandb_logger:
            self.wandb_logger.log_eval(global_step, logs)
        if self.tensorboard_logger:
            self.tensorboard_logger.log_eval(global_step, logs)
        return logs


class _TisPPOTrainer(ForkController, _UpstreamPPOTrainer, EngineVersions):
    pass


class _TisTrainingActor(ForkController, TrainerSideEval, _UpstreamTrainingActor, EngineVersions):
    pass


class _TisGenerateSamplesActor(_UpstreamGenerateSamplesActor):
    """Upstream's async sample generator without its own evaluation: the trainer evaluates (TrainerSideEval)."""

    def _should_eval(self, global_step):
        return False


class _TisPPOTrainerAsync(_UpstreamPPOTrainerAsync):
    """Upstream's async driver, building the fork's trainer and generator; the trainer gets the generate kwargs."""

    def __init__(self, *args, **generate_kwargs):
        from openrlhf_tis.patches import async_actors  # in this actor's own process: see the patch's doc

        async_actors.apply(TisTrainingActor, TisGenerateSamplesActor)
        super().__init__(*args, **generate_kwargs)
        ray.get(self.trainer_actor.set_generate_kwargs.remote(generate_kwargs))


TisPPOTrainer = ray.remote(_TisPPOTrainer)
TisTrainingActor = ray.remote(_TisTrainingActor)
TisGenerateSamplesActor = ray.remote(_TisGenerateSamplesActor)
TisPPOTrainerAsync = ray.remote(_TisPPOTrainerAsync)
