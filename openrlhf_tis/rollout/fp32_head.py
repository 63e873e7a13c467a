"""The rollout engine's fp32 lm_head weight, cast once per (re)load instead of at every decode step.

Kept on the lm_head module by patches/cpu_fp32_head.py (vLLM off CUDA casts the head afresh at every
forward) and dropped by the fork's weight sync (rollout/weight_sync/reload.py) after every reload,
so a synced engine never computes with the old head. Here, not in the patch, because the sync needs it:
patches import the rollout layer, never the other way.
"""

from __future__ import annotations

import torch

_CACHE = "_openrlhf_tis_fp32_weight"  # (source data_ptr, fp32 copy) on the lm_head module


def fp32_head_weight(lm_head: torch.nn.Module) -> torch.Tensor:
    """The lm_head weight in fp32, cast on first use after a (re)load."""
    weight = lm_head.weight
    cached = lm_head.__dict__.get(_CACHE)
    if cached is None or cached[0] != weight.data_ptr():
        cached = (weight.data_ptr(), weight.detach().to(torch.float32))
        lm_head.__dict__[_CACHE] = cached  # a plain attribute: not a parameter or buffer vLLM would load
    return cached[1]


def forget_fp32_heads(model: torch.nn.Module) -> None:
    """Drop every cached fp32 head copy of `model` (its weights were just reloaded in place)."""
    for module in model.modules():
        module.__dict__.pop(_CACHE, None)
