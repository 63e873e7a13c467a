"""The trainer's parameters as the model's checkpoint names and shapes them: what a weight sync sends.

transformers 5 loads some architectures under other names and shapes than their checkpoints hold (its conversion
mapping): Mixtral's `block_sparse_moe.experts.{i}.w1 / w3 / w2` become one `mlp.experts.gate_up_proj` and one
`down_proj` tensor per layer, and `save_pretrained` converts back. An engine loads that checkpoint at its start, so
the checkpoint's layout is the one its `load_weights` is sure to take; vLLM 0.32's Mixtral takes no other, and the
first sync of the upcycled demo stopped at "There is no module or parameter named 'layers.0.mlp' in MixtralModel"
(2026-12-07). So each synced parameter goes through transformers' own reverse conversion, one parameter at a time
(a bucket's memory, never the model's); for an architecture without a conversion it is the parameter itself.

On CUDA the send is upstream's, one trainer parameter at a time under its own name, so the engine's receive converts
instead (receive_cuda.py), through the same transformers conversion of a skeleton of the model built from the
engine's config on the meta device (`EngineLayout`): the names and conversions without the memory.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


def conversions(model: nn.Module) -> list:
    """The conversions `revert_weight_conversion` undoes for `model`: those it was loaded through, else (a model built
    from its config) its architecture's mapping without prefix changes, as transformers itself reverts them."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import PrefixChange

    loaded = getattr(model, "_weight_conversions", None)
    if loaded is not None:
        return list(loaded)
    return [c for c in get_model_conversion_mapping(model, add_legacy=False) if not isinstance(c, PrefixChange)]


def check_convertible(model: nn.Module) -> None:
    """Refuse (RuntimeError) a model whose loading merged several of its own parameters' sources into one checkpoint
    tensor's: converting back one parameter at a time would need them all at once."""
    for conversion in conversions(model):
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


def skeleton(config) -> nn.Module | None:
    """The transformers causal LM of `config` on the meta device (its parameters' names and conversions, no memory);
    None for a config transformers builds no causal LM of (a vision-language model's)."""
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)
    except ValueError:  # "Unrecognized configuration class ... for this kind of AutoModel"
        return None


class EngineLayout:
    """The trainer's parameters, as upstream's CUDA send names them, in the checkpoint layout an engine of `config`
    loaded: a received tensor in, its checkpoint tensors out (views of it, or new tensors where transformers' reverse
    conversion copies). A model transformers builds no causal LM of goes as sent, as upstream sends it."""

    def __init__(self, config):
        self.model = skeleton(config)
        if self.model is not None:
            check_convertible(self.model)
        self.converts = self.model is not None and bool(conversions(self.model))

    def __call__(self, weights: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        return checkpoint_tensors(self.model, weights) if self.converts else list(weights)
