"""The adaptive truncation bound: each call's TIS cap C chosen from its own ratios, by a target ESS.

For the valid tokens' ratios r_1..r_n (r = π_old/μ) and a cap C, the truncated weights w_i = min(r_i, C) have the
normalized effective sample size (Kong 1992; Owen, "Monte Carlo theory, methods and examples", §9.3)

    ESS(C) = (Σ_i w_i)² / (n Σ_i w_i²) ∈ [1/n, 1],   1 − ESS = Var(w) / E[w²]  (the weights' relative spread).

ESS(C) never increases with C: where k tokens are truncated, d log ESS / dC = 2k Σ_{r_i<C} r_i (r_i − C) / (S₁ S₂)
≤ 0. The rule takes the loosest cap that keeps the spread within the target ρ, inside [C_min, C_max]:

    C_t = C_max                                   if ESS(C_max) ≥ ρ      (little mismatch: "at max")
    C_t = C_min                                   if ESS(C_min) < ρ      (target out of reach: "at min")
    C_t = max{ C ∈ [C_min, C_max] : ESS(C) ≥ ρ }  otherwise              (the target binds)

so the cap tightens as the mismatch spreads the ratios, and loosens to C_max as it vanishes; ratios all 1 give
weights exactly 1 (no correction) at any cap. C_min = C_max = C is plain TIS with cap C, and so is any ρ ≤ 1/n
(ESS ≥ 1/n always). Computed exactly: sorted ratios and their prefix sums give ESS at every ratio (the breakpoints
of the piecewise rational ESS(C)), and between the two breakpoints that bracket ρ, ESS(C) = ρ is a quadratic in C.

The idea that the batch's ESS should set the cap is P3O's (Fakoor et al. 2026, arXiv 2605.12380: the cap loosens
as ESS → 1 and tightens as it drops); AIS (Zhou et al. 2026, arXiv 2605.13907) likewise adapts the correction's
strength per batch from weight diagnostics, there as a mix of the corrected and uncorrected gradients. The
cap-by-target-ESS rule is this module's own, derived from the ESS definition above; truncation itself is TIS
(Ionides 2008, who caps at √n·mean w; Yao et al. 2025 for RL).

Scope: one call, i.e. one micro-batch on one rank (the loss is called per micro-batch): the rule reads only the
ratios that call weights, with no extra communication; the ESS is a ratio of sums, so a micro-batch of a few
thousand tokens estimates it well (docs/correction.md).
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class AdaptiveBound(NamedTuple):
    """What the rule chose for one call: 0-d tensors (no host synchronization)."""

    bound: torch.Tensor
    """C_t, in [C_min, C_max]."""
    ess: torch.Tensor
    """ESS(C_t) of the valid tokens' truncated weights; 1 when there are none (or all weights are 0)."""
    at_max: torch.Tensor
    """1.0 where ESS(C_max) ≥ ρ: the cap sits at C_max, else 0.0."""
    at_min: torch.Tensor
    """1.0 where even ESS(C_min) < ρ: the cap sits at C_min, else 0.0."""


_SAME_WIDTH_INT = {torch.float64: torch.int64, torch.float32: torch.int32, torch.float16: torch.int16,
                   torch.bfloat16: torch.int16}


def _sorted(x: torch.Tensor) -> torch.Tensor:
    """x ≥ 0 (+inf allowed, no NaN) in ascending order. Non-negative IEEE floats order as their bit patterns read as
    signed integers of the same width, and torch sorts integers by radix on the CPU: 4-6x faster than its float
    sort on 262,144 ratios (one thread); on a GPU both are radix sorts."""
    return x.view(_SAME_WIDTH_INT[x.dtype]).sort().values.view(x.dtype)


def adaptive_bound(r: torch.Tensor, valid: torch.Tensor, ess_target: float, min_bound: float,
                   max_bound: float) -> AdaptiveBound:
    """The cap C_t of the module docstring for ratios `r` ≥ 0 (inf allowed) on the tokens where `valid` > 0.

    Tokens off `valid` never enter: their ratios are replaced before anything reads them. Ratios above C_max are
    read as C_max (no cap in [C_min, C_max] tells them apart), so inf is harmless. Sums run in r's dtype (float32
    in training: the cap to ~1e-5 relative, tests/test_correction_adaptive.py), the final quadratic in float64;
    the full-size temporaries are a few planes of r's size, updated in place (ops.py), and there is no host
    synchronization.
    """
    f64 = torch.float64
    if r.numel() == 0:
        one = torch.ones((), dtype=f64, device=r.device)
        return AdaptiveBound(one * max_bound, one, one, one * 0)
    on = valid.reshape(-1) > 0
    n = torch.count_nonzero(on).to(f64)  # a sum would first copy the mask to a wider dtype
    # the valid ratios ascending, then zeros (off V: +inf sorts last, then reads as 0)
    s = _sorted(r.reshape(-1).clamp(max=max_bound).masked_fill_(~on, torch.inf)).nan_to_num_(posinf=0.0)
    rho = ess_target

    def ess(total: torch.Tensor, squares: torch.Tensor) -> torch.Tensor:
        """(Σw)² / (n Σw²) from the sums, at most 1 (Cauchy–Schwarz; float sums can land a ulp above); 1 where no
        weight is above 0 (all equal)."""
        return torch.where(squares > 0, total * total / (n * squares), 1.0).clamp(max=1.0)

    # ESS(C_min) and ESS(C_max), a pass each: the zeros after V add nothing to either sum
    cut = [s.clamp(max=cap) for cap in (min_bound, max_bound)]
    sums = torch.stack([w.sum() for w in cut] + [torch.dot(w, w) for w in cut]).to(f64)
    del cut
    ess_min, ess_max = ess(sums[:2], sums[2:]).unbind()
    at_max, at_min = ess_max >= rho, (ess_min < rho) & (ess_max < rho)
    # ESS at each breakpoint C = s_j: the j smaller ratios kept, s_j and the n − 1 − j after it cut to s_j
    # (ties cut or kept alike). Past V (s_j = 0) it reads ESS(C_max). ESS(s_j) ≥ ρ ⇔ total ≥ √(ρ n squares).
    after = torch.arange(s.numel(), device=s.device, dtype=s.dtype).neg_().add_(n.to(s.dtype) - 1)  # n − 1 − j
    sq = s * s
    total, squares = s.cumsum(0).addcmul_(after, s), sq.cumsum(0).addcmul_(after, sq)
    del after, sq
    j = torch.count_nonzero(total >= squares.mul_((rho * n).to(s.dtype)).sqrt_()).clamp(max=s.numel() - 1)
    j = j.reshape(1)  # a 1-element index: reading s[j] needs no host synchronization
    # The target binds: ESS(s_{J−1}) ≥ ρ > ESS(s_J), so C ∈ [s_{J−1}, s_J] where the J smallest ratios are kept
    # (A = Σ, B = Σ², read back from the breakpoint sums) and m = n − J are cut to C.
    s_j, s_before, total_j, root_j = torch.cat([s[j], s[(j - 1).clamp(min=0)], total[j], squares[j]]).to(f64).unbind()
    lo = torch.where(j[0] > 0, s_before, 0.0)
    m = n - j[0]
    a_sum = total_j - m * s_j
    b_sum = (root_j * root_j / (rho * n) - m * s_j * s_j).clamp(min=0)
    # (A + mC)² = ρ n (B + mC²)  ⇔  a C² + b C + c = 0; b ≥ 0, so q avoids cancellation (Numerical Recipes §5.6)
    a, b, c = m * m - rho * n * m, 2 * a_sum * m, a_sum * a_sum - rho * n * b_sum
    q = -0.5 * (b + (b * b - 4 * a * c).clamp(min=0).sqrt())
    first, second = (q / a).nan_to_num(nan=-1.0), (c / q).nan_to_num(nan=-1.0)
    root = torch.where((first >= lo) & (first <= s_j), first, second)
    # in the bracket, then in [C_min, C_max] last: where rounding put the target between two tiny ratios (ESS(C_max)
    # a ulp under ρ = 1 with one valid token), the cap still never leaves the range the user gave
    root = root.maximum(lo).minimum(s_j).clamp(min=min_bound, max=max_bound)
    bound = torch.where(at_max, max_bound, torch.where(at_min, min_bound, root))
    # ESS(C_t): at a limit, read above; inside, segment J's sums (C_t lies in it)
    inside = ess(a_sum + m * bound, b_sum + m * bound * bound)
    return AdaptiveBound(bound, torch.where(at_max, ess_max, torch.where(at_min, ess_min, inside)),
                         at_max.to(f64), at_min.to(f64))
