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
