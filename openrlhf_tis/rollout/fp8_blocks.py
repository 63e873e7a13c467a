"""FP8 (e4m3) block quantization of Linear weights: the layout vLLM's block-FP8 linear method loads.

Pure torch, whichever device holds the weights: the same function quantizes a rollout checkpoint on the CPU and
a sync's weights on a GPU (benchmarks/gpu_check.py measures it there against a float64 reference).

Format (as DeepSeek-V3's FP8 checkpoints, verl's `rollout.quantization=fp8` and vLLM's `Fp8LinearMethod` with
`weight_block_size` use it): a weight W [N, K] is cut into blocks of `block = (bn, bk)` (128 x 128 by default; edge
blocks are partial when N or K is not a multiple), each block b gets one fp32 scale s_b = max|W_b| / 448 (448 is
e4m3's largest finite value), q = e4m3(W / s_b), and W ≈ q * s_b. The scales [ceil(N/bn), ceil(K/bk)] are stored as
`<...>.weight_scale_inv` (the name is historical: it multiplies q back). Activations are quantized per token group
by the engine at run time (dynamic), so only weights are written.

An all-zero block would give s = 0 and q = 0/0 = NaN (a known failure of online FP8 re-quantization): its scale is
clamped to the smallest normal fp32, which leaves q = 0 and W = 0 exactly.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
DEFAULT_BLOCK = (128, 128)


def block_grid(shape: tuple[int, int], block: tuple[int, int] = DEFAULT_BLOCK) -> tuple[int, int]:
    """The scales' shape for a weight of `shape`: one per (partial) block."""
    (n, k), (bn, bk) = shape, block
    return math.ceil(n / bn), math.ceil(k / bk)


def _blocks(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """W [N, K] zero-padded to whole blocks, viewed as [N/bn, bn, K/bk, bk] (padding never raises a block's max)."""
    (n, k), (bn, bk) = w.shape, block
    rows, cols = block_grid((n, k), block)
    padded = torch.nn.functional.pad(w, (0, cols * bk - k, 0, rows * bn - n))
    return padded.view(rows, bn, cols, bk)


class Fp8Weight(NamedTuple):
    """One quantized weight: e4m3 values [N, K] and fp32 block scales [ceil(N/bn), ceil(K/bk)]."""

    q: torch.Tensor
    scale: torch.Tensor


def quantize_blocks(weight: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK) -> Fp8Weight:
    """Block-wise e4m3 quantization of a 2-D weight (see the module doc); never NaN, never saturates."""
    if weight.ndim != 2:
        raise ValueError(f"FP8 block quantization takes a 2-D weight, got shape {tuple(weight.shape)}")
    w = weight.detach().to(torch.float32)
    blocks = _blocks(w, block)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = (amax / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    n, k = weight.shape
    return Fp8Weight(q.view(blocks.shape[0] * block[0], -1)[:n, :k].contiguous(), scale)


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK) -> torch.Tensor:
    """q * s per block, in fp32: what the engine's GEMM multiplies activations by."""
    blocks = _blocks(q.to(torch.float32), block)
    n, k = q.shape
    return (blocks * scale[:, None, :, None]).view(blocks.shape[0] * block[0], -1)[:n, :k]


def max_relative_error(weight: torch.Tensor, quantized: Fp8Weight, block: tuple[int, int] = DEFAULT_BLOCK) -> float:
    """max |W - q s| / max |W| over the weight (0 for an all-zero weight): the sync's round-trip error."""
    w = weight.detach().to(torch.float32)
    err = (dequantize_blocks(quantized.q, quantized.scale, block) - w).abs().max()
    return float(err / w.abs().max()) if bool(w.abs().max() > 0) else 0.0


def scale_inv_name(weight_name: str) -> str:
    """`<...>.q_proj.weight` -> `<...>.q_proj.weight_scale_inv` (the name vLLM's block-FP8 loader takes)."""
    return weight_name[: -len(".weight")] + ".weight_scale_inv"


def unblockable(shapes: dict[str, tuple[int, int]], block: tuple[int, int] = DEFAULT_BLOCK) -> list[str]:
    """The projections whose [out, in] shape is not whole blocks, each as `name [out, in]`.

    vLLM loads a fused layer (qkv_proj, gate_up_proj) one shard at a time and cuts the fused scales at the shard's
    offset in whole blocks: a shard that is not whole blocks (SmolLM2-135M's 576-row q_proj, 4.5 blocks of 128)
    lands its scales on the wrong rows or fails the load, and the CPU kernel takes only whole 128-wide blocks along
    the input. Whole blocks on both dimensions is the rule that holds for every layer at any tensor-parallel size
    that divides them.
    """
    bn, bk = block
    return [f"{name} [{n}, {k}]" for name, (n, k) in shapes.items() if n % bn or k % bk]


def unblockable_summary(shapes: dict[str, tuple[int, int]], block: tuple[int, int] = DEFAULT_BLOCK) -> str | None:
    """None when every projection of `shapes` is whole blocks; else one line saying how many are not, with one
    example shape per kind (`q_proj [576, 576]`), for a refusal to quote."""
    if not shapes:
        return "there is no decoder projection to quantize"
    bad = unblockable(shapes, block)
    if not bad:
        return None
    kinds = dict.fromkeys(entry.split(".")[-2] + entry[entry.index(" "):] for entry in bad)
    return f"{len(bad)} of {len(shapes)} projections are not whole {block[0]}x{block[1]} blocks ({', '.join(kinds)})"


def quantize_named_fp8(named: list[tuple[str, torch.Tensor]], is_projection, out_dtype: torch.dtype,
                       block: tuple[int, int] = DEFAULT_BLOCK) -> tuple[list[tuple[str, torch.Tensor]], dict]:
    """Checkpoint-format weights -> block-FP8 checkpoint tensors: each projection (`is_projection(name)`) as its e4m3
    `weight` followed by its `weight_scale_inv` (a layer-wise reload processes a layer once it has every tensor, so
    both travel together), every other tensor in `out_dtype`; and the pass's statistics."""
    out: list[tuple[str, torch.Tensor]] = []
    stats = {"tensors": 0, "values": 0, "zero_blocks": 0, "max_rel_error": 0.0}
    for name, tensor in named:
        if not is_projection(name):
            out.append((name, tensor.detach().to(out_dtype)))
            continue
        quantized = quantize_blocks(tensor, block)
        stats["tensors"] += 1
        stats["values"] += tensor.numel()
        stats["zero_blocks"] += int((quantized.scale == torch.finfo(torch.float32).tiny).sum())
        stats["max_rel_error"] = max(stats["max_rel_error"], max_relative_error(tensor, quantized, block))
        out += [(name, quantized.q), (scale_inv_name(name), quantized.scale)]
    return out, stats


def block_fp8_config(block: tuple[int, int] = DEFAULT_BLOCK) -> dict:
    """config.json's `quantization_config` of a block-FP8 checkpoint (vLLM's Fp8Config: serialized e4m3 weights,
    dynamic activations; embeddings, norms and lm_head stay in the engine dtype)."""
    return {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": list(block)}
