"""benchmarks/upstream_formula.py, the project's own statement of OpenRLHF 0.11.2's `PolicyLoss`, equals upstream's
class on random inputs: loss, gradient and every reported figure, for each scheme gpu_check compares (no
correction, token ICEPOP mask, token TIS clip, seq-mask-tis), both aggregations, local and global counts, dual clip
and asymmetric ε, masks with empty sequences. As the baseline of gpu_check's cost rows it launches the same kernels
and peaks at the same memory as upstream's on the CPU. It refuses what it does not state."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import pytest
import torch

from openrlhf_tis import patches

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import bench_correction as bench  # noqa: E402
from upstream_formula import StatedPolicyLoss  # noqa: E402

sys.path.remove(str(BENCHMARKS))
patches.apply_platform_patches("cpu")  # openrlhf.models imports flash_attn at module level
from openrlhf.models import PolicyLoss  # noqa: E402

SCHEMES = {
    "off": {},
    "upstream_icepop": {"is_correction_level": "token", "is_correction_mode": "mask"},
    "upstream_tis": {"is_correction_level": "token", "is_correction_mode": "clip"},
    "upstream_seq_mask_tis": {"is_correction_level": "seq", "is_correction_mode": "mask"},
}
SHAPES = [(1, 1), (3, 7), (6, 33), (16, 128)]
COUNTS = [{}, {"batch_num_tokens": 41.0, "global_batch_size": 9.0, "dp_size": 2}]


def _batch(B: int, T: int, seed: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """[log π_θ, log π_old, log μ, advantages, action mask]: ratios π_old/μ spread across [0.5, 5] and beyond
    (so every gate keeps some units and drops others), a few far-off tokens under μ and a few under π_θ (past
    the clamp of log(π_θ/π_old)), random lengths (some sequences
    empty, where upstream's means are NaN: the statement must be NaN there too)."""
    g = torch.Generator().manual_seed(seed)
    old = -0.2 - 2.5 * torch.rand(B, T, generator=g, dtype=dtype)
    roll = old - 0.9 * torch.randn(B, T, generator=g, dtype=dtype)
    roll[torch.rand(B, T, generator=g) < 0.05] -= 6.0
    lp = old + 0.3 * torch.randn(B, T, generator=g, dtype=dtype)
    lp[torch.rand(B, T, generator=g) < 0.05] -= 25.0  # beyond the ±20 clamp of log(π_θ/π_old)
    adv = torch.randn(B, T, generator=g, dtype=dtype)
    lengths = torch.randint(0 if B > 2 else 1, T + 1, (B,), generator=g)
    am = (torch.arange(T)[None, :] < lengths[:, None]).to(dtype)
    return [lp, old, roll, adv, am]


def _outputs(policy_loss, batch: list[torch.Tensor], counts: dict) -> tuple[list, torch.Tensor | None]:
    """Upstream's five outputs (None kept) and the gradient w.r.t. log π_θ (None where the loss is NaN)."""
    lp0, old, roll, adv, am = batch
    lp = lp0.clone().requires_grad_(True)
    outputs = list(policy_loss(lp, old, adv, am, roll, **counts))
    if not torch.isfinite(outputs[0]):
        return outputs, None
    (grad,) = torch.autograd.grad(outputs[0], lp)
    return outputs, grad


def _assert_same(stated: list, upstream: list, **tolerance) -> None:
    assert [x is None for x in stated] == [x is None for x in upstream]
    for got, want in zip(stated, upstream, strict=True):
        if want is not None:
            torch.testing.assert_close(got, want, equal_nan=True, **tolerance)


@pytest.mark.parametrize(("scheme", "shape"), list(itertools.product(SCHEMES, SHAPES)))
def test_the_statement_equals_upstream_in_float64(scheme, shape):
    tolerance = {"rtol": 1e-12, "atol": 1e-15}
    for seed, (token_level, counts, dual_clip, eps) in enumerate(
            itertools.product([True, False], COUNTS, [None, 3.0], [(0.2, 0.2), (0.1, 0.28)])):
        options = {"clip_eps_low": eps[0], "clip_eps_high": eps[1], "dual_clip": dual_clip,
                   "token_level_loss": token_level, **SCHEMES[scheme]}
        batch = _batch(*shape, seed=seed, dtype=torch.float64)
        up, up_grad = _outputs(PolicyLoss(**options), batch, counts)
        ours, our_grad = _outputs(StatedPolicyLoss(**options), batch, counts)
        _assert_same(ours, up, **tolerance)
        assert (our_grad is None) == (up_grad is None)
        if up_grad is not None:
            torch.testing.assert_close(our_grad, up_grad, **tolerance)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_the_statement_equals_upstream_in_float32_and_with_a_custom_band(scheme):
    """The precision gpu_check compares in on the device, and a band other than the default [0.5, 5]."""
    band = {"is_correction_threshold": [0.8, 1.25]} if scheme != "off" else {}
    batch = _batch(12, 64, seed=7, dtype=torch.float32)
    counts = {"batch_num_tokens": batch[4].sum(), "global_batch_size": 12.0, "dp_size": 1}
    up, up_grad = _outputs(PolicyLoss(**SCHEMES[scheme], **band), batch, counts)
    ours, our_grad = _outputs(StatedPolicyLoss(**SCHEMES[scheme], **band), batch, counts)
    _assert_same(ours, up, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(our_grad, up_grad, rtol=1e-6, atol=1e-9)
    if scheme != "off":  # the band gates something either way: the comparison is not vacuous
        assert 0 < ours[4].item() < 1


def test_the_baseline_costs_what_upstream_costs_on_the_cpu():
    """gpu_check's cost goals are ratios to upstream's uncorrected loss: where the statement stands in, the same
    kernels (aten operations on the CPU) and the same peak memory make the same ratios."""
    lp0, old, roll, adv, am = bench.make_batch(16, 64, "cpu")
    counts = {"batch_num_tokens": am.sum(), "global_batch_size": 16.0, "dp_size": 1}

    def step(policy_loss):
        def run() -> None:
            lp = lp0.clone().requires_grad_(True)
            policy_loss(lp, old, adv, am, roll, **counts)[0].backward()
        return run

    up, ours = step(PolicyLoss()), step(StatedPolicyLoss())
    assert bench.kernel_count(ours, "cpu") == bench.kernel_count(up, "cpu")
    assert bench.peak_memory(ours, "cpu") == bench.peak_memory(up, "cpu")


@pytest.mark.parametrize(("options", "words"), [
    ({"is_correction_level": "token", "is_correction_gating": "binary_kl"}, "only the ratio gate"),
    ({"is_correction_level": "seq", "is_correction_mode": "clip"}, "needs is_correction_level token"),
    ({"is_correction_level": "sentence"}, "off/token/seq"),
    ({"dual_clip": 0.5}, "dual_clip must be > 1.0"),
])
def test_what_the_statement_does_not_cover_is_refused(options, words):
    with pytest.raises(ValueError, match=words):
        StatedPolicyLoss(**options)
