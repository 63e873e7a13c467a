"""Patch: `--ds.param_dtype fp32` trains in float32.

OpenRLHF 0.11.2 offers bf16 and fp16 only (`openrlhf.utils.utils.convert_to_torch_dtype`). On a CPU without
native bf16 (plain AVX2), torch emulates bf16 and a backward pass of SmolLM2-135M is several times slower than in
fp32 (benchmarks/bench_train_dtype.py, docs/measurements.md), so the fork lets such CPUs train in fp32. DeepSpeed
needs nothing: a config with neither `bf16` nor `fp16` enabled is fp32 training. The actor and reward/critic
models import the converter inside their constructors, so replacing the module attribute reaches both.
"""

from __future__ import annotations

import torch

from openrlhf_tis.import_hooks import after_import
from openrlhf_tis.upstream_guards import replace, require_version

NAME = "fp32_training"
DEVICES = ("cpu", "cuda")


def _patch(module) -> None:
    def convert_to_torch_dtype(param_dtype: str) -> torch.dtype:
        return torch.float32 if param_dtype == "fp32" else upstream(param_dtype)

    upstream = replace(module, "convert_to_torch_dtype", convert_to_torch_dtype, patch=NAME)


def apply() -> bool:
    require_version("openrlhf", "==0.11.2", patch=NAME)
    after_import("openrlhf.utils.utils", _patch)
    return True
