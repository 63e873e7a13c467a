"""CPU patch: keep the weight-scale tensor that vLLM-CPU's oneDNN int8 kernel points to alive.

vLLM 0.32's CPUInt8ScaledMMLinearKernel.process_weights_for_onednn builds a oneDNN handler from the
layer's `weight_scale` tensor and keeps only its raw data pointer. During `reload_weights` the layer
is re-materialised: the handler is rebuilt from a *temporary* scale tensor, then
model_loader/reload/layerwise.py:_copy_and_restore_kernel_tensors copies its values into the old
Parameter and drops the temporary one. The handler then reads freed memory: NaN or wrong log-probs,
no error (docs/design.md §5, trap 4). Keeping a reference to the exact tensor the handler was built with on
the kernel object makes the pointer valid for the handler's lifetime (both are replaced together at
the next reload). Proven by tests/test_rollout_int8_sync.py (synced engine == fresh engine, bitwise).
"""

from __future__ import annotations

import torch

from openrlhf_tis.import_hooks import after_import
from openrlhf_tis.upstream_guards import replace, require_version, unpatched

NAME = "cpu_int8_sync"
DEVICES = ("cpu",)  # the run's device, decided by its driver (patches/__init__.py)
TARGET = "vllm.model_executor.kernels.linear.scaled_mm.cpu"


def _patch_kernel(module) -> None:
    kernel = module.CPUInt8ScaledMMLinearKernel
    original = unpatched(kernel, "process_weights_for_onednn")

    def process_weights_for_onednn(self, layer: torch.nn.Module) -> None:
        _, w_s_name, _, _, _ = self.layer_param_names
        original(self, layer)
        # The handler holds getattr(layer, w_s_name).data_ptr(); own that tensor as long as the handler.
        self._openrlhf_tis_scale_keepalive = getattr(layer, w_s_name)

    replace(kernel, "process_weights_for_onednn", process_weights_for_onednn, patch=NAME)


def apply() -> bool:
    require_version("vllm", ">=0.32,<0.33", patch=NAME)
    after_import(TARGET, _patch_kernel)
    return True
