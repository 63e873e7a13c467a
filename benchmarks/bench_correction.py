"""Cost of the rollout correction, side by side in one run.

Part 1, on a B×T batch (default 256×1024): the policy loss (forward + backward w.r.t. π_θ) with
    - upstream OpenRLHF 0.11.2 PolicyLoss, correction off            (the baseline, ratio 1.00)
    - upstream PolicyLoss with its own correction (token ICEPOP mask)
    - the fork, correction off (metrics only), token TIS and the full MIS preset with every metric, eager
      and compiled; the last line gives the eager TIS and MIS ratios to upstream (target: at most 3)
and the bare core (weights + masks, no metrics) against one fused elementwise pass over the same
tensors (`where(mask, min(exp(old − rollout), U), 0)` compiled into one kernel).

Part 2, on the tiny model of the integration test (openrlhf_tis.demo.tiny_model): an actor training
step (bf16 forward + backward of the log-probs of a 16×96 micro-batch) against the cost of all the
correction metrics on that micro-batch, and the π_old forward that bypass mode skips.

    python benchmarks/bench_correction.py [--batch 256 --seq 1024 --repeats 10 --no-compile --device cuda]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable

import torch

from openrlhf_tis.correction import compute_correction, policy_loss, preset


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timeit(fn: Callable[[], object], repeats: int, device: str, warmup: int = 2) -> float:
    """Best wall time of fn() in seconds (the minimum: other jobs on a shared machine only add time)."""
    return time_all({"_": fn}, repeats, device, warmup)["_"]


def time_all(fns: dict[str, Callable[[], object]], repeats: int, device: str, warmup: int = 2) -> dict[str, float]:
    """Best wall time of each fn, measured round-robin so load changes hit every candidate alike."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    _sync(device)
    best = {name: float("inf") for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            _sync(device)
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def make_batch(B: int, T: int, device: str, seed: int = 0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    old = (torch.randn(B, T, generator=g) * 0.8 - 1.5).clamp(max=-1e-3)
    roll = old + torch.randn(B, T, generator=g) * 0.1
    lp = old + torch.randn(B, T, generator=g) * 0.05
    adv = torch.randn(B, 1, generator=g).expand(B, T).contiguous()
    lengths = torch.randint(T // 4, T + 1, (B,), generator=g)
    am = (torch.arange(T)[None, :] < lengths[:, None]).float()
    return [t.to(device) for t in (lp, old, roll, adv, am)]


def part1(args, upstream_policy_loss) -> None:
    lp0, old, roll, adv, am = make_batch(args.batch, args.seq, args.device)
    counts = {"batch_num_tokens": am.sum(), "global_batch_size": float(args.batch), "dp_size": 1}
    tis, mis = preset("tis"), preset("mis_full")

    def loss_step(loss_fn):
        def run():
            lp = lp0.clone().requires_grad_(True)
            loss_fn(lp).backward()
        return run

    fns: dict[str, Callable[[], object]] = {}
    if upstream_policy_loss is not None:
        off = upstream_policy_loss()
        icepop = upstream_policy_loss(is_correction_level="token", is_correction_mode="mask",
                                      is_correction_threshold=[0.5, 5.0])
        fns["upstream PolicyLoss, no correction"] = loss_step(lambda lp: off(lp, old, adv, am, roll, **counts)[0])
        fns["upstream PolicyLoss, its own correction (token ICEPOP)"] = loss_step(
            lambda lp: icepop(lp, old, adv, am, roll, **counts)[0])
    fns["fork, correction off + all metrics"] = loss_step(
        lambda lp: policy_loss(lp, old, adv, am, roll, preset("off"), **counts).loss)
    fns["fork, token TIS (tis) + all metrics, eager"] = loss_step(
        lambda lp: policy_loss(lp, old, adv, am, roll, tis, **counts).loss)
    fns["fork, full MIS (mis_full) + all metrics, eager"] = loss_step(
        lambda lp: policy_loss(lp, old, adv, am, roll, mis, **counts).loss)
    fns["fork, full MIS, no metrics, eager"] = loss_step(
        lambda lp: policy_loss(lp, old, adv, am, roll, mis, with_metrics=False, **counts).loss)
    if args.compile:
        mis_c = mis.replace(compile=True)
        fns["fork, full MIS + all metrics, compiled"] = loss_step(
            lambda lp: policy_loss(lp, old, adv, am, roll, mis_c, **counts).loss)
    times = time_all(fns, args.repeats, args.device)
    base_name, base = next(iter(times.items()))
    print(f"\n== policy loss forward+backward on {args.batch}x{args.seq} tokens ({args.device}) ==")
    print(f"{'configuration':58s} {'ms':>9s} {'ratio':>7s}   (ratio: x the first row)")
    for name, t in times.items():
        print(f"{name:58s} {t * 1e3:9.2f} {t / base:7.2f}")
    ratios = [times[f"fork, {row} + all metrics, eager"] / base for row in ("token TIS (tis)", "full MIS (mis_full)")]
    print(f"eager tis / mis_full with all metrics: {ratios[0]:.2f}x / {ratios[1]:.2f}x {base_name} (target <= 3x)")

    # ── the bare core against one fused elementwise pass over the same tensors ──
    U = mis.upper

    def fused(o, r, m):
        return torch.where(m > 0, torch.exp(o - r).clamp(max=U), 0.0)

    fns = {"one eager elementwise op (old − rollout)": lambda: old - roll,
           "fused pass, eager (4 ops)": lambda: fused(old, roll, am)}
    if args.compile:
        fused_c = torch.compile(fused, dynamic=True)
        fns["fused pass, compiled (1 kernel)  <- reference"] = lambda: fused_c(old, roll, am)
    for name in ("tis", "mis_full"):
        cfg = preset(name)
        fns[f"core {name}, eager, no metrics"] = lambda c=cfg: compute_correction(old, roll, am, c,
                                                                                  with_metrics=False)
        fns[f"core {name}, eager, all metrics"] = lambda c=cfg: compute_correction(old, roll, am, c)
        if args.compile:
            cc = cfg.replace(compile=True)
            fns[f"core {name}, compiled, no metrics"] = lambda c=cc: compute_correction(old, roll, am, c,
                                                                                        with_metrics=False)
            fns[f"core {name}, compiled, all metrics"] = lambda c=cc: compute_correction(old, roll, am, c)
    times = time_all(fns, args.repeats, args.device)
    ref_name = "fused pass, compiled (1 kernel)  <- reference" if args.compile else "fused pass, eager (4 ops)"
    ref = times[ref_name]
    print(f"\n== correction core vs one fused elementwise pass ({args.batch}x{args.seq}) ==")
    print(f"{'kernel':58s} {'ms':>9s} {'x fused':>7s}")
    for name, t in times.items():
        print(f"{name:58s} {t * 1e3:9.3f} {t / ref:7.2f}")


def part2(args) -> None:
    from transformers import Qwen2ForCausalLM

    from openrlhf_tis.demo.tiny_model import build_tiny_model

    B, T, resp = 16, 96, 64
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_model(tmp)
        model = Qwen2ForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(args.device)
    model.train()
    g = torch.Generator().manual_seed(0)
    seqs = torch.randint(0, model.config.vocab_size, (B, T), generator=g).to(args.device)
    am = torch.ones(B, resp, device=args.device)

    def log_probs():
        logits = model(seqs).logits[:, :-1].float()
        lp = torch.log_softmax(logits, -1).gather(-1, seqs[:, 1:, None]).squeeze(-1)
        return lp[:, -resp:]

    with torch.no_grad():
        old = log_probs()
        roll = old + torch.randn(old.shape, generator=g).to(args.device) * 0.05
    adv = torch.randn(B, 1, generator=g).expand(B, resp).contiguous().to(args.device)

    def train_step():
        model.zero_grad(set_to_none=True)
        out = policy_loss(log_probs(), old, adv, am, roll, preset("off"), with_metrics=False)
        out.loss.backward()

    def old_forward():
        with torch.no_grad():
            log_probs()

    fns: dict[str, Callable[[], object]] = {"step": train_step, "fwd": old_forward}
    for name in ("tis", "mis_full"):
        for compiled in ([False, True] if args.compile else [False]):
            c = preset(name, compile=compiled)
            tag = f"{name}{', compiled' if compiled else ''}"
            fns[f"{tag}: core + all metrics"] = lambda c=c: compute_correction(old, roll, am, c, log_probs=old)
            fns[f"{tag}: bare core"] = lambda c=c: compute_correction(old, roll, am, c, with_metrics=False)
    times = time_all(fns, args.repeats, args.device)
    step, fwd = times.pop("step"), times.pop("fwd")
    print(f"\n== tiny model (2 layers, hidden 128), micro-batch {B}x{T} ({resp} response tokens), bf16 "
          f"({args.device}) ==")
    print(f"{'actor training step (forward + backward)':58s} {step * 1e3:9.2f} ms")
    print(f"{'π_old forward that bypass mode skips':58s} {fwd * 1e3:9.2f} ms  ({fwd / step:6.1%} of a step)")
    for name, t in times.items():
        print(f"{name:58s} {t * 1e3:9.3f} ms  ({t / step:6.2%} of a step)")
        if name.endswith("bare core"):
            metrics_only = max(times[name.replace("bare core", "core + all metrics")] - t, 0.0)
            label = name.replace("bare core", "all metrics alone")
            print(f"{label:58s} {metrics_only * 1e3:9.3f} ms  ({metrics_only / step:6.2%} of a step)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--no-compile", dest="compile", action="store_false", help="skip the torch.compile rows")
    ap.add_argument("--no-upstream", dest="upstream", action="store_false", help="skip upstream's PolicyLoss rows")
    ap.add_argument("--skip-model", action="store_true", help="skip part 2 (the tiny-model training step)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, device {args.device}")

    upstream = None
    if args.upstream:
        from openrlhf_tis import patches

        patches.apply_platform_patches()  # upstream imports flash_attn at module level
        from openrlhf.models import PolicyLoss as upstream
    part1(args, upstream)
    if not args.skip_model:
        part2(args)


if __name__ == "__main__":
    main()
