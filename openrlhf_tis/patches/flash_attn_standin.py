"""Pure-torch versions of the flash-attn padding helpers OpenRLHF imports (see cpu_flash_attn).

Semantics follow flash_attn.bert_padding 2.x: `unpad_input` gathers the non-padding rows of a
(batch, seqlen, ...) tensor into (total_tokens, ...), `pad_input` scatters them back. Plain indexing
and index_put are differentiable, so no custom autograd functions are needed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from einops import rearrange

__all__ = ["all_gather", "index_first_axis", "pad_input", "rearrange", "unpad_input"]


def index_first_axis(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Rows `indices` of `x` along its first axis."""
    return x[indices]


def pad_input(x: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """Inverse of unpad_input: (total, ...) -> (batch, seqlen, ...), zeros where padding was."""
    out = x.new_zeros((batch * seqlen, *x.shape[1:]))
    out = out.index_put((indices,), x)
    return out.view(batch, seqlen, *x.shape[1:])


def unpad_input(x: torch.Tensor, attention_mask: torch.Tensor, unused_mask: torch.Tensor | None = None):
    """(batch, seqlen, ...) -> (tokens, indices, cu_seqlens, max_seqlen, used_seqlens)."""
    keep = attention_mask + unused_mask if unused_mask is not None else attention_mask
    seqlens = keep.sum(dim=-1, dtype=torch.int32)
    used_seqlens = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(keep.flatten(), as_tuple=False).flatten()
    cu_seqlens = F.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    return x.flatten(0, 1)[indices], indices, cu_seqlens, int(seqlens.max().item()), used_seqlens


def all_gather(x: torch.Tensor, group) -> torch.Tensor:
    """Concatenate `x` from every rank of `group` along the first axis."""
    world = dist.get_world_size(group)
    out = x.new_empty((world * x.shape[0], *x.shape[1:]))
    dist.all_gather_into_tensor(out, x.contiguous(), group=group)
    return out
