"""The fork's PPO controller: one list of parts (trainer/step_part.py) over either of upstream's controllers.

`ForkController` serves upstream's synchronous `PPOTrainer` and async training's `TrainingActor`
(`--train.async_enable`, ppo_trainer_async.py), whose `fit` loops differ but which share `BasePPOTrainer`'s
seams (`train_step`, `ppo_train`, `broadcast_to_vllm`, `evaluate`, `save_logs_and_checkpoints`,
`init_checkpoint_states`). It overrides each seam once: the override calls that seam's hook on every part,
in order. Its jobs (sync check, reward screening, staleness, the run store, token-dump plans, held-out scoring,
...) are those parts, chosen from the run's flags at construction. Upstream's classes are Ray actors; Ray forbids
subclassing actor classes, so the plain classes they wrap are subclassed and wrapped again.
patches/fork_classes.py points upstream's `train()` at them.

Class layout (method resolution order, outermost first):
    TisPPOTrainer     = ForkController, upstream PPOTrainer,                   InsideSyncHooks, BasePPOTrainer
    TisTrainingActor  = ForkController, TrainerSideEval, upstream TrainingActor, InsideSyncHooks, BasePPOTrainer
`InsideSyncHooks` sits *below* upstream's classes so that the parts' `synced` hook runs inside async
training's critical section (the vLLM lock, or paused generation with partial rollouts): each engine learns
the new policy version before it may generate again (PolicyVersionPart, trainer/staleness.py). It is reached
only because upstream's `TrainingActor.broadcast_to_vllm` calls `super()`: `check_sync_hooks_reached` (run by
patches/fork_classes.py before `train()`) refuses an upstream whose override stops doing so.

Step numbering: upstream's `train_step(samples, global_step)` trains with `ppo_train(global_step)` and
returns `global_step + 1`, the number `save_logs_and_checkpoints` writes as the metrics line's `step`
(1 for the first step, and a resumed run continues from the checkpoint's number). The parts' hooks all take
that number: the step being trained is `global_step + 1`.

Held-out evaluation (`--eval.dataset`, every `--eval.steps`): upstream evaluates after a step's metrics
were logged and sends the result to wandb/TensorBoard only, and never evaluates the untrained policy.
Here a fresh run is also evaluated before its first step (StartEvalPart; `eval_start/*` on step 1's line), the
line of an evaluated step is written once its evaluation is in (MetricsLinePart; `eval/*`: upstream's `eval_*`
keys), and the whole held-out set goes to the engines in one dispatch (trainer/eval_samples.py). Async
training's upstream evaluates in the sample generator when a later batch is requested, on whatever weights
the engines hold then, and never after the last step; here the trainer evaluates instead, right after the
sync of an evaluated step (`TrainerSideEval`), so both modes score the same policy at the same steps.
"""

from __future__ import annotations

import time
from pathlib import Path

import openrlhf.trainer.ppo_trainer_async as upstream_async
import ray
import torch
from openrlhf.trainer.ppo_trainer import BasePPOTrainer, compute_eval_metrics, prepare_datasets
from openrlhf.trainer.ppo_trainer import PPOTrainer as _UpstreamSyncClass
from openrlhf.trainer.ppo_trainer_async import GenerateSamplesActor as _UpstreamGeneratorClass
from openrlhf.trainer.ppo_trainer_async import PPOTrainerAsync as _UpstreamAsyncClass
from openrlhf.trainer.ppo_trainer_async import TrainingActor as _UpstreamTrainingClass
from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator

from openrlhf_tis.moe.coverage import ENGINE_ROUTING_MODES
from openrlhf_tis.ray_classes import ray_actor_class
from openrlhf_tis.rollout.precision import CUDA_QUANTIZED
from openrlhf_tis.rollout.sampling_seeds import seed_data_order
from openrlhf_tis.run_spec import run_spec
from openrlhf_tis.runs.store import RunWriter
from openrlhf_tis.trainer.bypass import install_bypass_experience_maker
from openrlhf_tis.trainer.eval_samples import whole_set_eval
from openrlhf_tis.trainer.moe_experience import install_routing_experience_maker
from openrlhf_tis.trainer.rewards import RewardPolicy
from openrlhf_tis.trainer.stage_board import (
    EVALUATE,
    GENERATE,
    LOAD,
    MAKE_EXPERIENCE,
    SAVE,
    SYNC,
    TRAIN,
    StageBoard,
    actor_ids,
    gcs_publisher,
    group_ids,
)
from openrlhf_tis.trainer.step_part import (
    CoveragePart,
    EvalSchedule,
    HealthPart,
    MetricsLinePart,
    MismatchByLagPart,
    PolicyVersionPart,
    QueueWaitPart,
    RewardLimitPart,
    RewardScreenPart,
    RolloutOrderPart,
    RoutingCapturePart,
    StalenessPart,
    StartEvalPart,
    StepPart,
    SyncCheckPart,
    SyncCostPart,
    TokenDumpPart,
)
from openrlhf_tis.trainer.sync_cadence import SyncCadencePart
from openrlhf_tis.trainer.sync_check import make_sync_checker
from openrlhf_tis.trainer.untrained_scores import UntrainedCache, may_reuse, untrained_key
from openrlhf_tis.upstream_guards import replace, require_super_chain, require_version

_THIS_FILE = "openrlhf_tis/trainer/ppo_trainer.py"  # the file a guard's message names for review

_UpstreamPPOTrainer = ray_actor_class(_UpstreamSyncClass)
_UpstreamTrainingActor = ray_actor_class(_UpstreamTrainingClass)
_UpstreamGenerateSamplesActor = ray_actor_class(_UpstreamGeneratorClass)
_UpstreamPPOTrainerAsync = ray_actor_class(_UpstreamAsyncClass)


def eval_generate_kwargs(args, generate_kwargs: dict) -> dict:
    """What upstream's sync fit() passes to evaluate()."""
    return {**generate_kwargs, "temperature": args.eval.temperature,
            "n_samples_per_prompt": args.eval.n_samples_per_prompt}


class InsideSyncHooks(BasePPOTrainer):
    """Runs the parts' `synced` hook inside upstream's critical section of a sync (see the module doc)."""

    parts: list[StepPart]  # ForkController's

    def broadcast_to_vllm(self) -> None:
        super().broadcast_to_vllm()
        for part in self.parts:
            part.synced()


class ForkController:
    """The fork's controller logic over either upstream controller (see the module doc)."""

    waits_on_rollout_queue = False  # async training's trainer: its steps wait on the rollout queue

    def __init__(self, *args, **kwargs):
        seed_data_order(*args, **kwargs)  # before upstream builds its prompt loader (rollout/sampling_seeds.py)
        super().__init__(*args, **kwargs)
        # What the driver's stall bound reads (trainer/stage_board.py): the stage, the actors it waits on, progress.
        self.board = StageBoard(gcs_publisher())
        self.samples_generator = (whole_set_eval(self.samples_generator, self.board.progress)
                                  if self.samples_generator else None)
        self.parts = self._choose_parts()
        # Bypass mode: the experience maker must not even dispatch the pi_old forward (trainer/bypass.py).
        bypass = install_bypass_experience_maker(self)
        replay = run_spec(self.args).rollout.routing_replay
        if ((replay == "r3" and self._captures_routing()) or replay == "r2") and not bypass:
            install_routing_experience_maker(self, replay)  # the pi_old forward replays (r3) or records (r2) routing

    def _captures_routing(self) -> bool:
        """Whether the engines' routing rides with the samples (r3 replays it, measure compares it)."""
        return run_spec(self.args).rollout.routing_replay in ENGINE_ROUTING_MODES and bool(self.vllm_engines)

    def _choose_parts(self) -> list[StepPart]:
        """This run's parts, in the order their hooks are called (trainer/step_part.py).

        The order matters where two parts share a hook: the samples are put in canonical order before any part reads
        them (the prompt groups, dumps and metrics then repeat under the seed); the engines know the reward's time
        limit before the start's evaluation rolls out; the queue wait ends before the samples are screened;
        the dump plan counts the samples that reward screening and the lag bound kept; the fall warning joins a line
        before it is written; the run store is rewound
        before the start's sync check and evaluation; the sync check's metrics precede the sync's cost.
        """
        args, run_dir, spec = self.args, self.args.logger.run_dir, run_spec(self.args)
        rules = RewardPolicy.from_args(args)
        schedule = EvalSchedule.of(args, self.eval_dataloader)
        # Sleeping engines (--vllm.enable_sleep) are checked too: the checker wakes them to score.
        checker = make_sync_checker(args, self.tokenizer, self.vllm_engines, self.actor_model_group)
        reward_limit = spec.reward.timeout_s
        parts = [
            RolloutOrderPart(),
            RewardLimitPart(self.vllm_engines, reward_limit) if self.vllm_engines and reward_limit else None,
            RoutingCapturePart(self.vllm_engines) if self._captures_routing() else None,
            PolicyVersionPart(self.vllm_engines) if self.vllm_engines else None,
            QueueWaitPart() if self.waits_on_rollout_queue else None,
            RewardScreenPart(rules),
            StalenessPart(rules, spec.staleness.max_lag,
                          partial_rollouts=getattr(args.train, "partial_rollout_enable", False)),
            TokenDumpPart(args, spec.dumps, self.actor_model_group) if self.actor_model_group is not None else None,
            CoveragePart(),
            MismatchByLagPart(),
            SyncCadencePart(spec.sync.every) if spec.sync.every > 1 else None,
            HealthPart(run_dir) if run_dir else None,
            MetricsLinePart(RunWriter(run_dir), schedule) if run_dir else None,
            SyncCheckPart(checker, spec.sync.check_steps) if checker is not None else None,
            SyncCostPart.of(spec, self.vllm_engines),
            StartEvalPart(self._evaluate_now, self._untrained_cache(), self._publish_eval)
            if schedule.configured else None,
        ]
        return [part for part in parts if part is not None]

    def _waits_on(self, stage: str) -> tuple[str, ...]:
        """The actor ids `stage` waits on (trainer/stage_board.py)."""
        engines = actor_ids(self.vllm_engines or ())
        trainers = group_ids(self.actor_model_group, self.critic_model_group)
        if stage in (GENERATE, EVALUATE):
            return engines
        if stage == SYNC:
            return trainers + engines
        if stage == MAKE_EXPERIENCE:
            return group_ids(self.actor_model_group, self.critic_model_group, self.reference_model_group,
                             self.reward_model_group)
        return trainers  # TRAIN, SAVE, LOAD

    def _stage(self, stage: str):
        return self.board.stage(stage, self._waits_on(stage))

    def fit(self, *args, **kwargs):
        # Between upstream's seams the loop generates samples (async training: waits for the generator's).
        with self._stage(GENERATE):
            return super().fit(*args, **kwargs)

    def _evaluate_now(self, step: int) -> dict:
        return self.evaluate(step, **eval_generate_kwargs(self.args, self.generate_kwargs))

    def _untrained_cache(self) -> UntrainedCache | None:
        """--eval.untrained_cache's folder, this run's key and whether stored scores may stand in for its
        evaluation (trainer/untrained_scores.py); None without the flag or a held-out set."""
        folder = getattr(self.args.eval, "untrained_cache", None)
        if not folder or self.eval_dataloader is None:
            return None
        train = getattr(self, "prompts_dataloader", None)  # async training's loader lives in its sample generator
        reusable = may_reuse(self.eval_dataloader.dataset, train.dataset if train is not None else None)
        return UntrainedCache(Path(folder), untrained_key(self.args), reusable)

    def _publish_eval(self, step: int, logs: dict, seconds: float) -> None:
        """Hand an evaluation's logs to every part (`on_eval`), as upstream's evaluation ends."""
        for part in self.parts:
            part.on_eval(step, logs, seconds)

    def init_checkpoint_states(self) -> dict:
        # fit() calls this before its first rollout: the one point where a fresh run's policy is untrained,
        # and where engines and trainer hold the same weights (the sync check's baseline).
        with self._stage(LOAD):
            states = super().init_checkpoint_states()
        for part in self.parts:
            part.on_start(int(states["global_step"]))
        if int(states["global_step"]) == 0 and self._sync_before_training():
            self.broadcast_to_vllm()  # checked like every sync: a broken re-quantizing path stops the run here
        return states

    def _sync_before_training(self) -> bool:
        """Quantized engines on CUDA re-quantize every sync through code that has not yet run on a GPU (docs/gpu.md):
        one sync of the untrained weights, checked, proves the path before any step is spent on it."""
        spec = run_spec(self.args)
        return bool(self.vllm_engines) and spec.cluster.device == "cuda" and spec.rollout.precision in CUDA_QUANTIZED

    def evaluate(self, global_step, **generate_kwargs):
        t0 = time.perf_counter()
        with self._stage(EVALUATE):
            logs = super().evaluate(global_step, **generate_kwargs)
        self._publish_eval(global_step, logs, time.perf_counter() - t0)
        return logs

    def broadcast_to_vllm(self) -> None:
        if any(isinstance(part, SyncCadencePart) and not part.due for part in self.parts):
            return  # --vllm.sync_every: not a step of the cadence, the engines keep their weights
        with self._stage(SYNC):  # the parts' hooks too: the sync check scores on the engines and the trainer
            for part in self.parts:
                part.before_sync()
            t0 = time.perf_counter()
            super().broadcast_to_vllm()
            seconds = time.perf_counter() - t0
            for part in self.parts:
                part.after_sync(seconds)

    def _compute_rollout_stats(self, experiences) -> dict:
        stats = super()._compute_rollout_stats(experiences)
        for part in self.parts:
            stats.update(part.rollout_metrics(experiences))
        return stats

    def train_step(self, rollout_samples, global_step: int):
        for part in self.parts:
            rollout_samples = part.before_step(rollout_samples, global_step + 1)
        with self._stage(MAKE_EXPERIENCE):
            status, global_step = super().train_step(rollout_samples, global_step)
        for part in self.parts:
            part.end_step(status)
        return status, global_step

    def ppo_train(self, global_steps: int) -> dict:
        trains_actor = global_steps > self.args.critic.freezing_steps  # upstream's own condition
        for part in self.parts:
            part.before_fit(global_steps + 1, trains_actor)
        with self._stage(TRAIN):
            status = super().ppo_train(global_steps)
        for part in self.parts:
            part.after_fit(global_steps + 1)
        return status

    def save_logs_and_checkpoints(self, global_step: int, logs_dict=None, client_states=None) -> None:
        for part in self.parts:
            part.on_log(global_step, logs_dict or {})
        with self._stage(SAVE):
            super().save_logs_and_checkpoints(global_step, logs_dict, client_states)
        for part in self.parts:
            part.after_save(global_step)


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

    def save_logs_and_checkpoints(self, global_step: int, logs_dict=None, client_states=None) -> None:
        """Upstream's, then the evaluation upstream's sync fit() runs right after it, under the same condition."""
        super().save_logs_and_checkpoints(global_step, logs_dict, client_states)
        if EvalSchedule.of(self.args, self.eval_dataloader).due(global_step):
            logs = self.evaluate(global_step, **eval_generate_kwargs(self.args, self.generate_kwargs))
            self.save_best_checkpoint(logs, global_step, dict(client_states or {}))

    @torch.no_grad()
    def evaluate(self, global_step, **generate_kwargs):
        samples = self.samples_generator.generate_eval_samples(**generate_kwargs)
        logs = compute_eval_metrics(self.eval_dataloader, samples, generate_kwargs["n_samples_per_prompt"])
        if self.wandb_logger:
            self.wandb_logger.log_eval(global_step, logs)
        if self.tensorboard_logger:
            self.tensorboard_logger.log_eval(global_step, logs)
        return logs


class _TisPPOTrainer(ForkController, _UpstreamPPOTrainer, InsideSyncHooks):
    pass


class _TisTrainingActor(ForkController, TrainerSideEval, _UpstreamTrainingActor, InsideSyncHooks):
    waits_on_rollout_queue = True


class _TisGenerateSamplesActor(_UpstreamGenerateSamplesActor):
    """Upstream's async sample generator without its own evaluation: the trainer evaluates (TrainerSideEval); its
    prompt loader shuffles by the run's seed (rollout/sampling_seeds.py)."""

    def __init__(self, *args, **kwargs):
        seed_data_order(*args, **kwargs)
        super().__init__(*args, **kwargs)

    def _should_eval(self, global_step):
        return False


class _TisPPOTrainerAsync(_UpstreamPPOTrainerAsync):
    """Upstream's async driver, building the fork's trainer and generator; the trainer gets the generate kwargs.

    Upstream's `__init__` builds both from the module globals `TrainingActor` and `GenerateSamplesActor` of
    `openrlhf.trainer.ppo_trainer_async`, with no seam, in this actor's own Ray worker (not the driver, where
    patches/fork_classes.py applies): they point at the fork's classes from just before it runs, never restored."""

    def __init__(self, *args, **generate_kwargs):
        require_version("openrlhf", "==0.11.2", patch=_THIS_FILE)
        replace(upstream_async, "TrainingActor", TisTrainingActor, patch=_THIS_FILE)
        replace(upstream_async, "GenerateSamplesActor", TisGenerateSamplesActor, patch=_THIS_FILE)
        super().__init__(*args, **generate_kwargs)
        ray.get(self.trainer_actor.set_generate_kwargs.remote(generate_kwargs))


def check_sync_hooks_reached() -> None:
    """Refuse an upstream in which a sync no longer reaches `InsideSyncHooks` (every class above it in the fork's
    controllers must call `super().broadcast_to_vllm()`; otherwise the parts' `synced` hook silently never runs)."""
    for controller in (_TisPPOTrainer, _TisTrainingActor):
        require_super_chain(controller, "broadcast_to_vllm", InsideSyncHooks, patch=_THIS_FILE)


TisPPOTrainer = ray.remote(_TisPPOTrainer)
TisTrainingActor = ray.remote(_TisTrainingActor)
TisGenerateSamplesActor = ray.remote(_TisGenerateSamplesActor)
TisPPOTrainerAsync = ray.remote(_TisPPOTrainerAsync)
