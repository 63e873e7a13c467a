"""Rollout precision benchmark: speed, weight-sync cost and induced mismatch of each vLLM variant.

    python benchmarks/bench_rollout.py [--model DIR] [--prompts 32 --tokens 32]

For each variant (fp32, bf16, bf16 + fp32 head, int8, int8 + frozen scales, int8 + fp32 head, fp8)
one in-process vLLM-CPU engine is started, then:
1. rollout tokens/s: `--prompts` prompts x `--tokens` new tokens, sampled at temperature 1 (after a
   warm-up generation);
2. weight sync: the "trainer" takes a step (Gaussian perturbation of all weights, bf16-rounded), the
   engine is synced through the fork's CPU reload path (re-quantization included for int8);
3. mismatch against the fp32 trainer on the new weights, over every sampled token: r = log pi - log mu,
   k3 KL = E[exp(r) - 1 - r] (Schulman's k3 estimator of KL(mu || pi), samples from mu),
   mean / max |pi - mu| in probability, and the fraction of ratios exp(r) outside [0.5, 2].
Without --model a tiny random Qwen2 is built (no real model is embedded yet): its numbers rank the
variants but say little about absolute speed-ups on a real model.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

VARIANTS = {  # name -> (precision, fp32_head, int8 scale mode)
    "fp32": ("fp32", False, None),
    "bf16": ("bf16", False, None),
    "bf16+fp32head": ("bf16", True, None),
    "int8": ("int8", False, "recompute"),
    "int8-frozen": ("int8", False, "frozen"),
    "int8+fp32head": ("int8", True, "recompute"),
    "fp8": ("fp8", False, None),
}


def _sync(worker, named):
    from openrlhf_tis.patches.cpu_weight_sync import reload_into_engine

    t0 = time.perf_counter()
    reload_into_engine(worker.model_runner, named)
    return time.perf_counter() - t0


def trainer_logprobs(model, outputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(trainer fp32 log-probs, rollout log-probs) of every sampled token."""
    train, roll = [], []
    with torch.no_grad():
        for o in outputs:
            c = o.outputs[0]
            ids = list(o.prompt_token_ids) + list(c.token_ids)
            logits = model(torch.tensor([ids])).logits[0, len(o.prompt_token_ids) - 1:-1].float()
            train.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(list(c.token_ids))[:, None])[:, 0])
            roll.append(torch.tensor([c.logprobs[i][t].logprob for i, t in enumerate(c.token_ids)]))
    return torch.cat(train), torch.cat(roll)


def mismatch(train_lp: torch.Tensor, roll_lp: torch.Tensor) -> dict:
    r = (train_lp - roll_lp).double()
    dp = (train_lp.exp() - roll_lp.exp()).abs()
    ratio = r.exp()
    return {"k3": float((ratio - 1 - r).mean()), "mean_dp": float(dp.mean()), "max_dp": float(dp.max()),
            "out_0.5_2": float(((ratio < 0.5) | (ratio > 2)).double().mean()),
            "mean_abs_dlogp": float(r.abs().mean())}


def run_variant(name: str, src: Path, work: Path, model_new, named_bf16, args) -> dict:
    from vllm import LLM, SamplingParams

    from openrlhf_tis.rollout.checkpoint import write_rollout_model
    from openrlhf_tis.rollout.precision import engine_kwargs

    precision, fp32_head, scales = VARIANTS[name]
    model_dir = src
    if precision == "int8" or fp32_head:
        model_dir = write_rollout_model(src, work / name, precision="int8" if precision == "int8" else "bf16",
                                        scale_mode=scales or "recompute", fp32_head=fp32_head)
    kwargs = engine_kwargs(precision, model_dir, cuda=False)  # head dtype comes from config.json here
    t0 = time.perf_counter()
    llm = LLM(**kwargs, enforce_eager=True, max_model_len=256, seed=0, distributed_executor_backend="uni",
              logprobs_mode="processed_logprobs", max_logprobs=1)
    start_s = time.perf_counter() - t0
    prompts = [f"question {i}: what is {i} plus {2 * i}?" for i in range(args.prompts)]
    params = SamplingParams(temperature=1.0, max_tokens=args.tokens, logprobs=0, seed=1, ignore_eos=True)
    llm.generate(prompts[:4], params, use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    gen_s = time.perf_counter() - t0
    n_tok = sum(len(o.outputs[0].token_ids) for o in outs)

    named = named_bf16 if precision != "fp32" else [(n, t.float()) for n, t in named_bf16]
    t0 = time.perf_counter()
    worker_s = llm.collective_rpc(_sync, args=(named,))[0]
    sync_s = time.perf_counter() - t0
    outs = llm.generate(prompts, params, use_tqdm=False)
    train_lp, roll_lp = trainer_logprobs(model_new, outs)
    row = {"variant": name, "start_s": start_s, "tok_per_s": n_tok / gen_s, "sync_s": sync_s, "reload_s": worker_s,
           **mismatch(train_lp, roll_lp)}
    stats_file = Path(model_dir) / "sync_stats.jsonl"
    if precision == "int8" and stats_file.exists():
        last = json.loads(stats_file.read_text().splitlines()[-1])
        row.update(quantize_s=last["quantize_s"], saturated=last["saturated_fraction"])
    del llm
    gc.collect()
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="HF model dir (fp32/bf16 safetensors); default: a tiny random Qwen2")
    parser.add_argument("--hidden", type=int, default=128, help="hidden size of the built tiny model")
    parser.add_argument("--layers", type=int, default=2, help="layers of the built tiny model")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--step", type=float, default=0.02, help="std of the simulated training step (relative)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)

    from transformers import AutoModelForCausalLM

    from openrlhf_tis import patches

    patches.apply_platform_patches()
    work = Path(tempfile.mkdtemp(prefix="bench_rollout_"))
    if args.model:
        src = Path(args.model)
    else:
        from openrlhf_tis.demo.tiny_model import build_tiny_model

        src = build_tiny_model(work / "tiny_model", hidden=args.hidden, layers=args.layers)
    # The "trainer": bf16 weights (what --ds.param_dtype bf16 holds), scored in fp32 after one step.
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(args.step * p.abs().mean() * torch.randn_like(p))
    model.to(torch.bfloat16).to(torch.float32)
    named_bf16 = [(n, p.detach().to(torch.bfloat16)) for n, p in model.named_parameters()]

    rows = []
    for name in args.variants.split(","):
        try:
            rows.append(run_variant(name, src, work, model, named_bf16, args))
        except Exception as err:  # a variant that cannot run here is a result too
            rows.append({"variant": name, "error": f"{type(err).__name__}: {err}"[:200]})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)

    cols = ["variant", "tok_per_s", "start_s", "sync_s", "quantize_s", "saturated", "k3", "mean_abs_dlogp",
            "mean_dp", "max_dp", "out_0.5_2"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for row in rows:
        if "error" in row:
            print(f"| {row['variant']} | error: {row['error']} |")
            continue
        cells = [row["variant"]] + [("-" if row.get(c) is None else f"{row[c]:.3g}") for c in cols[1:]]
        print("| " + " | ".join(cells) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
