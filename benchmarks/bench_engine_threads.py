"""How many threads the CPU rollout engine computes with, and what a second one does, side by side.

Why: generation is a fifth of a study cell (docs/measurements.md, fourteenth sitting), and during it the rollout
engine's process (VLLM::EngineCore, a child of the rollout actor: upstream's async engine always runs its core in a
process of its own) used one core of two while the trainer waited. The engine inherits OMP_NUM_THREADS=1 from its
Ray actor: upstream asks for `num_cpus=num_gpus` for it, and Ray sets an actor's OMP_NUM_THREADS to its CPUs rounded
down, at least 1, when nobody set it. vLLM's own binding for the CPU backend would give it the cores less one reserved
for the scheduler, which on 2 cores is also 1. Whether a second thread pays depends on what else runs: an OpenMP
team larger than the free cores spin-waits. Each variant samples 64 prompts × `--samples` × 32 new tokens from a
fresh in-process engine on the given model, in its own process, variants interleaved rep by rep:

    python benchmarks/bench_engine_threads.py --model <model folder> --reps 2 [--samples 1]   # ≈ 1-5 min a variant

The engine's start is timed apart from its generation. Times are wall clock: run it on an idle machine (the case a
synchronous run's generation sees) and again beside a busy core (CI's two test workers, an async run), and say
which (uptime).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import json, os, sys, time
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
import torch
from vllm import LLM, SamplingParams
model, dtype = sys.argv[1], sys.argv[2]
t0 = time.perf_counter()
llm = LLM(model=model, dtype=dtype, enforce_eager=True, max_model_len=256, seed=0,
          distributed_executor_backend="uni", enable_chunked_prefill=False)
t1 = time.perf_counter()
prompts = [f"Question {i}: what is {i} plus {2 * i + 1}? Answer with a number." for i in range(64)]
params = SamplingParams(n=int(sys.argv[3]), temperature=1.0, max_tokens=32, min_tokens=32, seed=1)
out = llm.generate(prompts, params, use_tqdm=False)
t2 = time.perf_counter()
tokens = sum(len(c.token_ids) for o in out for c in o.outputs)
print(json.dumps({"start_s": t1 - t0, "generate_s": t2 - t1, "tokens": tokens, "threads": torch.get_num_threads()}))
"""


def variants(cpus: int) -> dict[str, dict[str, str]]:
    """Environment overrides: one thread (what the rollout actor's engine gets) and one per core."""
    return {"1 thread (as shipped)": {"OMP_NUM_THREADS": "1"}, f"{cpus} threads": {"OMP_NUM_THREADS": str(cpus)}}


def run_variant(model: str, dtype: str, samples: int, overrides: dict[str, str]) -> dict[str, float]:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"} | overrides
    done = subprocess.run([sys.executable, "-c", CHILD, model, dtype, str(samples)], env=env, capture_output=True,
                          text=True, timeout=900, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="a local model folder (e.g. the default model's)")
    parser.add_argument("--dtype", default="float32", help="the engine's dtype (default float32, the fp32 profile's)")
    parser.add_argument("--samples", type=int, default=4, help="samples per prompt (default 4: a training step's)")
    parser.add_argument("--reps", type=int, default=2)
    args = parser.parse_args()
    cpus = len(os.sched_getaffinity(0))
    found: dict[str, list[dict[str, float]]] = {name: [] for name in variants(cpus)}
    for rep in range(args.reps):
        for name, overrides in variants(cpus).items():
            found[name].append(run_variant(args.model, args.dtype, args.samples, overrides))
            print(f"rep {rep + 1} {name}: {found[name][-1]}", file=sys.stderr)
    base = statistics.median(r["generate_s"] for r in found["1 thread (as shipped)"])
    print(f"| variant | torch threads | engine start (s) | generate 64 × {args.samples} × 32 tokens (s) | tokens/s | "
          "generate vs 1 thread |\n|---|---|---|---|---|---|")
    for name, runs in found.items():
        generate = statistics.median(r["generate_s"] for r in runs)
        start = statistics.median(r["start_s"] for r in runs)
        print(f"| {name} | {runs[0]['threads']} | {start:.1f} | {generate:.2f} | {runs[0]['tokens'] / generate:.0f} | "
              f"{generate / base:.2f} |")


if __name__ == "__main__":
    main()
