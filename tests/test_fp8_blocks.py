"""FP8 block quantization (rollout/fp8_blocks.py) against a float64 reference written here.

The reference walks the blocks one by one in float64: scale = max|W_b| / 448 (then the fp32 the format stores),
and e4m3's rounding bound, |W - q s| <= max(|W| / 16, s / 1024): 3 mantissa bits give half a step of at most 2^-4
of a normal value, and the subnormal step is 2^-9 of s.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from openrlhf_tis.rollout.fp8_blocks import (
    FP8_DTYPE,
    block_grid,
    dequantize_blocks,
    max_relative_error,
    quantize_blocks,
)

FP8_MAX = 448.0


def reference_scales(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    n, k = w.shape
    bn, bk = block
    out = torch.empty(math.ceil(n / bn), math.ceil(k / bk), dtype=torch.float64)
    for i in range(out.shape[0]):
        for j in range(out.shape[1]):
            amax = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].double().abs().max().item()
            out[i, j] = amax / FP8_MAX if amax > 0 else torch.finfo(torch.float32).tiny
    return out.float()


def expanded(scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    """Each weight's block scale, in float64, by indexing (not by the module's padding and views)."""
    rows = torch.arange(shape[0]) // block[0]
    cols = torch.arange(shape[1]) // block[1]
    return scale.double()[rows][:, cols]


weights = st.tuples(st.integers(1, 70), st.integers(1, 70), st.sampled_from([(16, 16), (8, 32), (128, 128)]),
                    st.integers(0, 2**31 - 1), st.floats(1e-6, 1e3), st.booleans())


@settings(max_examples=60, deadline=None)
@given(weights)
def test_block_scales_and_round_trip_match_the_float64_reference(case):
    n, k, block, seed, magnitude, zero_block = case
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=gen) * magnitude).to(torch.bfloat16)
    if zero_block:
        w[: block[0], : block[1]] = 0  # an all-zero block (the whole weight when it is smaller than one)
    q, scale = quantize_blocks(w, block)
    assert q.dtype == FP8_DTYPE and q.shape == (n, k)
    assert scale.dtype == torch.float32 and tuple(scale.shape) == block_grid((n, k), block)
    assert torch.equal(scale, reference_scales(w, block))
    assert torch.isfinite(scale).all() and (scale > 0).all()
    back = dequantize_blocks(q, scale, block).double()
    assert torch.isfinite(back).all()
    w64, s64 = w.double(), expanded(scale, (n, k), block)
    bound = torch.maximum(w64.abs() / 16, s64 / 1024) * (1 + 1e-6)
    assert ((back - w64).abs() <= bound).all()
    if zero_block:
        assert (back[: block[0], : block[1]] == 0).all()
    # each block's largest value maps to e4m3's largest (nothing clipped, the whole range used)
    assert q.float().abs().max().item() == FP8_MAX or w.abs().max().item() == 0


def test_an_all_zero_weight_quantizes_to_zeros_without_nan():
    q, scale = quantize_blocks(torch.zeros(130, 260))
    assert scale.shape == (2, 3) and torch.isfinite(scale).all()
    assert (q.float() == 0).all() and (dequantize_blocks(q, scale) == 0).all()
    assert max_relative_error(torch.zeros(130, 260), quantize_blocks(torch.zeros(130, 260))) == 0.0


def test_a_hand_worked_block():
    # one 2x2 block: max |w| = 8 -> s = 8/448 = 1/56; w/s = (56, -28, 14, 0) are all e4m3 values, so exact
    w = torch.tensor([[8.0, -4.0], [2.0, 0.0]])
    q, scale = quantize_blocks(w, (2, 2))
    assert scale.item() == pytest.approx(1 / 56, rel=1e-7)
    assert q.float().tolist() == [[448.0, -224.0], [112.0, 0.0]]
    assert max_relative_error(w, quantize_blocks(w, (2, 2)), (2, 2)) < 1e-6


def test_smollm2_shapes_take_partial_edge_blocks():
    # SmolLM2-135M: hidden 576 = 4.5 blocks of 128, so every projection has a partial block column or row
    assert block_grid((576, 576)) == (5, 5) and block_grid((1536, 576)) == (12, 5)
    assert block_grid((576, 1536)) == (5, 12)


def test_a_weight_that_is_not_2d_is_refused_naming_its_shape():
    with pytest.raises(ValueError, match=r"2-D weight, got shape \(4,\)"):
        quantize_blocks(torch.ones(4))
