"""Flags the fork adds to upstream's train_ppo_ray, in upstream's dotted style."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any

from openrlhf_tis.cli.cluster_device import DEVICE_FLAG, DEVICES
from openrlhf_tis.cli.stall import DEFAULT_STALL_TIMEOUT_S
from openrlhf_tis.cli.stall import FLAG as STALL_FLAG
from openrlhf_tis.correction.config import FLAG_PREFIX
from openrlhf_tis.moe.coverage import COVERED_MODEL_TYPES, REPLAY_FLAG, REPLAY_MODES
from openrlhf_tis.params import Check, param
from openrlhf_tis.rollout.precision import (
    ACTIVATIONS_FLAG,
    CALIBRATION_FLAG,
    DEFAULTS,
    FP32_HEAD_FLAG,
    PRECISION_FLAG,
    PRECISIONS,
    SCALES_FLAG,
    WEIGHT_BITS_FLAG,
)
from openrlhf_tis.rollout.quantize import ACTIVATION_MODES, SCALE_MODES, WEIGHT_BITS_CHOICES
from openrlhf_tis.rollout.reward_calls import DEFAULT_TIMEOUT_S, TIMEOUT_FLAG
from openrlhf_tis.runs.tokens import DEFAULT_DUMP_EVERY, DEFAULT_DUMP_SAMPLES
from openrlhf_tis.trainer.sync_cadence import SYNC_EVERY_FLAG
from openrlhf_tis.trainer.untrained_scores import FLAG as UNTRAINED_CACHE_FLAG
from openrlhf_tis.upstream_guards import PatchTargetMissingError, require_version


def allow_fp32_training(parser: argparse.ArgumentParser) -> None:
    """Add fp32 to upstream's `--ds.param_dtype` choices (bf16, fp16): CPUs without native bf16 emulate it,
    and a bf16 backward there is 5-25x slower than fp32 (patches/fp32_training.py). Idempotent; an upstream parser
    without that flag or its choices is refused, naming this file (patches/README.md)."""
    where = "openrlhf_tis/cli/fork_flags.py"
    require_version("openrlhf", "==0.11.2", patch=where)
    action = next((a for a in parser._actions if a.dest == "ds.param_dtype"), None)
    if action is None or not action.choices:
        raise PatchTargetMissingError(f"patch {where!r}: openrlhf.cli.train_ppo_ray no longer has --ds.param_dtype "
                                      "with choices; review the patch")
    if "fp32" in action.choices:
        return
    action.choices = [*action.choices, "fp32"]
    action.help = f"{action.help} (the fork adds fp32: on CPUs without native bf16 it trains several times faster)"


@dataclasses.dataclass(frozen=True)
class ForkFlag:
    """One plain flag of the fork: a switch when `switch`, else a value of `type` (one of `choices` if given).

    The one declaration of the flag: the CLI's argument (`add_to`) and a notebook parameter that becomes it (`param`)
    both take their type and choices from here."""

    name: str
    help: str
    default: object = None
    type: type = str
    choices: tuple[str, ...] | None = None
    switch: bool = False

    def add_to(self, parser: argparse.ArgumentParser) -> None:
        if self.switch:
            parser.add_argument(self.name, action="store_true", default=bool(self.default), help=self.help)
        else:
            parser.add_argument(self.name, type=self.type, default=self.default, help=self.help,
                                choices=None if self.choices is None else list(self.choices))

    def param(self, help: str, default: Any = None, check: Check | None = None) -> Any:
        """A notebook parameter (params.param) that becomes this flag, of the flag's type and choices, so a notebook
        or sweep value is refused as the CLI refuses it (params.Param.problem), before a command line is built.
        `default`: the notebook's (None: the flag's); `check`: what the CLI checks later, said earlier."""
        return param(self.default if default is None else default, help, (bool,) if self.switch else (self.type,),
                     self.choices, check=check, flag=self.name)


FORK_FLAGS: tuple[ForkFlag, ...] = (
    ForkFlag(DEVICE_FLAG, default="auto", choices=tuple(DEVICES), help=(
        "What the run computes on, decided by its cluster, never by the driver: auto reads the Ray cluster "
        "RAY_ADDRESS names (any GPU there: cuda), else this machine's CUDA devices. cpu or cuda must agree with the "
        "cluster (cpu on a cluster declaring logical GPU slots for CPU processes is fine). On cpu, upstream's GPU "
        "defaults are replaced and GPU-only flags refused; on cuda, CPU-only choices are refused.")),
    ForkFlag("--vllm.sync_check_steps", type=int, default=1, help=(
        "Verify every Nth DeepSpeed->vLLM weight sync by scoring a probe text on both sides "
        "(openrlhf_tis.trainer.sync_check); 0 disables. Costs one short prefill per engine.")),
    ForkFlag(SYNC_EVERY_FLAG, type=int, default=1, help=(
        "Send the trainer's weights to the engines after every Kth step only (synchronous runs): the samples of "
        "step s+1 are then s mod K policy versions behind pi_old, a staleness dose set by a flag instead of by "
        "async timing (openrlhf_tis.trainer.sync_cadence). 1: after every step, as upstream.")),
    ForkFlag("--vllm.sync_check_tolerance", type=float, default=0.5, help=(
        "Stop the run when the engines and the trainer disagree on the probe after a sync by more than this "
        "mean |dlogp| beyond their gap before the first step, when both held the same weights (that baseline is "
        "what the rollout precision costs: ~0.01-0.05 for bf16, ~2 for W4A8).")),
    ForkFlag("--logger.run_dir", help="Run directory of the run store (metrics.jsonl, ...). Default: "
             "./runs/<UTC timestamp>."),
    ForkFlag("--logger.run_dir_override", switch=True, help=(
        "Continue in a run directory whose stored configuration differs (the change is recorded in config.json).")),
    ForkFlag("--logger.run_dir_overwrite", switch=True, help=(
        "Start over in a run directory that already holds steps: its metrics, token dumps and config are "
        "erased first. Without it such a directory is refused unless --ckpt.load_enable resumes it.")),
    ForkFlag("--reward.nonfinite", default="fail", choices=("fail", "drop"), help=(
        "A NaN/inf reward from --reward.remote_url: fail the step naming the samples and the reward script "
        "(default), or drop the prompt groups holding one and train on the rest (counted in reward/dropped_samples).")),
    ForkFlag(TIMEOUT_FLAG, type=float, default=DEFAULT_TIMEOUT_S, help=(
        "Seconds one call of a --reward.remote_url script's reward_func, or one request to a reward server (HTTP, "
        "upstream's retries included), may take, in the try-out on the first prompt before Ray starts and for each "
        "sample during training; past it the start is refused, or the run stops, naming the script or server, the "
        "prompt and the limit. Must be > 0 and at most a week.")),
    ForkFlag("--train.async_max_lag", type=int, help=(
        "Async training only: drop every prompt group holding a sample whose rollout policy is more than N "
        "steps older than the policy it trains (counted in staleness/dropped_samples); default no bound. "
        "Lags are logged in any mode (staleness/*; 0 in synchronous runs).")),
    ForkFlag(STALL_FLAG, type=float, default=DEFAULT_STALL_TIMEOUT_S, help=(
        "Stop the run, naming the stage (generate samples, make experience, train, sync weights, evaluate, save or "
        "load checkpoint) and the Ray actors it waited on, when the training loop makes no progress for this many "
        "seconds: an actor that hangs without dying (SIGSTOP, a deadlock). Progress is a change of stage or, while "
        "generating or evaluating, a finished response; start-up is not bounded. Exit code 4. 0 disables.")),
    ForkFlag(UNTRAINED_CACHE_FLAG, help=(
        "A folder where the untrained policy's held-out scores (eval_start/*, scored before step 1) are kept and "
        "shared: a run whose key (everything the scores depend on: model and data files' content, engine and "
        "sampling flags, seed, code revision, packages, CPU) finds them there writes them instead of evaluating, "
        "unless a held-out question is also a training prompt (openrlhf_tis.trainer.untrained_scores). A sweep "
        "sets it to OUT/untrained for its cells. Default: every run evaluates.")),
    ForkFlag("--logger.token_dump_steps", type=int, default=DEFAULT_DUMP_EVERY, help=(
        "Dump per-token data (tokens/step_*.parquet) at step 1 and every N steps; 0 disables.")),
    ForkFlag("--logger.token_dump_samples", type=int, default=DEFAULT_DUMP_SAMPLES, help=(
        "Samples (whole responses) per dumped step; -1 dumps every sample.")),
    # Rollout precision (openrlhf_tis.rollout, docs/rollout_precision.md; docs/design.md §4).
    ForkFlag(PRECISION_FLAG, default=DEFAULTS[PRECISION_FLAG], choices=tuple(PRECISIONS), help=(
        "Precision of the vLLM rollout engines. int8: W8A8 compressed-tensors (per-channel int8 weights, "
        "dynamic per-token or static calibrated int8 activations; embeddings and lm_head unquantized), written "
        "under the run dir before the engines start and re-quantized at every weight sync (FlashRL-style "
        "calibration transfer). fp32: float32 engine (bf16 trainer weights upcast at each sync); fp8: online FP8 "
        "(fp8_per_channel on CPU). Non-bf16 precisions are wired for the CPU weight sync.")),
    ForkFlag(SCALES_FLAG, default=DEFAULTS[SCALES_FLAG], choices=tuple(SCALE_MODES), help=(
        "Per-channel int8 weight scales at each sync: recomputed from the new weights (exact, never "
        "saturates) or frozen at their initial values (saturation counted in each step's "
        "rollout/int8_saturated_fraction).")),
    ForkFlag(CALIBRATION_FLAG, default=DEFAULTS[CALIBRATION_FLAG], help=(
        "SmoothQuant smoothing factors (and, with --static_activations, static int8 activation scales) calibrated "
        "once on prompts (python -m openrlhf_tis.rollout.calibration); applied to the initial checkpoint and to every "
        "sync. Refused when made for another model.")),
    ForkFlag(ACTIVATIONS_FLAG, default=DEFAULTS[ACTIVATIONS_FLAG], choices=tuple(ACTIVATION_MODES), help=(
        "INT8 activation quantization: per token at run time (dynamic), or one static per-tensor scale per "
        "projection calibrated once on prompts (static; needs --vllm.int8_calibration made with "
        "--static_activations) and passed unchanged to the engines at every weight sync; projections the "
        "calibration kept dynamic (--min_levels) stay per token.")),
    ForkFlag(WEIGHT_BITS_FLAG, default=DEFAULTS[WEIGHT_BITS_FLAG], choices=tuple(WEIGHT_BITS_CHOICES), help=(
        "Grid of the int8 weights: 8 bits, or 7 (values in [-64, 63], int8 storage) for x86 CPUs without "
        "VNNI, where vLLM-CPU's oneDNN int8 GEMM saturates 16-bit pair sums of full-range weights (measured: 15%% "
        "max error per GEMM; 8 is refused there). auto picks 7 exactly there. 6, 5, 4: coarser grids on the same "
        "kernel (W6A8..W4A8), a stronger rollout mismatch for dose-response studies.")),
    ForkFlag(FP32_HEAD_FLAG, switch=True, default=DEFAULTS[FP32_HEAD_FLAG], help=(
        "Run the engines' lm_head projection in fp32 (vLLM's head_dtype override) to shrink the mismatch.")),
    ForkFlag(REPLAY_FLAG, default="off", choices=REPLAY_MODES, help=(
        "Mixture-of-experts routing replay: r3 makes the trainer's MoE layers use the experts the engine chose for "
        f"each token (R3; covered: {', '.join(COVERED_MODEL_TYPES)}). The trainer side is built "
        "(openrlhf_tis/moe); r3 is not yet wired to the engines and is refused, with the reason, before Ray "
        "starts (docs/moe.md).")),
)


FLAGS: dict[str, ForkFlag] = {flag.name: flag for flag in FORK_FLAGS}


def add_fork_arguments(parser: argparse.ArgumentParser) -> None:
    """Every flag the fork adds: fp32 training, the plain flags of FORK_FLAGS, the correction's generated flags."""
    allow_fp32_training(parser)
    for flag in FORK_FLAGS:
        flag.add_to(parser)
    add_correction_arguments(parser)


def add_correction_arguments(parser: argparse.ArgumentParser) -> None:
    """`--algo.correction.*`: the rollout correction (openrlhf_tis.correction, docs/correction.md).

    `preset`, then one flag per CorrectionConfig field, generated from the field: its annotation gives the
    type (bool: a switch; the rejection tuple: one or more STAT:AGG:... strings), its metadata the choices
    and the help. Every flag defaults to None, meaning "as the preset says"; cli/resolve.py
    `resolve_correction` resolves preset + overrides (or upstream's --algo.advantage.is_correction_* flags)
    into the run spec's CorrectionConfig.
    """
    from openrlhf_tis.correction.config import PRESETS, CorrectionConfig

    parser.add_argument(
        FLAG_PREFIX + "preset", type=str, default=None, choices=sorted(PRESETS),
        help="Named correction recipe (docs/correction.md); other --algo.correction.* flags override its fields. "
        "Default: upstream's --algo.advantage.is_correction_* mapping, else 'off' (metrics only).")
    for f in dataclasses.fields(CorrectionConfig):
        parser.add_argument(FLAG_PREFIX + f.name, default=None, help=f.metadata["help"], **_flag_kind(f))


def _flag_kind(f: dataclasses.Field) -> dict:
    """argparse arguments for a CorrectionConfig field, from its resolved type (`typing.get_type_hints`, never the
    annotation's text): bool a switch, a tuple one or more strings, int or float (optional or not) a number, str one
    of its declared choices."""
    from openrlhf_tis.correction.config import CorrectionConfig

    kind = typing.get_type_hints(CorrectionConfig)[f.name]
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    base = args[0] if typing.get_origin(kind) in (types.UnionType, typing.Union) and len(args) == 1 else kind
    if base is bool:
        return {"action": "store_true"}
    if typing.get_origin(base) is tuple:
        return {"type": str, "nargs": "+"}
    if base in (int, float):
        return {"type": base}
    if base is str:
        return {"type": str, "choices": f.metadata["choices"]}
    raise TypeError(f"CorrectionConfig.{f.name}: no command-line flag for a field of type {kind}")


def correction_option_problem(name: str, value: Any) -> str | None:
    """Why `value` cannot be `--algo.correction.<name>` (a notebook's correction_options entry), in the CLI's terms;
    None when it can. Judged by the same declaration the flag is generated from (`_flag_kind`)."""
    from openrlhf_tis.correction.config import CorrectionConfig

    fields = {f.name: f for f in dataclasses.fields(CorrectionConfig)}
    if name not in fields:
        return f"{name!r} is not a CorrectionConfig field; known: {', '.join(fields)}"
    kind, flag = _flag_kind(fields[name]), FLAG_PREFIX + name
    if kind.get("action") == "store_true":
        return None if isinstance(value, bool) else f"{flag} is a switch: give True or False, got {value!r}"
    if kind.get("nargs") == "+":
        ok = isinstance(value, (list, tuple)) and value and all(isinstance(v, str) for v in value)
        return None if ok else f"{flag} takes one or more strings (a list), got {value!r}"
    number = kind["type"] in (int, float) and not isinstance(value, bool)
    if number and (isinstance(value, kind["type"]) or kind["type"] is float and isinstance(value, int)):
        return None
    if kind["type"] is str and isinstance(value, str):
        choices = kind["choices"]
        return None if choices is None or value in choices else \
            f"{flag}: invalid choice: {value!r} (choose from {', '.join(map(repr, choices))})"
    return f"{flag} takes a {kind['type'].__name__}, got {value!r}"
