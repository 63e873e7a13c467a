"""The rollout model directory: what a vLLM engine starts from, stored with the run.

OpenRLHF's `create_vllm_engines` hard-codes the engine kwargs (dtype bf16, no quantization), but vLLM
reads `quantization_config` and `head_dtype` from the model's config.json. So the fork writes, before
any engine starts, a directory that *is* the rollout variant of the actor's model:

  config.json                 + quantization_config (int8, block fp8) and/or head_dtype float32 (fp32 head)
  model.safetensors           int8 W8A8 weights (int8), e4m3 weights with 128x128 block scales (block fp8), or
                              links to the source weights (bf16, fp32, online fp8)
  tokenizer files             copied
  openrlhf_tis_rollout.json   the plan: precision, scale mode, activation mode, source model, fingerprint
  calibration/calibration.safetensors
                              the transferred calibration (when given): smoothing factors and, for
                              static activations, the per-projection input scales. In a subdirectory
                              because vLLM loads every top-level *.safetensors as weights: a
                              top-level copy silently replaced the smoothed norm weights by the
                              factors in the initial engine (measured: tiny model, |dlogp| 0.002 -> 0.2)

The engine worker finds the plan through its own model path, so a sync needs no extra plumbing.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from pathlib import Path

import torch

from openrlhf_tis.rollout.calibration_file import (
    dynamic_projections,
    has_input_scales,
    load_calibration,
    split_calibration,
)
from openrlhf_tis.rollout.fp8_blocks import block_fp8_config, quantize_named_fp8, unblockable_summary
from openrlhf_tis.rollout.quantize import (
    ACTIVATION_MODES,
    Int8Plan,
    QuantStats,
    compressed_tensors_config,
    int8_weight_bits,
    is_quantized_weight,
    model_fingerprint,
    quantize_named_weights,
    scale_name,
)

PLAN_FILE = "openrlhf_tis_rollout.json"
SMOOTHING_FILE = "calibration/calibration.safetensors"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


class NotQuantizableError(ValueError):
    """The model has no layer the W8A8 format can quantize."""


def read_config(model_dir: str | Path) -> dict:
    with open(Path(model_dir) / "config.json", encoding="utf-8") as f:
        return json.load(f)


def _weight_files(model_dir: Path) -> list[Path]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir} has no *.safetensors weights (INT8 rollouts need safetensors)")
    return files


def load_state_dict(model_dir: str | Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    sd: dict[str, torch.Tensor] = {}
    for f in _weight_files(Path(model_dir)):
        sd.update(load_file(str(f)))
    return sd


def weight_names(model_dir: str | Path) -> list[str]:
    """Tensor names of a safetensors checkpoint (headers only, no tensor is read)."""
    from safetensors import safe_open

    names = []
    for f in _weight_files(Path(model_dir)):
        with safe_open(str(f), framework="pt") as h:
            names.extend(h.keys())
    return names


def projection_shapes(model_dir: str | Path) -> dict[str, tuple[int, int]]:
    """[out, in] of every decoder projection weight of a safetensors checkpoint (headers only)."""
    from safetensors import safe_open

    shapes = {}
    for f in _weight_files(Path(model_dir)):
        with safe_open(str(f), framework="pt") as h:
            shapes.update({k: tuple(h.get_slice(k).get_shape()) for k in h.keys() if is_quantized_weight(k)})
    return shapes


def largest_tensor_numel(model_dir: str | Path) -> int:
    """The element count of the largest tensor of a safetensors checkpoint (headers only)."""
    from safetensors import safe_open

    largest = 0
    for f in _weight_files(Path(model_dir)):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                largest = max(largest, math.prod(h.get_slice(k).get_shape()))
    return largest


def check_quantizable(model_dir: str | Path) -> int:
    """Number of quantizable projection weights; NotQuantizableError when there are none."""
    n = sum(is_quantized_weight(k) for k in weight_names(model_dir))
    if n == 0:
        raise NotQuantizableError(
            f"{model_dir}: no decoder projection weights (*.layers.N.{{self_attn,mlp}}.*_proj.weight) to quantize; "
            "INT8 W8A8 rollouts support Llama/Qwen/Mistral-style decoders"
        )
    return n


def write_rollout_model(src: str | Path, dst: str | Path, *, precision: str = "bf16", scale_mode: str = "recompute",
                        calibration: str | Path | None = None, fp32_head: bool = False,
                        engine_dtype: torch.dtype = torch.bfloat16, activations: str = "dynamic",
                        weight_bits: int | None = None, fp8_block: tuple[int, int] | None = None) -> Path:
    """Write the rollout model directory for `precision` (bf16, fp32, fp8 or int8); return its path.

    INT8 weights are quantized from the source cast to `engine_dtype` first: that is what the trainer
    sends at every sync (`--ds.param_dtype bf16`), so quantizing the initial trainer weights at a sync
    reproduces this checkpoint bit for bit. `activations="static"` takes the per-projection input
    scales from `calibration` (which must carry them) and writes vLLM's static per-tensor scheme.
    `weight_bits` None picks the grid this machine's int8 GEMM computes exactly (quantize.int8_weight_bits);
    it is stored in the plan, so every sync quantizes onto the same grid. `fp8_block` writes FP8 as a block-FP8
    checkpoint (rollout/fp8_blocks.py, quantized from the engine-dtype weights as every sync will be) instead of
    links that vLLM quantizes online; NotQuantizableError names the projections that are not whole blocks.
    """
    if activations not in ACTIVATION_MODES:
        raise ValueError(f"activations must be one of {ACTIVATION_MODES}, got {activations!r}")
    if activations != "dynamic" and precision != "int8":
        raise ValueError("static activation scales only apply to int8 rollouts")
    if activations == "static" and not calibration:
        raise ValueError("static activations need a calibration file with input scales")

    src, dst = Path(src), Path(dst)
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    config = read_config(src)
    for item in src.iterdir():
        if item.is_file() and not item.name.endswith(_WEIGHT_SUFFIXES) and item.name != "model.safetensors.index.json":
            shutil.copy2(item, dst / item.name)
    plan_meta = {"precision": precision, "scale_mode": scale_mode, "source_model": str(src.resolve()),
                 "fingerprint": model_fingerprint(config), "engine_dtype": str(engine_dtype).removeprefix("torch."),
                 "fp32_head": fp32_head, "smoothing": None}
    if precision == "int8":
        check_quantizable(src)
        if weight_bits is None:
            weight_bits = int8_weight_bits("auto", cuda=torch.cuda.is_available())
        plan_meta["weight_bits"] = weight_bits
        smoothing, input_scales, dynamic = {}, {}, []
        if calibration:
            tensors, cal_meta = load_calibration(calibration, config, weight_names(src))
            if activations == "static" and not has_input_scales(cal_meta):
                raise ValueError(f"{calibration} has no static activation scales (calibrate with --static_activations)")
            smoothing, input_scales = split_calibration(tensors)
            dynamic = dynamic_projections(cal_meta) if activations == "static" else []
            (dst / SMOOTHING_FILE).parent.mkdir()
            shutil.copy2(calibration, dst / SMOOTHING_FILE)
            plan_meta["smoothing"] = SMOOTHING_FILE
            plan_meta["calibration_meta"] = cal_meta
        plan_meta["activations"] = activations
        if activations == "static":  # the scale plan: where the engine finds the scales it re-sends every sync
            values = torch.cat(list(input_scales.values()) or [torch.zeros(0)])
            plan_meta["input_scales"] = {"file": SMOOTHING_FILE, "count": len(input_scales),
                                         "min": float(values.min()) if len(values) else None,
                                         "max": float(values.max()) if len(values) else None,
                                         "dynamic_projections": dynamic,
                                         "transferred": "unchanged at every sync"}
        plan = Int8Plan(scale_mode="recompute", smoothing=smoothing, activations=activations,
                        input_scales=input_scales if activations == "static" else {},
                        dynamic_projections=frozenset(dynamic), weight_bits=weight_bits)
        named = [(k, v.to(engine_dtype)) for k, v in load_state_dict(src).items()]
        out, stats = quantize_named_weights(named, plan, engine_dtype)
        _save_weights(dst, out)
        config["quantization_config"] = compressed_tensors_config(static_activations=activations == "static",
                                                                  dynamic_targets=dynamic)
        plan_meta["initial_quant"] = stats.as_dict()
    elif precision == "fp8" and fp8_block:
        if calibration:
            raise ValueError("a calibration file only applies to int8 rollouts")
        named = [(k, v.to(engine_dtype)) for k, v in load_state_dict(src).items()]
        shapes = {k: tuple(v.shape) for k, v in named if is_quantized_weight(k)}
        if problem := unblockable_summary(shapes, fp8_block):
            raise NotQuantizableError(f"{src}: block FP8 needs every projection in whole blocks; {problem}")
        out, stats = quantize_named_fp8(named, is_quantized_weight, engine_dtype, fp8_block)
        _save_weights(dst, out)
        config["quantization_config"] = block_fp8_config(fp8_block)
        plan_meta.update(fp8_block=list(fp8_block), initial_quant=stats, unquantized=unquantized_kinds(named))
    elif precision in ("bf16", "fp32", "fp8"):  # same weights; the engine reads its dtype from the plan
        if calibration:
            raise ValueError("a calibration file only applies to int8 rollouts")
        for f in src.iterdir():
            if f.name.endswith(_WEIGHT_SUFFIXES) or f.name == "model.safetensors.index.json":
                os.symlink(f.resolve(), dst / f.name)
    else:
        raise ValueError(f"write_rollout_model handles bf16, fp32, fp8 and int8, not {precision!r}")
    if fp32_head:
        config["head_dtype"] = "float32"  # vLLM ModelConfig.head_dtype: lm_head projection in fp32
    with open(dst / "config.json", "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    with open(dst / PLAN_FILE, "w", encoding="utf-8") as f:
        json.dump(plan_meta, f, indent=2)
    return dst


def unquantized_kinds(named: list[tuple[str, torch.Tensor]]) -> list[str]:
    """The tensors a quantized rollout model keeps in the engine dtype, one entry per kind (`model.layers.*.
    input_layernorm.weight`), and the lm_head when it is tied to the embeddings (it has no tensor of its own)."""
    kinds = dict.fromkeys(re.sub(r"\.layers\.\d+\.", ".layers.*.", n) for n, _ in named if not is_quantized_weight(n))
    if not any(k.startswith("lm_head.") for k in kinds):
        kinds["lm_head (tied to the embeddings)"] = None
    return list(kinds)


def _save_weights(dst: Path, named: list[tuple[str, torch.Tensor]]) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in named}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    if stray := sorted(p.name for p in dst.glob("*.safetensors") if p.name != "model.safetensors"):
        raise RuntimeError(f"{dst}: vLLM would load {stray} as weights too")


def read_plan(model_dir: str | Path) -> dict | None:
    """The rollout plan of a model directory, or None for a plain model."""
    path = Path(model_dir) / PLAN_FILE
    if not path.is_file():
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def load_int8_plan(model_dir: str | Path) -> Int8Plan:
    """Rebuild the transferred calibration of an INT8 rollout directory (engine side, once)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    model_dir = Path(model_dir)
    meta = read_plan(model_dir)
    if meta is None or meta["precision"] != "int8":
        raise ValueError(f"{model_dir} is not an INT8 rollout model directory")
    calibration = load_file(str(model_dir / meta["smoothing"])) if meta.get("smoothing") else {}
    smoothing, input_scales = split_calibration(calibration)
    activations = meta.get("activations", "dynamic")
    dynamic = meta.get("input_scales", {}).get("dynamic_projections", []) if activations == "static" else []
    frozen = {}
    if meta["scale_mode"] == "frozen":
        with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
            frozen = {k: f.get_tensor(k) for k in f.keys() if k.endswith(".weight_scale")}
    return Int8Plan(scale_mode=meta["scale_mode"], smoothing=smoothing, frozen_scales=frozen, activations=activations,
                    input_scales=input_scales if activations == "static" else {},
                    dynamic_projections=frozenset(dynamic), weight_bits=meta.get("weight_bits", 8))


__all__ = ["NotQuantizableError", "QuantStats", "check_quantizable", "load_int8_plan", "read_plan", "scale_name",
           "weight_names", "write_rollout_model"]
