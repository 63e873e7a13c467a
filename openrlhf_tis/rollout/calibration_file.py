"""The calibration file: the one safetensors file a run takes as `--vllm.int8_calibration`.

Written once by `openrlhf_tis.rollout.calibration` (SmoothQuant factors and, optionally, static
activation scales), read by the checks before any engine starts and by the rollout model directory
(`checkpoint.write_rollout_model`, `checkpoint.load_int8_plan`). The file carries the model's
fingerprint and a list of what it contains, so a file from another model, or one without the tensors
a run asks for, is refused before any engine starts.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from openrlhf_tis.rollout.quantize import (
    PROJECTIONS,
    SMOOTH_GROUPS,
    fingerprint_mismatch,
    fused_group,
    input_scale_name,
    is_quantized_weight,
    model_fingerprint,
)
from openrlhf_tis.runs.layout import file_mode

META_KEY = "openrlhf_tis_calibration"
SMOOTHING = "smoothing"
INPUT_SCALES = "input_scales"
BLOCK_OF = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
            "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
_NORM_NAME = re.compile(r"^.*\.layers\.(\d+)\.(" + "|".join(SMOOTH_GROUPS) + r")\.weight$")
_SCALE_NAME = re.compile(r"^.*\.layers\.(\d+)\.(self_attn|mlp)\.(" + "|".join(PROJECTIONS) + r")\.input_scale$")


class CalibrationMismatchError(ValueError):
    """The calibration file was made for a different model, or lacks what the run needs."""


@dataclass
class Calibration:
    """What a run calibrates once and transfers to every sync.

    `input_scales` covers the static projections only; `dynamic_projections` names the ones kept on
    per-token activations (so a missing scale is a declared choice, never a gap), `median_levels` is
    the evidence for that choice (see `calibration.median_token_levels`).
    """

    smoothing: dict[str, torch.Tensor]
    input_scales: dict[str, torch.Tensor] = field(default_factory=dict)
    dynamic_projections: list[str] = field(default_factory=list)
    median_levels: dict[str, float] = field(default_factory=dict)


def save_calibration(path: str | Path, cal: Calibration, model_config: dict, alpha: float, n_prompts: int) -> Path:
    """Write the calibration tensors with the model's fingerprint, a contents list and the fallback."""
    from safetensors.torch import save_file

    contents = [SMOOTHING] + ([INPUT_SCALES] if cal.input_scales or cal.dynamic_projections else [])
    meta = {"fingerprint": model_fingerprint(model_config), "alpha": alpha, "n_prompts": n_prompts,
            "kind": "smoothquant", "contents": contents}
    if INPUT_SCALES in contents:
        meta["input_scale"] = "max|x / s| / 127 over the calibration tokens (symmetric, per tensor)"
        meta["dynamic_projections"] = list(cal.dynamic_projections)
        meta["median_levels"] = {k: round(v, 3) for k, v in cal.median_levels.items()}
    path = Path(path)
    tensors = {k: v.contiguous().float() for k, v in {**cal.smoothing, **cal.input_scales}.items()}
    save_file(tensors, str(path), metadata={META_KEY: json.dumps(meta)})
    os.chmod(path, file_mode())  # safetensors writes through a 0600 temp file
    return path


def split_calibration(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(smoothing factors keyed by norm weight, static input scales keyed by input_scale name)."""
    scales = {k: v for k, v in tensors.items() if k.endswith(".input_scale")}
    return {k: v for k, v in tensors.items() if k not in scales}, scales


def has_input_scales(meta: dict) -> bool:
    """Whether a calibration file's metadata says it carries static activation scales."""
    return INPUT_SCALES in meta.get("contents", [SMOOTHING])


def dynamic_projections(meta: dict) -> list[str]:
    """Projection modules a static-activation calibration keeps on dynamic per-token activations."""
    return list(meta.get("dynamic_projections", []))


def _check_tensors(path, tensors: dict[str, torch.Tensor], model_config: dict,
                   weight_names: Iterable[str] | None, dynamic: list[str]) -> None:
    hidden, layers = model_config.get("hidden_size"), model_config.get("num_hidden_layers")
    smoothing, scales = split_calibration(tensors)
    for k, v in smoothing.items():
        m = _NORM_NAME.match(k)
        if m is None or (layers is not None and int(m.group(1)) >= layers):
            raise CalibrationMismatchError(f"{path}: tensor {k} is not a smoothable norm of this model")
        if v.shape != (hidden,):
            raise CalibrationMismatchError(
                f"{path}: factor {k} has shape {tuple(v.shape)}, model hidden size is {hidden}")
    for k, v in scales.items():
        m = _SCALE_NAME.match(k)
        if m is None or BLOCK_OF[m.group(3)] != m.group(2) or (layers is not None and int(m.group(1)) >= layers):
            raise CalibrationMismatchError(f"{path}: tensor {k} is not a projection input scale of this model")
        if v.shape != (1,) or not bool(torch.isfinite(v).all()) or not bool((v > 0).all()):
            raise CalibrationMismatchError(f"{path}: input scale {k} must be one finite positive value, got {v}")
    for name in dynamic:  # a fused Linear has one activation scheme: its members fall back together
        layer, block, proj = name.rsplit(".", 2)
        group = fused_group(proj)
        if any(f"{layer}.{block}.{member}" not in dynamic for member in group):
            raise CalibrationMismatchError(f"{path}: dynamic projection {name} without the rest of {'/'.join(group)}")
        if input_scale_name(name + ".weight") in scales:
            raise CalibrationMismatchError(f"{path}: {name} is listed as dynamic but has an input scale")
    if weight_names is not None:
        names = set(weight_names)
        if unknown := sorted(set(smoothing) - names):
            raise CalibrationMismatchError(
                f"{path}: {len(unknown)} factors name no weight of the model, e.g. {unknown[0]}")
        if scales or dynamic:
            projections = {w[: -len(".weight")] for w in names if is_quantized_weight(w)}
            if stray := sorted(set(dynamic) - projections):
                raise CalibrationMismatchError(f"{path}: dynamic projection {stray[0]} is no quantized projection")
            expected = {input_scale_name(p + ".weight") for p in projections - set(dynamic)}
            if missing := sorted(expected - set(scales)):
                raise CalibrationMismatchError(
                    f"{path}: no input scale for {len(missing)} quantized projections, e.g. {missing[0]}")
            if extra := sorted(set(scales) - expected):
                raise CalibrationMismatchError(f"{path}: input scale {extra[0]} names no quantized projection")
    for k in scales:  # one scale per fused Linear: vLLM would silently keep the last shard's
        layer, block, proj = k[: -len(".input_scale")].rsplit(".", 2)
        first = f"{layer}.{block}.{fused_group(proj)[0]}.input_scale"
        if first in scales and not torch.equal(scales[first], scales[k]):
            raise CalibrationMismatchError(
                f"{path}: {k} differs from {first}; vLLM fuses them into one Linear with one input scale")


def load_calibration(path: str | Path, model_config: dict,
                     weight_names: Iterable[str] | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """All calibration tensors and the metadata; CalibrationMismatchError when they do not fit the model.

    With `weight_names` (the model checkpoint's tensor names) static input scales must cover exactly
    the quantized projections not declared dynamic.
    """
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        raw = (f.metadata() or {}).get(META_KEY)
        if raw is None:
            raise CalibrationMismatchError(f"{path} is not an openrlhf_tis calibration file (no {META_KEY} metadata)")
        meta = json.loads(raw)
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    diff = fingerprint_mismatch(model_fingerprint(model_config), meta.get("fingerprint", {}))
    if diff:
        raise CalibrationMismatchError(f"{path} was calibrated for another model ({'; '.join(diff)})")
    if not meta.get("n_prompts"):
        raise CalibrationMismatchError(f"{path} was calibrated on no prompts; calibrate on a non-empty prompt file")
    has_scales = any(k.endswith(".input_scale") for k in tensors) or bool(dynamic_projections(meta))
    if has_scales != has_input_scales(meta):
        raise CalibrationMismatchError(f"{path}: metadata contents {meta.get('contents')} do not match its tensors")
    _check_tensors(path, tensors, model_config, weight_names, dynamic_projections(meta))
    return tensors, meta
