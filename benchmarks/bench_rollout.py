"""Rollout precision benchmark: speed, weight-sync cost and induced mismatch of each vLLM variant.

    python benchmarks/bench_rollout.py [--model DIR] [--prompts 64 --tokens 64] [--repeats 3] [--variants a,b]

For each variant (fp32, bf16, bf16 + fp32 head (and with vLLM's own per-step head cast, the
cpu_fp32_head patch undone: bf16+fp32head-upstream), int8 (weight grid of this machine, or forced 8 / 7 bits:
int8-w8, int8-w7, or the coarser dose grids int8-w6, int8-w5, int8-w4), int8 + frozen scales, int8 + SmoothQuant
smoothing, int8 + smoothing + static activation scales everywhere (int8-static) or with the dynamic
fallback (int8-mixed, `--min_levels`), int8 + fp32 head, fp8) one in-process vLLM-CPU engine is
started, then:
1. rollout tokens/s: `--prompts` prompts x `--tokens` new tokens, sampled at temperature 1 after a
   warm-up generation (best of `--repeats`, and as a ratio to the bf16 engine of the same run);
2. weight sync: the "trainer" takes a step (Gaussian perturbation of all weights, bf16-rounded), the
   engine is synced through the fork's CPU reload path (re-quantization included for int8);
3. mismatch against the fp32 trainer on the new weights, over every sampled token: r = log pi - log mu,
   k3 KL = E[exp(r) - 1 - r] (Schulman's k3 estimator of KL(mu || pi), samples from mu),
   mean / max |pi - mu| in probability, and the fraction of ratios exp(r) outside [0.5, 2].
The calibrated variants (int8-smooth, int8-static, int8-mixed) share one calibration of the *initial* weights
(`--calibration_prompts`, JSONL with an "input" key; default: a built-in set of arithmetic/chat
prompts unlike the rollout prompts), transferred unchanged through the sync, as in a run.
Default model: the embedded SmolLM2-135M-Instruct (built on first use, openrlhf_tis/demo/default_model.py);
`--model tiny` builds a tiny random Qwen2 instead, whose numbers rank the variants' mismatch but say
little about speed.
"""

from __future__ import annotations

import argparse
import contextlib
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

from openrlhf_tis.rollout.calibration import DEFAULT_MIN_LEVELS  # noqa: E402

# name -> (precision, fp32_head, int8 scale mode, int8 calibration: None | "smooth" | "static" | "mixed",
#          int8 weight bits: None = this machine's choice, `--vllm.int8_weight_bits auto`)
VARIANTS = {
    "fp32": ("fp32", False, None, None, None),
    "bf16": ("bf16", False, None, None, None),
    "bf16+fp32head": ("bf16", True, None, None, None),
    "bf16+fp32head-upstream": ("bf16", True, None, None, None),  # vLLM's own head: cast at every step
    "int8": ("int8", False, "recompute", None, None),
    "int8-w8": ("int8", False, "recompute", None, 8),
    "int8-w7": ("int8", False, "recompute", None, 7),
    "int8-w6": ("int8", False, "recompute", None, 6),  # coarser grids: the mismatch dose axis (W6A8..W4A8)
    "int8-w5": ("int8", False, "recompute", None, 5),
    "int8-w4": ("int8", False, "recompute", None, 4),
    "int8-frozen": ("int8", False, "frozen", None, None),
    "int8-smooth": ("int8", False, "recompute", "smooth", None),
    "int8-static": ("int8", False, "recompute", "static", None),
    "int8-mixed": ("int8", False, "recompute", "mixed", None),
    "int8+fp32head": ("int8", True, "recompute", None, None),
    "fp8": ("fp8", False, None, None, None),
}
CALIBRATION_PROMPTS = [  # short arithmetic and chat prompts, phrased unlike the rollout prompts
    *(f"Compute {a} * {b} and explain each step." for a, b in [(7, 8), (12, 11), (23, 4), (9, 9), (15, 6), (31, 3)]),
    *(f"If I have {a} apples and eat {b}, how many are left?" for a, b in [(10, 3), (42, 17), (8, 8), (100, 55)]),
    *(f"Solve for x: {a}x + {b} = {c}." for a, b, c in [(2, 3, 11), (5, 10, 35), (3, 7, 1), (4, 0, 12)]),
    "Hello! Can you help me plan a short trip to the mountains?", "What is the capital of France?",
    "Write a haiku about the sea.", "Summarize the plot of Romeo and Juliet in two sentences.",
    "Give me three tips for learning a new language.", "Why is the sky blue?",
    "Translate 'good morning' into Spanish and German.", "List the first ten prime numbers.",
    "What is 15% of 240?", "Convert 3.5 hours into minutes.", "Is 221 a prime number? Explain.",
    "Explain recursion to a child.", "What is the derivative of x^3 + 2x?", "Tell me a joke about computers.",
    "How many days are there in a leap year?", "Round 7.456 to one decimal place.",
    "Which is larger, 2^10 or 10^3?", "Describe photosynthesis briefly.",
]


def _sync(worker, named):
    from openrlhf_tis.rollout.weight_sync.reload import reload_into_engine

    t0 = time.perf_counter()
    stats = reload_into_engine(worker.model_runner, named)
    return time.perf_counter() - t0, stats


def calibrate_once(src: Path, work: Path, prompts_file: str | None, alpha: float, min_levels: float,
                   kind: str) -> Path:
    """One calibration of the initial weights (smoothing + static input scales), shared by the int8-* variants."""
    from openrlhf_tis.rollout.calibration import calibrate_to_file

    texts = CALIBRATION_PROMPTS
    if prompts_file:
        with open(prompts_file, encoding="utf-8") as f:
            texts = [json.loads(line)["input"] for line in f if line.strip()]
    return calibrate_to_file(src, texts, work / f"calibration-{kind}.safetensors", alpha, static_activations=True,
                             min_levels=min_levels)


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


@contextlib.contextmanager
def upstream_fp32_head(enabled: bool):
    """Undo the cpu_fp32_head patch for one variant (in-process engine), to measure what it saves."""
    if not enabled:
        yield
        return
    from vllm.model_executor.layers.logits_processor import LogitsProcessor

    from openrlhf_tis.upstream_guards import upstream_original

    patched = LogitsProcessor._apply_head
    LogitsProcessor._apply_head = upstream_original(LogitsProcessor, "_apply_head")
    try:
        yield
    finally:
        LogitsProcessor._apply_head = patched


def run_variant(name: str, src: Path, work: Path, model_new, named_bf16, args, calibrations: dict[str, Path]) -> dict:
    with upstream_fp32_head(name.endswith("-upstream")):
        return _run_variant(name, src, work, model_new, named_bf16, args, calibrations)


def _run_variant(name: str, src: Path, work: Path, model_new, named_bf16, args, calibrations: dict[str, Path]) -> dict:
    from vllm import LLM, SamplingParams

    from openrlhf_tis.rollout.checkpoint import PLAN_FILE, write_rollout_model
    from openrlhf_tis.rollout.precision import engine_kwargs

    precision, fp32_head, scales, calibrated, bits = VARIANTS[name]
    model_dir = src
    if precision == "int8" or fp32_head:
        model_dir = write_rollout_model(src, work / name, precision="int8" if precision == "int8" else "bf16",
                                        scale_mode=scales or "recompute", fp32_head=fp32_head,
                                        calibration=calibrations.get(calibrated),
                                        activations="static" if calibrated in ("static", "mixed") else "dynamic",
                                        weight_bits=bits)
    kwargs = engine_kwargs(precision, model_dir, cuda=False)  # head dtype comes from config.json here
    t0 = time.perf_counter()
    llm = LLM(**kwargs, enforce_eager=True, max_model_len=256, seed=0, distributed_executor_backend="uni",
              logprobs_mode="processed_logprobs", max_logprobs=1)
    start_s = time.perf_counter() - t0
    prompts = [f"question {i}: what is {i} plus {2 * i}?" for i in range(args.prompts)]
    params = SamplingParams(temperature=1.0, max_tokens=args.tokens, logprobs=0, seed=1, ignore_eos=True)
    llm.generate(prompts[:4], params, use_tqdm=False)  # warm-up
    load1 = os.getloadavg()[0]  # the machine is shared: note its load next to the speed
    gen_s = []  # best of --repeats: the least disturbed run on a shared machine
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        gen_s.append(time.perf_counter() - t0)
    n_tok = sum(len(o.outputs[0].token_ids) for o in outs)

    named = named_bf16 if precision != "fp32" else [(n, t.float()) for n, t in named_bf16]
    sync_s, worker_s = [], []  # syncing the same weights again leaves the same engine state
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        seconds, stats = llm.collective_rpc(_sync, args=(named,))[0]
        worker_s.append(seconds)
        sync_s.append(time.perf_counter() - t0)
    outs = llm.generate(prompts, params, use_tqdm=False)
    train_lp, roll_lp = trainer_logprobs(model_new, outs)
    row = {"variant": name, "start_s": start_s, "tok_per_s": n_tok / min(gen_s), "load1": load1,
           "sync_s": min(sync_s), "reload_s": min(worker_s), **mismatch(train_lp, roll_lp)}
    if stats is not None:  # the last sync's re-quantization (INT8 engines)
        row.update(quantize_s=stats["quantize_s"], saturated=stats["saturated_fraction"],
                   max_rel_error=stats["max_rel_error"],
                   weight_bits=json.loads((Path(model_dir) / PLAN_FILE).read_text())["weight_bits"])
    del llm
    gc.collect()
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="HF model dir (fp32/bf16 safetensors), or 'tiny' for a tiny random Qwen2; "
                        "default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--hidden", type=int, default=128, help="hidden size of the built tiny model")
    parser.add_argument("--layers", type=int, default=2, help="layers of the built tiny model")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--step", type=float, default=0.02, help="std of the simulated training step (relative)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset (repeats allowed)")
    parser.add_argument("--calibration_prompts", help="JSONL ({'input': text}) for int8-smooth / int8-static")
    parser.add_argument("--alpha", type=float, default=0.5, help="SmoothQuant migration strength")
    parser.add_argument("--min_levels", type=float, default=DEFAULT_MIN_LEVELS,
                        help="int8-mixed: static where the median calibration token keeps this many int8 levels, "
                        "dynamic elsewhere (int8-static: 0)")
    parser.add_argument("--repeats", type=int, default=3, help="timed generations and syncs per variant (best kept)")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)

    from transformers import AutoModelForCausalLM

    from openrlhf_tis import patches

    patches.apply_platform_patches("cpu")  # vLLM-CPU engines in this process
    work = Path(tempfile.mkdtemp(prefix="bench_rollout_"))
    if args.model == "tiny":
        from openrlhf_tis.demo.tiny_model import build_tiny_model

        src = build_tiny_model(work / "tiny_model", hidden=args.hidden, layers=args.layers)
    else:
        from openrlhf_tis.demo.default_model import ensure_default_model

        src = Path(args.model) if args.model else ensure_default_model()
    names = args.variants.split(",")
    # Calibrated on the initial weights, then transferred; smoothing alone comes from either file.
    kinds = {VARIANTS[n][3] for n in names if n in VARIANTS} - {None}
    levels = {"static": 0.0, "mixed": args.min_levels}
    calibrations: dict[str, Path] = {}
    for kind in sorted({"smooth": "static"}.get(k, k) for k in kinds):
        calibrations[kind] = calibrate_once(src, work, args.calibration_prompts, args.alpha, levels[kind], kind)
    if "smooth" in kinds:
        calibrations["smooth"] = calibrations["static"]
    # The "trainer": bf16 weights (what --ds.param_dtype bf16 holds), scored in fp32 after one step.
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(args.step * p.abs().mean() * torch.randn_like(p))
    model.to(torch.bfloat16).to(torch.float32)
    named_bf16 = [(n, p.detach().to(torch.bfloat16)) for n, p in model.named_parameters()]

    rows = []
    for name in names:
        try:
            rows.append(run_variant(name, src, work, model, named_bf16, args, calibrations))
        except Exception as err:  # a variant that cannot run here is a result too
            rows.append({"variant": name, "error": f"{type(err).__name__}: {err}"[:200]})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)

    base = next((r["tok_per_s"] for r in rows if r["variant"] == "bf16" and "tok_per_s" in r), None)
    for row in rows:  # speed relative to the bf16 engine measured in this same run
        if base and "tok_per_s" in row:
            row["x_bf16"] = row["tok_per_s"] / base
    cols = ["variant", "weight_bits", "tok_per_s", "x_bf16", "load1", "start_s", "sync_s", "quantize_s", "saturated",
            "max_rel_error", "k3", "mean_abs_dlogp", "mean_dp", "max_dp", "out_0.5_2"]
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
