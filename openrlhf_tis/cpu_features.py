"""What the CPU computes natively, for choosing defaults that keep a CPU run short."""

from __future__ import annotations


def native_bf16() -> bool:
    """True where the CPU computes bf16 in hardware (AVX-512 BF16 / AMX); elsewhere torch emulates it and a
    SmolLM2-135M backward pass is 5-25x slower than in fp32 (docs/measurements.md)."""
    import torch

    caps = torch._C._cpu._get_cpu_capability()
    return bool(caps.get("avx512_bf16") or caps.get("amx_bf16"))


def default_train_dtype() -> str:
    """`--ds.param_dtype` for a run that did not choose: bf16 on CUDA or native-bf16 CPUs, else fp32."""
    import torch

    return "bf16" if torch.cuda.is_available() or native_bf16() else "fp32"
