"""Tensor helpers shared by the correction core (weights.py) and its metrics (metrics.py).

Masks in the core are 0/1 floats of the working dtype rather than bools: they combine by multiplication
and are summed by dot products, and on CPU a comparison written straight into a float tensor costs about
a fifth of a bool comparison plus its conversion.

The same code runs eagerly and under torch.compile. Eager, every operation is a kernel launch (the cost
on a GPU) and every fresh full-size tensor costs memory (and page faults on CPU): temporaries are reused
in place. Compiled, the graph is fused whatever the style, but overwriting a graph input costs a copy
back: `own` hands the code a tensor it may overwrite either way.
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


def own(x: torch.Tensor) -> torch.Tensor:
    """x for the caller to overwrite in place: x itself eagerly (its owner hands it over), a copy inside a
    compiled graph, where the copy fuses away and overwriting the input would be written back."""
    return x.clone() if torch.compiler.is_compiling() else x


def zero_off(x: torch.Tensor, valid: torch.Tensor, scratch: bool = False) -> torch.Tensor:
    """x with 0 where the 0/1 `valid` is 0, NaN and ±inf there included (0·NaN would leak); `scratch`: x is
    the caller's to overwrite. Compiled: one blend (torch.where). Eager: nan_to_num times the mask, ~20×
    faster than torch.where on CPU."""
    if torch.compiler.is_compiling():
        return torch.where(valid > 0, x, 0.0)
    x = x.nan_to_num_(0.0, 0.0, 0.0) if scratch else torch.nan_to_num(x, 0.0, 0.0, 0.0)
    return x.mul_(valid)
