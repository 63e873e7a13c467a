"""The controller's jobs, one part each, behind one interface the controller calls at fixed points.

`ForkController` (trainer/ppo_trainer.py) overrides each of upstream's seams once and calls the hook of that
seam on every part, in the order of its list of parts (which it chooses at construction from the run's flags).
A part sees only what its constructor and its hooks hand it, so each is tested alone (tests/test_step_parts.py).

Hooks, in the order a run reaches them. `step` is always a metrics line's step number: 1 for the first trained
step; upstream's `ppo_train(global_steps)` trains step global_steps + 1 and `save_logs_and_checkpoints` logs it.

    on_start(step)                  init_checkpoint_states, before the first rollout; step: the steps in the
                                    checkpoint (0: a fresh run, whose engines and trainer hold the same weights)
    before_step(samples, step)      train_step, before upstream's: returns the rollout samples to train on
    rollout_metrics(experiences)    _compute_rollout_stats: metrics of the step's experiences (before balancing)
    before_fit(step, trains_actor)  ppo_train, before the actors' fit (trains_actor: upstream's own condition)
    after_fit(step)                 ppo_train, after it: the actor's weights are version `step`
    before_sync()                   broadcast_to_vllm, before upstream's weight sync
    synced()                        inside upstream's critical section of the sync, once the weights are in
                                    (the vLLM lock, or paused generation: trainer/ppo_trainer.py InsideSyncHooks)
    after_sync(seconds)             after the sync; seconds: upstream's sync alone
    end_step(status)                train_step, after upstream's: adds the step's metrics to its status
    on_log(step, logs)              save_logs_and_checkpoints, before upstream's: logs is the step's whole status
    on_eval(step, logs, seconds)    evaluate: upstream's held-out logs (`eval_*`) of the policy after `step` steps
    after_save(step)                save_logs_and_checkpoints, after upstream's (and the async trainer's evaluation)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import ray
import torch

from openrlhf_tis.metric_names import (
    EVAL_PREFIX,
    EVAL_START_PREFIX,
    FP8_SYNC_PREFIX,
    INT8_SYNC_PREFIX,
    LOGPROB_COVERAGE,
    QUEUE_WAIT,
    SYNC_CHECK_SECONDS,
    SYNC_WEIGHTS_SECONDS,
)
from openrlhf_tis.rollout.sampling_seeds import in_canonical_order
from openrlhf_tis.run_spec import DumpPlan, RunSpec
from openrlhf_tis.runs.health import FallWatch, watch_records
from openrlhf_tis.runs.reader import read_metrics_records
from openrlhf_tis.runs.store import RunWriter
from openrlhf_tis.runs.tokens import select_samples, should_dump
from openrlhf_tis.trainer.mismatch_by_lag import mismatch_by_lag
from openrlhf_tis.trainer.rewards import RewardPolicy, screen_rewards
from openrlhf_tis.trainer.staleness import LAG, drop_stale, sample_lags, spans_sync, staleness_metrics, stamp_lags
from openrlhf_tis.trainer.sync_check import SyncChecker
from openrlhf_tis.trainer.token_dumps import TokenDumpPlan
from openrlhf_tis.trainer.untrained_scores import UntrainedCache


class StepPart:
    """One job of the controller; every hook does nothing until a part overrides it (see the module doc)."""

    def on_start(self, step: int) -> None:
        pass

    def before_step(self, samples: list, step: int) -> list:
        return samples

    def rollout_metrics(self, experiences: Sequence) -> dict[str, float]:
        return {}

    def before_fit(self, step: int, trains_actor: bool) -> None:
        pass

    def after_fit(self, step: int) -> None:
        pass

    def before_sync(self) -> None:
        pass

    def synced(self) -> None:
        pass

    def after_sync(self, seconds: float) -> None:
        pass

    def end_step(self, status: dict) -> None:
        pass

    def on_log(self, step: int, logs: dict) -> None:
        pass

    def on_eval(self, step: int, logs: dict, seconds: float) -> None:
        pass

    def after_save(self, step: int) -> None:
        pass


class PendingMetrics(StepPart):
    """A part whose metrics, gathered during a step (or before the first), join that step's status at its end."""

    def __init__(self):
        self.pending: dict[str, float] = {}

    def end_step(self, status: dict) -> None:
        status.update(self.pending)
        self.pending = {}


# ── the engines' reward calls ──

class RewardLimitPart(StepPart):
    """Gives every engine the run's `--reward.timeout_s` before the first rollout: the engines' reward executors
    (rollout/reward_executor.py) are built by upstream, which knows nothing of the flag."""

    def __init__(self, engines: Sequence, seconds: float):
        self.engines = engines
        self.seconds = seconds

    def on_start(self, step: int) -> None:
        ray.get([engine.set_reward_timeout.remote(self.seconds) for engine in self.engines])


class RoutingCapturePart(StepPart):
    """`--vllm.routing_replay r3` or `measure`: every engine captures its requests' routed experts from the first
    rollout on (rollout/engine_actor.py `start_routing_capture`), for the samples to carry to the trainer
    (trainer/moe_replay.py); at each sync it drops the routing of requests aborted before their take."""

    def __init__(self, engines: Sequence):
        self.engines = engines

    def on_start(self, step: int) -> None:
        ray.get([engine.start_routing_capture.remote() for engine in self.engines])

    def synced(self) -> None:
        ray.get([engine.forget_stale_routing.remote() for engine in self.engines])


# ── the step's samples ──

class RewardScreenPart(PendingMetrics):
    """NaN/inf rewards fail the step or drop their groups before upstream computes advantages (trainer/rewards.py)."""

    def __init__(self, policy: RewardPolicy):
        super().__init__()
        self.policy = policy

    def before_step(self, samples: list, step: int) -> list:
        samples, self.pending = screen_rewards(samples, self.policy, step)
        return samples


class StalenessPart(PendingMetrics):
    """Each sample's lag behind π_old, the groups beyond `--train.async_max_lag` dropped (trainer/staleness.py).

    Step s trains with π_old = version s - 1. The lags travel to the actor as a per-sample info key, which the
    actor logs like every other; `staleness/*` says it whole, so that key leaves the step's status.
    """

    def __init__(self, rules: RewardPolicy, max_lag: int | None, partial_rollouts: bool):
        super().__init__()
        self.rules, self.max_lag, self.partial_rollouts = rules, max_lag, partial_rollouts

    def before_step(self, samples: list, step: int) -> list:
        lags = sample_lags(samples, step - 1)
        samples, lags, dropped = drop_stale(samples, lags, self.max_lag, self.rules, step)
        spanning = spans_sync(samples) if self.partial_rollouts else ()
        stamp_lags(samples, lags)
        self.pending = {**staleness_metrics(lags, spanning), **dropped}
        return samples

    def end_step(self, status: dict) -> None:
        status.pop(LAG, None)
        super().end_step(status)


class RolloutOrderPart(StepPart):
    """The step's samples in an order no timing decides (rollout/sampling_seeds.py), not the order they finished in:
    the replay buffer, its micro-batches and its shuffle then repeat under the seed."""

    def before_step(self, samples: list, step: int) -> list:
        return in_canonical_order(samples)


class QueueWaitPart(PendingMetrics):
    """Async training: how long the trainer waited between handing over a step's line and starting the next."""

    def __init__(self):
        super().__init__()
        self.step_end: float | None = None

    def before_step(self, samples: list, step: int) -> list:
        self.pending = {QUEUE_WAIT: time.perf_counter() - self.step_end} if self.step_end is not None else {}
        return samples

    def after_save(self, step: int) -> None:
        self.step_end = time.perf_counter()


def rollout_logprob_coverage(experiences: Sequence) -> float:
    """Fraction of response tokens that carry a finite rollout log-prob (1.0 when rollouts are whole)."""
    covered = total = 0
    for exp in experiences:
        mask = exp.action_mask.bool()
        total += int(mask.sum())
        lp = exp.rollout_log_probs
        if lp is not None and lp.shape == mask.shape:
            covered += int((torch.isfinite(lp) & mask).sum())
    return covered / max(total, 1)


class CoveragePart(StepPart):
    """`rollout/logprob_coverage` among upstream's rollout statistics."""

    def rollout_metrics(self, experiences: Sequence) -> dict[str, float]:
        return {LOGPROB_COVERAGE: rollout_logprob_coverage(experiences)}


class MismatchByLagPart(StepPart):
    """`mismatch_by_lag/*`: the step's μ vs π_old gap split into precision (lag 0) and staleness (lag > 0)."""

    def rollout_metrics(self, experiences: Sequence) -> dict[str, float]:
        return mismatch_by_lag(experiences)


# ── the actors ──

def token_dump_plan(args, dumps: DumpPlan, step: int, num_samples: int) -> TokenDumpPlan | None:
    """The dump plan of `step` (a metrics-line step number), or None when the step is not dumped.

    Step 1 and every `dumps.steps`-th (the run spec's `--logger.token_dump_steps`); `dumps.samples` samples chosen by
    (train seed, step), whole prompt groups, so a resumed run picks what the killed one would have.
    The CLI made the run directory absolute, so the actors' files land beside metrics.jsonl.
    """
    run_dir = getattr(args.logger, "run_dir", None)
    if not run_dir or num_samples <= 0 or not should_dump(step, dumps.steps):
        return None
    group = max(int(args.rollout.n_samples_per_prompt), 1)
    ids = select_samples(num_samples, dumps.samples, step, seed=args.train.seed, group_size=group)
    if len(ids) == 0:
        return None
    return TokenDumpPlan(step=step, run_dir=run_dir, sample_ids=tuple(int(i) for i in ids), group_size=group)


class TokenDumpPart(StepPart):
    """Tells every actor the step's dump plan before its fit (trainer/token_dumps.py); nothing on other steps.

    Upstream numbers the samples it trains 0..n-1 (`Experience.index`), n counted after the screening parts.
    A step whose actor is frozen (critic warm-up) is not announced: a plan left unconsumed would be applied
    to the next step's fit under the wrong step number.
    """

    def __init__(self, args, dumps: DumpPlan, actor_group):
        self.args, self.dumps, self.actor_group = args, dumps, actor_group
        self.num_samples = 0

    def before_step(self, samples: list, step: int) -> list:
        self.num_samples = len(samples)
        return samples

    def before_fit(self, step: int, trains_actor: bool) -> None:
        plan = token_dump_plan(self.args, self.dumps, step, self.num_samples) if trains_actor else None
        if plan is not None:
            ray.get(self.actor_group.async_run_method(method_name="set_token_dump", plan=plan))


# ── the weight sync ──

class PolicyVersionPart(StepPart):
    """Tells every engine the policy version it holds once a sync is in, before it may generate again.

    The version counts the optimizer steps in the actor's weights (trainer/staleness.py): a resumed run starts
    at its checkpoint's, and each step's fit adds one.
    """

    def __init__(self, engines: Sequence):
        self.engines = engines
        self.version = 0

    def on_start(self, step: int) -> None:
        self.version = step

    def after_fit(self, step: int) -> None:
        self.version = step

    def synced(self) -> None:
        ray.get([engine.set_policy_version.remote(self.version) for engine in self.engines])


class SyncCheckPart(PendingMetrics):
    """Every `every`-th weight sync verified by what the engines compute (trainer/sync_check.py).

    The baseline is measured at a fresh run's start. Syncs are counted from the controller's start, a resumed
    run's first sync (before its first step) included. `sync/check_s` is the scoring before and after a sync.
    """

    def __init__(self, checker: SyncChecker, every: int):
        super().__init__()
        self.checker, self.every = checker, every
        self.syncs = 0
        self.due = False
        self.probe = None
        self.seconds = 0.0

    def on_start(self, step: int) -> None:
        if step == 0:
            self.pending.update(self.checker.start())

    def before_sync(self) -> None:
        self.syncs += 1
        self.due = self.syncs % self.every == 0
        if self.due:
            t0 = time.perf_counter()
            self.probe = self.checker.before_sync()
            self.seconds = time.perf_counter() - t0

    def after_sync(self, seconds: float) -> None:
        if self.due:
            t0 = time.perf_counter()
            self.pending.update(self.checker.after_sync(self.probe))
            self.pending[SYNC_CHECK_SECONDS] = self.seconds + time.perf_counter() - t0


class SyncCostPart(PendingMetrics):
    """`sync/weights_s` (upstream's sync alone; its `timing/broadcast` covers the check too), and what quantized engines
    return of each re-quantization (`rollout/int8_*`, `rollout/fp8_*`: the worst engine's,
    rollout/weight_sync/requantize.py)."""

    STATS = ("saturated_fraction", "max_rel_error", "quantize_s")

    def __init__(self, quantized_engines: Sequence = (), prefix: str = INT8_SYNC_PREFIX):
        super().__init__()
        self.quantized_engines, self.prefix = quantized_engines, prefix

    @classmethod
    def of(cls, spec: RunSpec, engines: Sequence | None) -> SyncCostPart:
        """INT8 engines re-quantize on either device; FP8 ones only on CUDA (CPU FP8 engines quantize online)."""
        precision = spec.rollout.precision
        cuda_fp8 = precision == "fp8" and spec.cluster.device == "cuda"
        if not engines or not (precision == "int8" or cuda_fp8):
            return cls()
        return cls(engines, INT8_SYNC_PREFIX if precision == "int8" else FP8_SYNC_PREFIX)

    def after_sync(self, seconds: float) -> None:
        self.pending[SYNC_WEIGHTS_SECONDS] = seconds
        if not self.quantized_engines:
            return
        records = [r for stats in ray.get([e.last_sync_stats.remote() for e in self.quantized_engines])
                   for r in stats]
        self.pending.update({self.prefix + key: max(float(r[key]) for r in records if key in r)
                             for key in self.STATS if any(key in r for r in records)})


# ── held-out scores and the run store ──

@dataclass(frozen=True)
class EvalSchedule:
    """Upstream's held-out evaluation: after every `every`-th step (`--eval.steps`; inf: never), if a set is loaded."""

    loaded: bool
    every: float

    @classmethod
    def of(cls, args, eval_dataloader) -> EvalSchedule:
        return cls(loaded=eval_dataloader is not None, every=args.eval.steps)

    @property
    def configured(self) -> bool:
        return self.loaded and self.every != float("inf")

    def due(self, step: int) -> bool:
        return self.configured and step % self.every == 0


class StartEvalPart(StepPart):
    """Scores the untrained policy before a fresh run's first step (upstream never does).

    `evaluate(step)` is the controller's evaluation, so the scores reach every part's `on_eval` as step 0's. With a
    `cache` (--eval.untrained_cache, trainer/untrained_scores.py) scores stored under the run's key are handed to
    `publish(step, logs, seconds)`, the controller's hand-out to the parts, instead; scores computed here are stored.
    """

    def __init__(self, evaluate: Callable[[int], dict], cache: UntrainedCache | None = None,
                 publish: Callable[[int, dict, float], None] | None = None):
        if cache is not None and publish is None:
            raise ValueError("a cache needs publish: stored scores must reach the parts as an evaluation's do")
        self.evaluate, self.cache, self.publish = evaluate, cache, publish

    def on_start(self, step: int) -> None:
        if step != 0:
            return
        t0 = time.perf_counter()
        stored = self.cache.read() if self.cache is not None else None
        if stored is not None:
            print(f"[openrlhf_tis] untrained held-out scores: {self.cache.path} (stored by an earlier run)")
            self.publish(0, stored, time.perf_counter() - t0)
            return
        logs = self.evaluate(0)
        if self.cache is not None and logs:
            self.cache.write(logs, time.perf_counter() - t0)


def eval_metrics(logs: dict, prefix: str, seconds: float) -> dict[str, float]:
    """Upstream's eval logs (`eval_default_pass1`, ...) as run-store metrics (`<prefix>default_pass1`, ...)."""
    metrics = {prefix + key.removeprefix("eval_"): value for key, value in logs.items()}
    metrics[prefix + "seconds"] = seconds
    return metrics


class HealthPart(StepPart):
    """`health/*` on every metrics line (runs/health.py), before the line is written; a resumed run's watch starts
    from the lines it keeps, so its warning is the one an uninterrupted run would give."""

    def __init__(self, run_dir: str):
        self.run_dir, self.watch = run_dir, FallWatch()

    def on_start(self, step: int) -> None:
        self.watch = watch_records(r for r in read_metrics_records(self.run_dir) if r["step"] <= step)

    def on_log(self, step: int, logs: dict) -> None:
        if logs:
            logs.update(self.watch.update(step, logs))


class MetricsLinePart(StepPart):
    """One metrics.jsonl line per step (runs/store.py), with the held-out scores of the step on it.

    A resumed run first forgets what was logged after its checkpoint: those steps are trained again. The
    untrained policy's scores (step 0's: `eval_start/*`) open the first line; the line of an evaluated step
    waits for its scores (`eval/*`), which upstream takes right after the line is handed over.
    """

    def __init__(self, writer: RunWriter, schedule: EvalSchedule):
        self.writer, self.schedule = writer, schedule
        self.front: dict[str, float] = {}
        self.held: tuple[int, dict] | None = None

    def on_start(self, step: int) -> None:
        dropped = self.writer.rewind(step)
        if dropped:
            print(f"[openrlhf_tis] run store: dropped {dropped} record(s) after step {step}, "
                  "which this run trains again")

    def on_log(self, step: int, logs: dict) -> None:
        if not logs:
            return
        line = {**self.front, **logs}
        self.front = {}
        if self.schedule.due(step):
            self.held = (step, line)
        else:
            self.writer.append_metrics(step, line)

    def on_eval(self, step: int, logs: dict, seconds: float) -> None:
        if self.held is not None and self.held[0] == step:
            line = {**self.held[1], **eval_metrics(logs, EVAL_PREFIX, seconds)}
            self.held = None
            self.writer.append_metrics(step, line)
        elif step == 0:
            self.front = eval_metrics(logs, EVAL_START_PREFIX, seconds)
