"""CPU patch: an fp32 lm_head keeps its fp32 weight instead of casting it at every decode step.

vLLM 0.32's LogitsProcessor._apply_head (model_executor/layers/logits_processor.py) runs a
`head_dtype` float32 head on CUDA with `torch.mm(..., out_dtype=float32)`, but on every other
platform it computes `F.linear(h.float(), lm_head.weight.float())`: the whole vocabulary x hidden
weight is cast afresh at every forward. For SmolLM2-135M that is 28 M values per decode step, and
it made `--vllm.fp32_lm_head` rollouts ~45% slower on CPU (`torch.mm(out_dtype=...)` has no CPU
kernel in torch 2.13). This patch casts once and reuses the copy; the logits are bit-identical
(the same F.linear on the same fp32 values). The copy (openrlhf_tis.rollout.fp32_head) is dropped whenever
the fork reloads weights (`forget_fp32_heads`, called by openrlhf_tis.rollout.weight_sync.reload)
and whenever the weight tensor itself is replaced, so a sync can never leave a stale head
(tests/test_weight_sync_vllm.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from openrlhf_tis.import_hooks import after_import
from openrlhf_tis.rollout.fp32_head import fp32_head_weight
from openrlhf_tis.upstream_guards import replace, require_version, unpatched

NAME = "cpu_fp32_head"
DEVICES = ("cpu",)  # the run's device, decided by its driver (patches/__init__.py)
TARGET = "vllm.model_executor.layers.logits_processor"


def _patch_logits_processor(module) -> None:
    processor = module.LogitsProcessor
    original = unpatched(processor, "_apply_head")
    plain_heads = (module.UnquantizedEmbeddingMethod, module.UnquantizedLinearMethod)

    def _apply_head(self, lm_head, hidden_states, embedding_bias):
        if (self.head_dtype != torch.float32 or hidden_states.dtype == torch.float32 or hidden_states.is_cuda
                or not isinstance(lm_head.quant_method, plain_heads)):
            return original(self, lm_head, hidden_states, embedding_bias)  # upstream's path, its errors included
        bias = None if embedding_bias is None else embedding_bias.to(torch.float32)
        return F.linear(hidden_states.to(torch.float32), fp32_head_weight(lm_head), bias)

    replace(processor, "_apply_head", _apply_head, patch=NAME)


def apply() -> bool:
    require_version("vllm", ">=0.32,<0.33", patch=NAME)
    after_import(TARGET, _patch_logits_processor)
    return True
