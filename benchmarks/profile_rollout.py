"""Where a vLLM-CPU rollout spends its time, per precision: the ceiling on what INT8 can speed up.

    python benchmarks/profile_rollout.py [--model DIR] [--variants bf16,int8] [--prompts 64 --tokens 64]

Each variant starts one in-process engine, samples `--prompts` x `--tokens` tokens at temperature 1
with processed log-probs (what rollouts do), once to warm up, once timed, and a
`--profile_tokens` pass under torch.profiler.
Operators are grouped by what they do: decoder projections (the GEMMs INT8 quantizes, plus its
dynamic activation quantization), the lm_head GEMM (recognised by its vocabulary-wide output),
sampling, attention, log-probs, the rest. The table gives each group's share of the engine's CPU time
and the Amdahl ceiling: the speed-up if the projections cost nothing. Default model: the embedded
SmolLM2-135M-Instruct (built on first use, see openrlhf_tis/demo/default_model.py).
"""

from __future__ import annotations

import argparse
import gc
import os
import tempfile
import time
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

GROUPS = ("projections", "lm_head", "sampling", "attention", "logprobs", "other")


def op_group(name: str, output_shape: list | None, vocab: int) -> str:
    """The group of one profiled operator (its name and the shape of its first argument)."""
    if name in ("_C::onednn_mm", "_C::onednn_scaled_mm", "aten::mm", "aten::addmm", "aten::linear"):
        return "lm_head" if output_shape and output_shape[-1] == vocab else "projections"
    if name in ("_C::dynamic_scaled_int8_quant", "_C::static_scaled_int8_quant"):
        return "projections"
    if "gumbel" in name or "sampl" in name or "exponential" in name:
        return "sampling"
    if "attention" in name or "attn" in name or "kv_cache" in name:
        return "attention"
    if "log_softmax" in name or "logsumexp" in name:
        return "logprobs"
    return "other"


def profile_variant(name: str, src: Path, work: Path, args) -> dict:
    from torch.profiler import ProfilerActivity, profile
    from vllm import LLM, SamplingParams

    from openrlhf_tis.rollout.checkpoint import read_config, write_rollout_model
    from openrlhf_tis.rollout.precision import engine_kwargs

    model_dir = write_rollout_model(src, work / name, precision="int8") if name == "int8" else src
    llm = LLM(**engine_kwargs(name, model_dir, cuda=False), enforce_eager=True, max_model_len=256, seed=0,
              distributed_executor_backend="uni", logprobs_mode="processed_logprobs", max_logprobs=1)
    prompts = [f"question {i}: what is {i} plus {2 * i}?" for i in range(args.prompts)]
    params = SamplingParams(temperature=1.0, max_tokens=args.tokens, logprobs=0, seed=1, ignore_eos=True)
    llm.generate(prompts[:4], params, use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    tok_per_s = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)
    # Shapes make the profile heavy: a shorter pass of the same batch is profiled.
    short = SamplingParams(temperature=1.0, max_tokens=args.profile_tokens, logprobs=0, seed=1, ignore_eos=True)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        llm.generate(prompts, short, use_tqdm=False)
    vocab = read_config(src)["vocab_size"]
    seconds: dict[str, float] = defaultdict(float)
    for event in prof.key_averages(group_by_input_shape=True):
        shapes = event.input_shapes[0] if event.input_shapes else None
        seconds[op_group(event.key, shapes, vocab)] += event.self_cpu_time_total / 1e6
    del llm
    gc.collect()
    total = sum(seconds.values())
    row = {"variant": name, "tok_per_s": tok_per_s, "cpu_s": total}
    row.update({g: seconds[g] / total for g in GROUPS})
    row["ceiling"] = 1 / (1 - row["projections"])  # speed-up if the projections were free
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="HF model dir; default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--variants", default="bf16,int8", help="comma-separated: fp32, bf16, int8, fp8")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--profile_tokens", type=int, default=16, help="new tokens in the profiled pass")
    args = parser.parse_args(argv)

    from rich.console import Console
    from rich.table import Table

    from openrlhf_tis import patches
    from openrlhf_tis.demo.default_model import ensure_default_model

    patches.apply_platform_patches("cpu")  # vLLM-CPU engines in this process
    src = Path(args.model) if args.model else ensure_default_model()
    work = Path(tempfile.mkdtemp(prefix="profile_rollout_"))
    rows = [profile_variant(v, src, work, args) for v in args.variants.split(",")]
    table = Table(title=f"rollout CPU time by operator group ({src.name}, {args.prompts}x{args.tokens} tokens)")
    for col in ("variant", "tok/s", "cpu s", *GROUPS, "ceiling"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["variant"], f"{r['tok_per_s']:.0f}", f"{r['cpu_s']:.2f}",
                      *(f"{100 * r[g]:.1f}%" for g in GROUPS), f"{r['ceiling']:.2f}x")
    Console(width=200).print(table)
    base = rows[0]
    for r in rows[1:]:
        print(f"{r['variant']} vs {base['variant']}: {r['tok_per_s'] / base['tok_per_s']:.2f}x tok/s, "
              f"projections {base['projections'] * base['cpu_s'] / (r['projections'] * r['cpu_s']):.2f}x faster")


if __name__ == "__main__":
    main()
