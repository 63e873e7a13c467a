"""A vLLM-CPU engine's mixture-of-experts weights after a weight sync: packed again for the CPU's grouped GEMM.

vLLM 0.32's unquantized MoE method packs the expert weights into the CPU kernel's layout (`cpu_prepack_moe_weight`,
called from the experts' `process_weights_after_loading`) only when it first builds its kernel
(`UnquantizedFusedMoEMethod._setup_kernel`). On a weight update, which is what `reload_weights` is, it copies the
new weights into the parameters unpacked and skips the packing, so the engine computes its experts from a wrong
layout. Measured on a tiny Qwen3-MoE: a sync of the very weights the engine already held moved its log-probs by up
to 0.044 (docs/moe.md). After each reload the fork packs them again, in place.
"""

from __future__ import annotations

from torch import nn

from openrlhf_tis.upstream_guards import require_version

_THIS_FILE = "openrlhf_tis/rollout/weight_sync/moe_prepack.py"
VLLM_SUPPORTED = ">=0.32,<0.33"
"""The vLLM release whose `_setup_kernel` was read to skip the packing on a weight update."""


def repack_moe_experts(model: nn.Module) -> int:
    """Pack every MoE layer's freshly reloaded w13 / w2 weights as the CPU kernel expects; return the layers packed.

    Refuses (RuntimeError) an MoE layer whose experts the fork does not know how to pack (quantized CPU experts):
    an engine that would compute with unpacked weights must not go on silently.
    """
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    layers = [(name, module) for name, module in model.named_modules() if isinstance(module, RoutedExperts)]
    if not layers:
        return 0
    require_version("vllm", VLLM_SUPPORTED, patch=_THIS_FILE)
    from vllm._custom_ops import cpu_prepack_moe_weight
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    for name, layer in layers:
        experts = getattr(getattr(layer.quant_method, "moe_kernel", None), "fused_experts", None)
        if not isinstance(experts, CPUUnquantizedExperts):
            raise RuntimeError(f"weight sync: the MoE layer {name} computes with {type(experts).__name__}, whose "
                               f"weights a reload leaves unpacked and the fork cannot pack ({_THIS_FILE})")
        config = experts.moe_config
        if experts._padded_intermediate_size(config) != config.intermediate_size_per_partition:
            raise RuntimeError(f"weight sync: the MoE layer {name} pads its intermediate size for the CPU kernel; "
                               f"the fork packs only unpadded experts after a reload ({_THIS_FILE})")
        if experts._use_zentorch:  # zentorch reads the weights unpacked
            continue
        for weight in (layer.w13_weight, layer.w2_weight):
            weight.data.copy_(cpu_prepack_moe_weight(weight.data, experts.isa))
    return len(layers)
