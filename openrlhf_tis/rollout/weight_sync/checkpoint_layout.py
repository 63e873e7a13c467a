"""The trainer's parameters as the model's checkpoint names and shapes them: what a weight sync sends.

transformers 5 loads some architectures under other names and shapes than their checkpoints hold (its conversion
mapping): Mixtral's `block_sparse_moe.experts.{i}.w1 / w3 / w2` become one `mlp.experts.gate_up_proj` and one
`down_proj` tensor per layer, and `save_pretrained` converts back. An engine loads that checkpoint at its start, so
the checkpoint's layout is the one its `load_weights` is sure to take; vLLM 0.32's Mixtral takes no other, and the
first sync of the upcycled demo stopped at "There is no module or parameter named 'layers.0.mlp' in MixtralModel"
(2026-12-07). So each synced parameter goes through transformers' own reverse conversion, one parameter at a time
(a bucket's memory, never the model's); for an architecture without a conversion it is the parameter itself.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


def check_convertible(model: nn.Module) -> None:
    """Refuse (RuntimeError) a model whose loading merged several of its own parameters' sources into one checkpoint
    tensor's: converting back one parameter at a time would need them all at once."""
    for conversion in getattr(model, "_weight_conversions", None) or []:
        if len(getattr(conversion, "target_patterns", ())) > 1:
            raise RuntimeError(f"weight sync: {type(model).__name__} was loaded through a conversion that splits one "
                               f"checkpoint tensor into {conversion.target_patterns}; the fork's sync converts one "
                               "parameter at a time and cannot send it in the checkpoint's layout")


def checkpoint_tensors(model: nn.Module, named: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """`named` (the model's own parameter names and tensors) as `model.save_pretrained` would write them."""
    from transformers.core_model_loading import revert_weight_conversion

    converted = []
    for name, tensor in named:
        converted.extend(revert_weight_conversion(model, {name: tensor}).items())
    return converted
