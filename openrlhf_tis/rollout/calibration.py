"""Calibrate once on data, reuse at every sync: SmoothQuant factors and static activation scales.

SmoothQuant (Xiao et al. 2023, arXiv:2211.10438, eq. 4): for a projection group fed by one norm,
  s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)
per input channel j, with max|X_j| from activations on calibration prompts and max|W_j| over the
group's weights. Dividing the norm's weight by s and multiplying the projections' columns by s is
exact in real arithmetic and moves activation outliers into the (per-channel quantized) weights.

Static activation scales (optional, `static_activations=True`): one symmetric per-tensor int8 scale
per quantized projection, s_x = max|x| / 127 over every calibration token of that projection's
input *as the int8 GEMM sees it*, i.e. after smoothing (x_j / s_j for the norm-fed groups, the raw
input for o_proj and down_proj). Since division by s_j > 0 is monotone, max_t |x_tj / s_j| =
(max_t |x_tj|) / s_j exactly, so one pass of per-channel maxima serves both calibrations. vLLM fuses
q/k/v and gate/up into one Linear with a single input scale (its loader keeps whichever shard's scale
arrives last), so each fused group gets one scale, stored identically under every member's name.

Everything is stored in one safetensors file with the model's fingerprint and a list of what it
contains, so a file from another model, or one without the tensors a run asks for, is refused
before any engine starts.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path

import torch

from openrlhf_tis.rollout.quantize import (
    FUSED_GROUPS,
    INT8_MAX,
    PROJECTIONS,
    SMOOTH_GROUPS,
    fingerprint_mismatch,
    input_scale_name,
    is_quantized_weight,
    model_fingerprint,
)

META_KEY = "openrlhf_tis_calibration"
SMOOTHING = "smoothing"
INPUT_SCALES = "input_scales"
_BLOCK_OF = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
             "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
_PROJ_MODULE = re.compile(r"^(.*\.layers\.(\d+))\.(self_attn|mlp)\.(" + "|".join(PROJECTIONS) + r")$")
_NORM_NAME = re.compile(r"^.*\.layers\.(\d+)\.(" + "|".join(SMOOTH_GROUPS) + r")\.weight$")
_SCALE_NAME = re.compile(r"^.*\.layers\.(\d+)\.(self_attn|mlp)\.(" + "|".join(PROJECTIONS) + r")\.input_scale$")


class CalibrationMismatchError(ValueError):
    """The calibration file was made for a different model, or lacks what the run needs."""


@torch.no_grad()
def activation_absmax(model: torch.nn.Module, prompts_token_ids: list[list[int]]) -> dict[str, torch.Tensor]:
    """Per-input-channel max |x| of every decoder projection's input, keyed by projection module name.

    One forward pass per prompt through an HF causal LM; float32 maxima (a max does not round).
    """
    act_max: dict[str, torch.Tensor] = {}
    hooks = []
    for name, module in model.named_modules():
        m = _PROJ_MODULE.match(name)
        if m is None or _BLOCK_OF[m.group(4)] != m.group(3):
            continue

        def hook(_mod, inputs, _name=name):
            x = inputs[0].detach().float().reshape(-1, inputs[0].shape[-1]).abs().amax(0)
            prev = act_max.get(_name)
            act_max[_name] = x if prev is None else torch.maximum(prev, x)

        hooks.append(module.register_forward_pre_hook(hook))
    try:
        model.eval()
        for ids in prompts_token_ids:
            model(torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()
    return act_max


def smoothing_from_absmax(model: torch.nn.Module, act_max: dict[str, torch.Tensor],
                          alpha: float = 0.5) -> dict[str, torch.Tensor]:
    """SmoothQuant factors per norm (eq. 4) from the projection input maxima of `activation_absmax`."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    params = dict(model.named_parameters())
    smoothing = {}
    for norm, (block, projs) in SMOOTH_GROUPS.items():
        for module_name, x_max in act_max.items():
            if not module_name.endswith(f".{block}.{projs[0]}"):
                continue
            layer = module_name.rsplit(".", 2)[0]
            weights = [params[f"{layer}.{block}.{p}.weight"].detach().float() for p in projs]
            w_max = torch.stack([w.abs().amax(0) for w in weights]).amax(0)
            s = x_max.clamp(min=1e-5).pow(alpha) / w_max.clamp(min=1e-5).pow(1 - alpha)
            smoothing[f"{layer}.{norm}.weight"] = s.clamp(min=1e-5)
    return smoothing


def input_scales_from_absmax(act_max: dict[str, torch.Tensor],
                             smoothing: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Static per-tensor int8 scales max|x / s| / 127, keyed `<projection>.input_scale` (shape [1], fp32).

    A fused group's members share their input, so the group's scale is computed once (from its first
    member) and stored under every member's name: bitwise identical, whichever shard vLLM keeps.
    """
    norm_of = {projs: norm for norm, (_block, projs) in SMOOTH_GROUPS.items()}
    scales: dict[str, torch.Tensor] = {}
    for module_name, x_max in act_max.items():
        layer, block, proj = module_name.rsplit(".", 2)
        group = next((g for g in FUSED_GROUPS if proj in g), (proj,))
        if proj != group[0]:
            continue  # filled in from the group's first member
        norm = norm_of.get(group)
        s = smoothing.get(f"{layer}.{norm}.weight") if norm else None
        x = x_max.float() if s is None else x_max.float() / s.float()
        scale = (x.amax() / INT8_MAX).clamp(min=torch.finfo(torch.float32).tiny).reshape(1)
        for member in group:
            scales[f"{layer}.{block}.{member}.input_scale"] = scale.clone()
    return scales


def calibrate(model: torch.nn.Module, prompts_token_ids: list[list[int]], alpha: float = 0.5,
              static_activations: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(smoothing factors, static input scales or {}) from one calibration pass over the prompts."""
    act_max = activation_absmax(model, prompts_token_ids)
    smoothing = smoothing_from_absmax(model, act_max, alpha)
    return smoothing, (input_scales_from_absmax(act_max, smoothing) if static_activations else {})


def calibrate_smoothing(model: torch.nn.Module, prompts_token_ids: list[list[int]],
                        alpha: float = 0.5) -> dict[str, torch.Tensor]:
    """Per-norm smoothing factors from an HF causal LM run on calibration prompts (fp32)."""
    return calibrate(model, prompts_token_ids, alpha)[0]


def save_calibration(path: str | Path, smoothing: dict[str, torch.Tensor], model_config: dict, alpha: float,
                     n_prompts: int, input_scales: dict[str, torch.Tensor] | None = None) -> Path:
    """Write smoothing factors (and static input scales) with the model's fingerprint and a contents list."""
    from safetensors.torch import save_file

    input_scales = input_scales or {}
    contents = [SMOOTHING] + ([INPUT_SCALES] if input_scales else [])
    meta = {"fingerprint": model_fingerprint(model_config), "alpha": alpha, "n_prompts": n_prompts,
            "kind": "smoothquant", "contents": contents}
    if input_scales:
        meta["input_scale"] = "max|x / s| / 127 over the calibration tokens (symmetric, per tensor)"
    path = Path(path)
    tensors = {k: v.contiguous().float() for k, v in {**smoothing, **input_scales}.items()}
    save_file(tensors, str(path), metadata={META_KEY: json.dumps(meta)})
    return path


def split_calibration(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(smoothing factors keyed by norm weight, static input scales keyed by input_scale name)."""
    scales = {k: v for k, v in tensors.items() if k.endswith(".input_scale")}
    return {k: v for k, v in tensors.items() if k not in scales}, scales


def has_input_scales(meta: dict) -> bool:
    """Whether a calibration file's metadata says it carries static activation scales."""
    return INPUT_SCALES in meta.get("contents", [SMOOTHING])


def _check_tensors(path, tensors: dict[str, torch.Tensor], model_config: dict,
                   weight_names: Iterable[str] | None) -> None:
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
        if m is None or _BLOCK_OF[m.group(3)] != m.group(2) or (layers is not None and int(m.group(1)) >= layers):
            raise CalibrationMismatchError(f"{path}: tensor {k} is not a projection input scale of this model")
        if v.shape != (1,) or not bool(torch.isfinite(v).all()) or not bool((v > 0).all()):
            raise CalibrationMismatchError(f"{path}: input scale {k} must be one finite positive value, got {v}")
    if weight_names is not None:
        names = set(weight_names)
        if unknown := sorted(set(smoothing) - names):
            raise CalibrationMismatchError(
                f"{path}: {len(unknown)} factors name no weight of the model, e.g. {unknown[0]}")
        if scales:
            expected = {input_scale_name(w) for w in names if is_quantized_weight(w)}
            if missing := sorted(expected - set(scales)):
                raise CalibrationMismatchError(
                    f"{path}: no input scale for {len(missing)} quantized projections, e.g. {missing[0]}")
            if extra := sorted(set(scales) - expected):
                raise CalibrationMismatchError(f"{path}: input scale {extra[0]} names no quantized projection")
    for k in scales:  # one scale per fused Linear: vLLM would silently keep the last shard's
        layer, _block, proj = k[: -len(".input_scale")].rsplit(".", 2)
        for group in FUSED_GROUPS:
            if proj in group and proj != group[0]:
                first = f"{layer}.{_BLOCK_OF[proj]}.{group[0]}.input_scale"
                if first in scales and not torch.equal(scales[first], scales[k]):
                    raise CalibrationMismatchError(
                        f"{path}: {k} differs from {first}; vLLM fuses them into one Linear with one input scale")


def load_calibration(path: str | Path, model_config: dict,
                     weight_names: Iterable[str] | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """All calibration tensors and the metadata; CalibrationMismatchError when they do not fit the model.

    With `weight_names` (the model checkpoint's tensor names) static input scales must cover exactly
    the quantized projections.
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
    has_scales = any(k.endswith(".input_scale") for k in tensors)
    if has_scales != has_input_scales(meta):
        raise CalibrationMismatchError(f"{path}: metadata contents {meta.get('contents')} do not match its tensors")
    _check_tensors(path, tensors, model_config, weight_names)
    return tensors, meta


def main(argv: list[str] | None = None) -> None:
    """`python -m openrlhf_tis.rollout.calibration --model DIR --prompts F.jsonl --out F [--static_activations]`."""
    import argparse

    parser = argparse.ArgumentParser(description="Calibrate INT8 rollouts once per run: SmoothQuant factors and, "
                                     "optionally, static activation scales.")
    parser.add_argument("--model", required=True, help="HF model directory (the actor's initial weights)")
    parser.add_argument("--prompts", required=True, help="JSONL calibration prompts")
    parser.add_argument("--input_key", default="input", help="JSON key holding the prompt text")
    parser.add_argument("--max_prompts", type=int, default=64)
    parser.add_argument("--alpha", type=float, default=0.5, help="SmoothQuant migration strength")
    parser.add_argument("--static_activations", action="store_true",
                        help="also store one static int8 input scale per projection (max|x/s|/127), for "
                        "--vllm.int8_activations static")
    parser.add_argument("--out", required=True, help="output .safetensors (pass it as --vllm.int8_calibration)")
    args = parser.parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    with open(args.prompts, encoding="utf-8") as f:
        texts = [json.loads(line)[args.input_key] for line in f if line.strip()][: args.max_prompts]
    ids = [tok(t)["input_ids"] for t in texts]
    smoothing, scales = calibrate(model, ids, args.alpha, static_activations=args.static_activations)
    with open(Path(args.model) / "config.json", encoding="utf-8") as f:
        config = json.load(f)
    print(save_calibration(args.out, smoothing, config, args.alpha, len(ids), input_scales=scales))


if __name__ == "__main__":
    main()
