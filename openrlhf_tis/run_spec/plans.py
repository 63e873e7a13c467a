"""The run spec: what the driver resolved from a command line, once, frozen; the one thing every process reads.

Flags say what a user asked; several of them only mean something once combined with the cluster and with each
other: `--cluster.device auto` is a decision about the cluster, `--vllm.int8_weight_bits auto` one about its CPU, a
correction is a preset overlaid with fields (or upstream's `is_correction_*` flags mapped onto one), a CPU run
replaces upstream's GPU defaults. `cli/resolve.py` makes these decisions once on the driver, after the checks (which
only check), into a `RunSpec`; `apply_spec` puts it into upstream's namespace at `fork.spec`, so Ray hands it to every
actor with the arguments, and the run store's config.json records it field by field (`fork.spec.*`). Nothing
downstream re-derives a decision from the flags: the actor's loss, the controller's sync cadence, sync check, token
dumps, reward limits and staleness bound, and the driver's rollout model all read the spec.

Imports only the correction's config and the run store's name for it, so every layer above the core may read it.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any

from openrlhf_tis.correction.config import CorrectionConfig
from openrlhf_tis.flags import Flag, flag, plan_flags
from openrlhf_tis.moe.coverage import COVERED_MODEL_TYPES, REPLAY_FLAG, REPLAY_MODES
from openrlhf_tis.runs.config import SPEC_KEY

SPEC_DEST = SPEC_KEY
"""Where the spec lives in upstream's namespace (flat dest; `args.fork.spec` once upstream hierarchizes it)."""


@dataclass(frozen=True)
class ClusterPlan:
    """Where the run computes: decided by its cluster, never by the driver (cli/cluster_device.py)."""

    device: str
    """cpu or cuda."""
    resources: str
    """The cluster that decided it, as refusals name it."""
    cpu_defaults: tuple[tuple[str, Any], ...] = ()
    """Upstream's GPU defaults a CPU run replaced: (dest, value) pairs, applied to the namespace by `apply_spec`."""


INT8_WEIGHT_BITS = (8, 7, 6, 5, 4)
"""int8 rollouts' weight grids, in int8 storage: 7 bits (values in [-64, 63]) where 8-bit weights saturate the GEMM
(rollout/quantize.py int8_weight_bits); 6, 5, 4 bits are coarser grids on the same kernel, a mismatch dose axis."""
WEIGHT_GRID = Flag("--vllm.int8_weight_bits", default="auto", choices=("auto", *map(str, INT8_WEIGHT_BITS)), help=(
    "Grid of the int8 weights: 8 bits, or 7 (values in [-64, 63], int8 storage) for x86 CPUs without "
    "VNNI, where vLLM-CPU's oneDNN int8 GEMM saturates 16-bit pair sums of full-range weights (measured: 15%% "
    "max error per GEMM; 8 is refused there). auto picks 7 exactly there. 6, 5, 4: coarser grids on the same "
    "kernel (W6A8..W4A8), a stronger rollout mismatch for dose-response studies."))
"""The one rollout flag the spec holds decided (`auto` resolved for the cluster's CPU: RolloutPlan.weight_bits)."""


@dataclass(frozen=True)
class RolloutPlan:
    """The rollout engines' precision with every `auto` decided (rollout/precision.py, docs/rollout_precision.md)."""

    precision: str = flag("--vllm.rollout_precision", "bf16", """Precision of the vLLM rollout engines. int8: W8A8
        compressed-tensors (per-channel int8 weights, dynamic per-token or static calibrated int8 activations;
        embeddings and lm_head unquantized), written under the run dir before the engines start and re-quantized at
        every weight sync (FlashRL-style calibration transfer). fp32: float32 engine (bf16 trainer weights upcast at
        each sync); fp8: online FP8 (fp8_per_channel on CPU). Non-bf16 precisions are wired for the CPU weight
        sync.""", choices=("bf16", "fp32", "int8", "fp8"))
    weight_bits: int | None = None
    """int8 rollouts' weight grid, `auto` resolved for the cluster's CPU (WEIGHT_GRID); None for other precisions."""
    scales: str = flag("--vllm.int8_scales", "recompute", """Per-channel int8 weight scales at each sync: recomputed
        from the new weights (exact, never saturates) or frozen at their initial values (saturation counted in each
        step's rollout/int8_saturated_fraction).""", choices=("recompute", "frozen"))
    activations: str = flag("--vllm.int8_activations", "dynamic", """INT8 activation quantization: per token at run
        time (dynamic), or one static per-tensor scale per projection calibrated once on prompts (static; needs
        --vllm.int8_calibration made with --static_activations) and passed unchanged to the engines at every weight
        sync; projections the calibration kept dynamic (--min_levels) stay per token.""",
                            choices=("dynamic", "static"))
    calibration: str | None = flag("--vllm.int8_calibration", None, """SmoothQuant smoothing factors (and, with
        --static_activations, static int8 activation scales) calibrated once on prompts (python -m
        openrlhf_tis.rollout.calibration); applied to the initial checkpoint and to every sync. Refused when made
        for another model.""")
    fp32_head: bool = flag("--vllm.fp32_lm_head", False, """Run the engines' lm_head projection in fp32 (vLLM's
        head_dtype override) to shrink the mismatch.""", switch=True)
    fp8_block: tuple[int, int] | None = None
    """CUDA FP8 rollouts' block (a checkpoint the fork writes and re-quantizes at every sync); None elsewhere."""
    routing_replay: str = flag(REPLAY_FLAG, "off", f"""Mixture-of-experts routing replay: r3 makes the trainer's MoE
        layers use the experts the engine chose for each token (R3; covered: {', '.join(COVERED_MODEL_TYPES)}) in the
        pi_old and pi_theta forwards, the gating weights still the trainer's router's, and logs moe/* (engine-vs-
        trainer routing agreement). On CUDA the engines return the experts themselves (vLLM 0.29.0's
        enable_return_routed_experts). r2 records the trainer's own routing in its pi_old forward and replays it in
        the pi_theta forwards (verl's R2; no engine involved), logging moe/* as pi_old-vs-pi_theta agreement. measure
        replays nothing: the engines return their routing as for r3 and moe/* compares it with the trainer's own, the
        routing mismatch of a run without replay (and the k3 of the tokens routed differently). Refused with the
        reason before Ray starts for a dense or uncovered model or ring attention; r3 and measure also without engines,
        for an engine that cannot return them, async training or an agent; r2 also with a bypass loss, which runs no
        pi_old forward (docs/moe.md).""",
                               choices=REPLAY_MODES)

    @property
    def writes_model(self) -> bool:
        """Whether the engines start from a rollout model the driver writes (upstream's bf16 engines do not)."""
        return self.precision != "bf16" or self.fp32_head


@dataclass(frozen=True)
class SyncPlan:
    """When weights go to the engines and which syncs are checked (trainer/sync_cadence.py, trainer/sync_check.py)."""

    every: int = flag("--vllm.sync_every", 1, """Send the trainer's weights to the engines after every Kth step only
        (synchronous runs): the samples of step s+1 are then s mod K policy versions behind pi_old, a staleness dose
        set by a flag instead of by async timing (openrlhf_tis.trainer.sync_cadence). 1: after every step, as
        upstream.""", check=lambda k: None if k >= 1 else f"must be >= 1 (1 syncs after every step), got {k}")
    check_steps: int = flag("--vllm.sync_check_steps", 1, """Verify every Nth DeepSpeed->vLLM weight sync by scoring
        a probe text on both sides (openrlhf_tis.trainer.sync_check); 0 disables. Costs one short prefill per
        engine.""", check=lambda n: None if n >= 0 else "must be >= 0 (0 disables the check)")
    check_tolerance: float = flag("--vllm.sync_check_tolerance", 0.5, """Stop the run when the engines and the
        trainer disagree on the probe after a sync by more than this mean |dlogp| beyond their gap before the first
        step, when both held the same weights (that baseline is what the rollout precision costs: ~0.01-0.05 for
        bf16, ~2 for W4A8).""", check=lambda x: None if x > 0 else "must be > 0")


@dataclass(frozen=True)
class DumpPlan:
    """Per-token dumps (runs/tokens.py): step 1 and every `steps`-th (0: never), `samples` responses each (-1: all)."""

    steps: int = flag("--logger.token_dump_steps", 10,
                      "Dump per-token data (tokens/step_*.parquet) at step 1 and every N steps; 0 disables.")
    """10: enough points for a mismatch trend, at ~1/10 of the per-step cost of dumping every step."""
    samples: int = flag("--logger.token_dump_samples", 8,
                        "Samples (whole responses) per dumped step; -1 dumps every sample.")
    """8: a few thousand tokens per dumped step, enough for probability-bucket statistics."""


@dataclass(frozen=True)
class RewardPlan:
    """What the run does with its reward function's calls and answers (rollout/reward_calls.py, trainer/rewards.py)."""

    timeout_s: float | None = flag("--reward.timeout_s", 60.0, """Seconds one call of a --reward.remote_url script's
        reward_func, or one request to a reward server (HTTP, upstream's retries included), may take, in the try-out
        on the first prompt before Ray starts and for each sample during training; past it the start is refused, or
        the run stops, naming the script or server, the prompt and the limit. Must be > 0 and at most a week.""")
    """Seconds one reward call may take in the engines; None sends them no limit."""
    nonfinite: str = flag("--reward.nonfinite", "fail", """A NaN/inf reward from --reward.remote_url: fail the step
        naming the samples and the reward script (default), or drop the prompt groups holding one and train on the
        rest (counted in reward/dropped_samples).""", choices=("fail", "drop"))


@dataclass(frozen=True)
class StalenessPlan:
    """How old an async run's samples may be (trainer/staleness.py)."""

    max_lag: int | None = flag("--train.async_max_lag", None, """Async training only: drop every prompt group
        holding a sample whose rollout policy is more than N steps older than the policy it trains (counted in
        staleness/dropped_samples); default no bound. Lags are logged in any mode (staleness/*; 0 in synchronous
        runs).""", type=int)
    """Policy versions a sample may lag behind the policy it trains; None: no bound."""


@dataclass(frozen=True)
class RunSpec:
    """A run as the driver resolved it (module docstring)."""

    cluster: ClusterPlan
    correction: CorrectionConfig
    rollout: RolloutPlan = field(default_factory=RolloutPlan)
    sync: SyncPlan = field(default_factory=SyncPlan)
    dumps: DumpPlan = field(default_factory=DumpPlan)
    reward: RewardPlan = field(default_factory=RewardPlan)
    staleness: StalenessPlan = field(default_factory=StalenessPlan)
    run_dir: str | None = None
    """The run directory, absolute (the flag's, or ./runs/<UTC timestamp> when it names none), so every Ray process
    writes to the same place; None in a spec that no command line resolved (tests)."""


def spec_flags() -> dict[str, Flag]:
    """Every flag the run spec holds as given, by flag name, in the spec's plan and field order."""
    plans = [kind for kind in typing.get_type_hints(RunSpec).values() if dataclasses.is_dataclass(kind)]
    return {declared.name: declared for plan in plans for declared in plan_flags(plan).values()}


def run_spec(args: Any) -> RunSpec:
    """The spec in `args`: upstream's flat namespace (`fork.spec`) or the hierarchized one its actors receive.

    Raises RuntimeError for arguments that never went through the fork's CLI (upstream's own `train_ppo_ray`), where
    the fork's classes would otherwise guess what the run is from its flags."""
    spec = getattr(args, SPEC_DEST, None)
    if spec is None:
        spec = getattr(getattr(args, "fork", None), "spec", None)
    if not isinstance(spec, RunSpec):
        raise RuntimeError("no run spec in the arguments: the fork's classes run under `python -m "
                           "openrlhf_tis.cli.train_ppo_ray`, which resolves the run once (openrlhf_tis/cli/resolve.py)")
    return spec
