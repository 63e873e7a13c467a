"""Forward and forward+backward time of a causal LM in fp32 vs bf16 on this CPU, side by side.

Why: where the CPU has no native bf16 (plain AVX2), torch emulates it and a bf16 backward is far slower
than fp32, which is why the main job trains in fp32 there (`--ds.param_dtype fp32`). Prints one row per
dtype with the best of --repeats and the ratio to fp32.

    python benchmarks/bench_train_dtype.py [--model DIR] [--batch 4] [--tokens 64] [--repeats 2]
"""

from __future__ import annotations

import argparse
import time

import torch


def time_model(model_dir: str, dtype: torch.dtype, batch: int, tokens: int, repeats: int) -> tuple[float, float]:
    """Best forward and forward+backward seconds over `repeats`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa")
    ids = torch.randint(0, model.config.vocab_size, (batch, tokens), generator=torch.Generator().manual_seed(0))
    forward, both = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        with torch.no_grad():
            model(ids)
        forward.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        model(ids).logits.float().log_softmax(-1).mean().backward()
        both.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    return min(forward), min(both)


def main() -> None:
    from openrlhf_tis.cpu_features import native_bf16
    from openrlhf_tis.demo.default_model import default_model_dir

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=str(default_model_dir()), help="model directory (default: embedded SmolLM2)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    print(f"threads {torch.get_num_threads()}, native bf16: {native_bf16()}, batch {args.batch} x {args.tokens} tokens")
    rows = {name: time_model(args.model, dtype, args.batch, args.tokens, args.repeats)
            for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16))}
    base = rows["fp32"]
    print(f"{'dtype':6} {'forward s':>10} {'fwd+bwd s':>10} {'fwd+bwd / fp32':>15}")
    for name, (fwd, both) in rows.items():
        print(f"{name:6} {fwd:10.2f} {both:10.2f} {both / base[1]:15.2f}")


if __name__ == "__main__":
    main()
