"""Verify every DeepSpeed -> vLLM weight sync by what the engines compute, not by what was sent.

A sync can fail silently (docs/design.md §5: a disabled NCCL group leaves NaN weights, a stale tied lm_head,
per-tensor loads that never reach packed CPU kernels) and the run still exits 0. So after a sync the
engines score a fixed probe text and sample a few tokens after it, and the trainer scores the same tokens.

A fixed tolerance on the engine-vs-trainer gap cannot tell a failed sync from a coarse rollout precision:
a W4A8 engine that loaded the right weights differs from the trainer by ~2 nats a token, more than a bf16
engine holding garbage. So the check is relative to what this precision costs (SyncRule):

- baseline: the gap measured when both sides hold the same weights (before the first step, `start`);
- a sync fails when its gap exceeds the baseline by more than `--vllm.sync_check_tolerance` (in nats; in units
  of the baseline once that exceeds one nat: the gap is measured on the few tokens the engine samples, so its
  spread grows with its level: a correct W4A8 SmolLM2 run's gap nearly doubled in four steps, see
  docs/measurements.md), when any
  log-prob is non-finite, or when the engine computes bit-identical probe log-probs to the previous
  check while the trainer's moved (the engine kept its old weights: a quantized engine still changes at
  every real step, since its norms, embeddings and scales follow the trainer's weights).

Metrics (per checked sync):
- `sync/vllm_vs_trainer_mean_abs_logprob` (and `_max_`): |log mu - log pi| on tokens each engine sampled
  after the sync, at the rollout temperature (the processed log-probs rollouts use);
- `sync/baseline_mean_abs_logprob`: that gap when both sides held the same weights;
  `sync/vllm_vs_trainer_excess`: gap minus baseline (what the tolerance bounds);
- `sync/vllm_logprob_change_mean_abs`: how far the engine's probe log-probs moved through this sync;
- `sync/vllm_probe_change_mean_abs`, `sync/trainer_probe_change_mean_abs`: how far the engine's and the
  trainer's probe log-probs moved since the previous check (the same interval on both sides).

Sleeping engines (`--vllm.enable_sleep`, the colocated hybrid engine; GPU only): upstream keeps the engines
asleep (level 1: weights backed up to host memory, KV cache released) except while they generate, and its sync
wakes the weights alone. A sleeping engine cannot score, so the check scores where upstream's sync left them,
weights awake, after waking the KV cache that upstream's next rollout wakes anyway, and leaves them awake
(`SleepingEngines`): that rollout's own `wake_up()` then finds nothing asleep and its `sleep()` restores
upstream's state. A check adds no wake/sleep cycle (the weights never go to host memory and back for it); what it
moves is the KV cache's allocation, from the rollout's start to the sync's end, beside the trainer's probe
forward of a few dozen tokens. The probe before a sync is skipped there (the engines sleep then):
`sync/vllm_probe_change_mean_abs` says how far the engines moved (through this one sync when every sync is
checked); `sync/vllm_logprob_change_mean_abs` is then absent. docs/design.md §4.
"""

from __future__ import annotations

from dataclasses import dataclass

import ray
import torch

from openrlhf_tis.metric_names import (
    SYNC_BASELINE,
    SYNC_EXCESS,
    SYNC_GAP_MAX,
    SYNC_GAP_MEAN,
    SYNC_TRAINER_PROBE_CHANGE,
    SYNC_VLLM_LOGPROB_CHANGE,
    SYNC_VLLM_PROBE_CHANGE,
)
from openrlhf_tis.run_spec import run_spec

PROBE_TEXT = "The quick brown fox jumps over the lazy dog. Question: what is 12 + 7? Answer: 19."
# Mean |dlog p| the trainer's probe log-probs must have moved for an unchanged engine to count as stale. A real
# engine changes with any weight that crosses its dtype's rounding step, so an unchanged engine after a trainer
# move this large (a deterministic forward gives 0 on unchanged weights) kept its old weights.
STALE_DRIFT = 1e-3


class WeightSyncError(RuntimeError):
    """The engines do not compute with the weights the trainer just sent."""


@dataclass
class SyncProbe:
    """Prompt log-probs (temperature 1, unprocessed) each engine gives the probe before a sync."""

    prompt_logprobs: list[torch.Tensor]


@dataclass
class ProbeScore:
    """One engine's side of a check: what SyncRule judges.

    `gap`: |log mu - log pi| per sampled token; `engine_probe` / `trainer_probe`: each side's log-probs of the
    probe text's own tokens (teacher-forced, so the same tokens at every check; each side in its own
    temperature convention, compared only with itself).
    """

    gap: torch.Tensor
    engine_probe: torch.Tensor
    trainer_probe: torch.Tensor


class SyncRule:
    """Decides from log-probs alone whether a sync put the trainer's weights into every engine."""

    def __init__(self, tolerance: float, stale_drift: float = STALE_DRIFT):
        self.tolerance = tolerance
        self.stale_drift = stale_drift
        self.baseline: float | None = None
        self._last: list[ProbeScore] | None = None

    def start(self, scores: list[ProbeScore]) -> dict[str, float]:
        """Both sides hold the same weights: the gap measured now is what the rollout precision costs."""
        for i, score in enumerate(scores):
            _check_finite(i, score, "before training")
        self.baseline = torch.cat([s.gap for s in scores]).mean().item()
        self._last = scores
        return {SYNC_BASELINE: self.baseline}

    def judge(self, scores: list[ProbeScore]) -> dict[str, float]:
        """Metrics of a checked sync; WeightSyncError when an engine does not compute with the new weights.

        Without a baseline (a resumed run: the engines start from the base model, the trainer from its
        checkpoint) this check's gap becomes the baseline and only the finiteness test applies.
        """
        for i, score in enumerate(scores):
            _check_finite(i, score, "after the sync")
        if self.baseline is None:
            self.baseline = torch.cat([s.gap for s in scores]).mean().item()
        moves: dict[str, float] = {}
        if self._last is not None:  # first: an engine that did not move at all is the precise diagnosis
            engine_moves, trainer_moves = [], []
            for i, (now, last) in enumerate(zip(scores, self._last, strict=True)):
                trainer_move = (now.trainer_probe - last.trainer_probe).abs()
                if torch.equal(now.engine_probe, last.engine_probe) and trainer_move.mean().item() > self.stale_drift:
                    raise WeightSyncError(
                        f"weight sync: engine {i} computes bit-identical probe log-probs to the previous check while "
                        f"the trainer's moved by {trainer_move.mean().item():.4f} mean |dlogp|: the engine kept its "
                        "old weights")
                engine_moves.append((now.engine_probe - last.engine_probe).abs())
                trainer_moves.append(trainer_move)
            moves = {SYNC_VLLM_PROBE_CHANGE: torch.cat(engine_moves).mean().item(),
                     SYNC_TRAINER_PROBE_CHANGE: torch.cat(trainer_moves).mean().item()}
        limit = self.baseline + self.tolerance * max(1.0, self.baseline)
        for i, score in enumerate(scores):
            if (gap := score.gap.mean().item()) > limit:
                raise WeightSyncError(
                    f"weight sync: engine {i} and the trainer disagree by {gap:.4f} mean |dlogp| on the probe after "
                    f"a sync, {gap - self.baseline:.4f} more than when both held the same weights "
                    f"({self.baseline:.4f}; tolerance {self.tolerance} x max(1, baseline), "
                    "--vllm.sync_check_tolerance): the engine does not compute with "
                    "the trained weights")
        gap = torch.cat([s.gap for s in scores])
        metrics = {SYNC_GAP_MEAN: gap.mean().item(), SYNC_GAP_MAX: gap.max().item(), SYNC_BASELINE: self.baseline,
                   SYNC_EXCESS: gap.mean().item() - self.baseline, **moves}
        self._last = scores
        return metrics


def _check_finite(i: int, score: ProbeScore, when: str) -> None:
    if not all(torch.isfinite(t).all() for t in (score.gap, score.engine_probe, score.trainer_probe)):
        raise WeightSyncError(
            f"weight sync: engine {i} or the trainer gives non-finite log-probs on the probe {when} "
            f"(gap {score.gap.tolist()}, engine probe {score.engine_probe.tolist()}): the engine did not load "
            "the weights")


def _prompt_logprobs(output) -> torch.Tensor:
    ids = output.prompt_token_ids
    return torch.tensor([output.prompt_logprobs[i][tok].logprob for i, tok in enumerate(ids) if i > 0])


def _sampled_logprobs(output) -> tuple[list[int], torch.Tensor]:
    completion = output.outputs[0]
    ids = list(completion.token_ids)
    return ids, torch.tensor([completion.logprobs[i][tok].logprob for i, tok in enumerate(ids)])


def probe_score(output, trainer_logprobs: torch.Tensor) -> ProbeScore:
    """A ProbeScore from an engine's probe output and the trainer's log-probs of the probe + sampled tokens
    (every token after the first, as `trainer_sequence` lays them out)."""
    _, engine_lp = _sampled_logprobs(output)
    trainer_logprobs = trainer_logprobs.float()
    split = len(trainer_logprobs) - len(engine_lp)
    return ProbeScore(gap=(engine_lp - trainer_logprobs[split:]).abs(), engine_probe=_prompt_logprobs(output),
                      trainer_probe=trainer_logprobs[:split])


def probe_sampling_params(temperature: float, max_tokens: int):
    """The probe's sampling: the rollout temperature, a fixed seed, prompt and sampled log-probs."""
    from vllm import SamplingParams

    return SamplingParams(temperature=temperature, max_tokens=max_tokens, prompt_logprobs=0, logprobs=0, seed=1234,
                          ignore_eos=True)


def trainer_sequence(output) -> tuple[torch.Tensor, int]:
    """The probe plus the engine's sampled tokens as one sequence, and how many tokens to score (all but the first)."""
    new_ids, _ = _sampled_logprobs(output)
    sequence = torch.tensor([list(output.prompt_token_ids) + new_ids])
    return sequence, sequence.shape[1] - 1


class SleepingEngines:
    """Engines under `--vllm.enable_sleep`, woken for a check and left awake for upstream's next rollout (see the
    module doc).

    `wake_up()` without tags wakes what still sleeps: after upstream's sync only the KV cache (its own rollouts
    rely on the same call, and on it doing nothing when nothing sleeps).
    """

    def __init__(self, engines):
        self.engines = engines

    def wake(self) -> None:
        ray.get([engine.wake_up.remote() for engine in self.engines])


def make_sync_checker(args, tokenizer, vllm_engines, actor_group) -> SyncChecker | None:
    """The run's checker; None when nothing is checked (no engines, or `--vllm.sync_check_steps 0` in the run spec).

    Sleeping engines are checked too: the checker wakes them to score (see the module doc).
    """
    sync = run_spec(args).sync
    if not vllm_engines or not sync.check_steps:
        return None
    return SyncChecker(tokenizer, vllm_engines, actor_group, temperature=args.rollout.temperature,
                       tolerance=sync.check_tolerance, sleeping=bool(args.vllm.enable_sleep))


class SyncChecker:
    """Scores the probe on the engines and the trainer at the start, before a sync and after it."""

    def __init__(self, tokenizer, vllm_engines, actor_group, temperature: float, tolerance: float, new_tokens: int = 8,
                 sleeping: bool = False):
        self.prompt_ids = tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"]
        self.engines = vllm_engines
        self.actor_group = actor_group
        self.temperature = temperature
        self.rule = SyncRule(tolerance)
        self.new_tokens = new_tokens
        self.sleeping = SleepingEngines(vllm_engines) if sleeping else None

    def _score(self, max_tokens: int) -> list:
        params = probe_sampling_params(self.temperature, max_tokens)
        if self.sleeping:
            self.sleeping.wake()
        return ray.get([engine.generate.remote(self.prompt_ids, params) for engine in self.engines])

    def _probe_scores(self) -> tuple[list, list[ProbeScore]]:
        outputs = self._score(max_tokens=self.new_tokens)
        scores = []
        for output in outputs:
            sequence, n = trainer_sequence(output)
            trainer_lp = ray.get(self.actor_group.async_run_method(
                method_name="forward", sequences=sequence, action_mask=torch.ones(1, n, dtype=torch.bool),
                attention_mask=torch.ones_like(sequence)))[0][0]
            scores.append(probe_score(output, trainer_lp))
        return outputs, scores

    def start(self) -> dict[str, float]:
        """Measure the baseline gap; call where engines and trainer hold the same weights (before the first step)."""
        return self.rule.start(self._probe_scores()[1])

    def before_sync(self) -> SyncProbe | None:
        """The engines' probe log-probs before a sync; None for sleeping engines (see the module doc)."""
        if self.sleeping:
            return None
        return SyncProbe([_prompt_logprobs(o) for o in self._score(max_tokens=1)])

    def after_sync(self, probe: SyncProbe | None) -> dict[str, float]:
        outputs, scores = self._probe_scores()
        metrics = self.rule.judge(scores)
        if probe is not None:
            changes = [(_prompt_logprobs(o) - before).abs() for o, before in zip(outputs, probe.prompt_logprobs,
                                                                                  strict=True)]
            metrics[SYNC_VLLM_LOGPROB_CHANGE] = torch.cat(changes).mean().item()
        return metrics
