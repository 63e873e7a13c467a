"""Tensor helpers shared by the correction core (weights.py) and its metrics (metrics.py).

Masks in the core are 0/1 floats of the working dtype rather than bools: they combine by multiplication
and are summed by dot products, and on CPU a comparison written straight into a float tensor costs about
a fifth of a bool comparison plus its conversion.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def indicator(compare: Callable[..., torch.Tensor], a: torch.Tensor, b: float,
              dtype: torch.dtype | None = None) -> torch.Tensor:
    """compare(a, b) (e.g. torch.gt) as 0/1 in `dtype` (default: a's), written straight into that tensor."""
    return compare(a, b, out=torch.empty(a.shape, dtype=dtype or a.dtype, device=a.device))


def finite(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """1 where x is finite, else 0, as `dtype` (default: x's): x − x is 0 exactly for finite x and NaN for
    ±inf and NaN. Two cheap passes, where torch.isfinite costs about five on CPU and four fresh tensors."""
    diff = x - x
    return diff.eq_(0.0) if dtype is None else indicator(torch.eq, diff, 0.0, dtype)


def dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Σ a·b over all elements of two same-shaped tensors, in one pass without the product tensor."""
    return torch.dot(a.reshape(-1), b.reshape(-1))
