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

from dataclasses import dataclass, field
from typing import Any

from openrlhf_tis.correction.config import CorrectionConfig
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


@dataclass(frozen=True)
class RolloutPlan:
    """The rollout engines' precision with every `auto` decided (rollout/precision.py, docs/rollout_precision.md)."""

    precision: str = "bf16"
    weight_bits: int | None = None
    """int8 rollouts' weight grid, `auto` resolved for the cluster's CPU; None for other precisions."""
    scales: str = "recompute"
    activations: str = "dynamic"
    calibration: str | None = None
    fp32_head: bool = False
    fp8_block: tuple[int, int] | None = None
    """CUDA FP8 rollouts' block (a checkpoint the fork writes and re-quantizes at every sync); None elsewhere."""
    routing_replay: str = "off"
    """`--vllm.routing_replay`: r3 replays the engines' routed experts in the trainer's forwards (docs/moe.md)."""

    @property
    def writes_model(self) -> bool:
        """Whether the engines start from a rollout model the driver writes (upstream's bf16 engines do not)."""
        return self.precision != "bf16" or self.fp32_head


@dataclass(frozen=True)
class SyncPlan:
    """When weights go to the engines and which syncs are checked (trainer/sync_cadence.py, trainer/sync_check.py)."""

    every: int = 1
    check_steps: int = 1
    check_tolerance: float = 0.5


@dataclass(frozen=True)
class DumpPlan:
    """Per-token dumps (runs/tokens.py): step 1 and every `steps`-th (0: never), `samples` responses each (-1: all)."""

    steps: int = 0
    samples: int = 0


@dataclass(frozen=True)
class RewardPlan:
    """What the run does with its reward function's calls and answers (rollout/reward_calls.py, trainer/rewards.py)."""

    timeout_s: float | None = None
    """Seconds one reward call may take in the engines; None sends them no limit."""
    nonfinite: str = "fail"
    """A NaN/inf reward: fail the step, or drop its prompt groups."""


@dataclass(frozen=True)
class StalenessPlan:
    """How old an async run's samples may be (trainer/staleness.py)."""

    max_lag: int | None = None
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
