"""Cost of the rollout correction, side by side in one run.

Part 1, on a B×T batch (default 256×1024): the policy loss (forward + backward w.r.t. π_θ) with
    - upstream OpenRLHF 0.11.2 PolicyLoss, correction off            (the baseline, ratio 1.00)
    - upstream PolicyLoss with its own correction (token ICEPOP mask)
    - the fork, correction off (metrics only), token TIS, adaptive TIS (its cap chosen per call: a sort of the
      call's ratios) and the full MIS preset with every metric, eager;
      then with the metrics pass compiled (`--algo.correction.compile_metrics`, the default on CUDA) and
      with the whole correction compiled (`--algo.correction.compile`)
each with its time, its kernel count per call (torch.profiler: CUDA kernels on a GPU; on CPU the aten
operations it dispatches, views and allocations left out, plus Inductor's fused kernels, each of which
launches about one kernel on a GPU) and its peak memory above what the call's inputs hold, each as a ratio
to upstream's (targets: time and kernels ≤ 2×, memory ≤ 1.25×). Then the bare core (weights + masks, no
metrics) against one fused elementwise pass over the same tensors (`where(mask, min(exp(old − rollout), U),
0)` compiled into one kernel).

Part 2, on the tiny model of the integration test (openrlhf_tis.demo.tiny_model): an actor training
step (bf16 forward + backward of the log-probs of a 16×96 micro-batch) against the cost of all the
correction metrics on that micro-batch, and the π_old forward that bypass mode skips.

    python benchmarks/bench_correction.py [--batch 256 --seq 1024 --repeats 10 --no-compile --device cuda]

benchmarks/gpu_check.py reuses the measurements (`loss_costs`).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from types import ModuleType

import torch
import torch._inductor.config as inductor_config
from torch.profiler import ProfilerActivity, profile

from openrlhf_tis import correction

inductor_config.cpp.enable_kernel_profile = True  # Inductor's CPU kernels show in a profile (set before compiling)

# Operations that launch no kernel: views, allocations, metadata, and the host side of a transfer.
_NO_KERNEL = frozenset(f"aten::{name}" for name in (
    "empty", "empty_like", "empty_strided", "view", "reshape", "_reshape_alias", "_unsafe_view", "as_strided",
    "expand", "squeeze", "unsqueeze", "unbind", "select", "slice", "alias", "detach", "t", "transpose", "permute",
    "contiguous", "to", "_to_copy", "lift_fresh", "result_type", "resize_", "set_", "resolve_conj", "resolve_neg",
    "is_nonzero", "size", "stride", "promote_types"))


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_all(fns: dict[str, Callable[[], object]], repeats: int, device: str, warmup: int = 2) -> dict[str, float]:
    """Best wall time of each fn in seconds (the minimum: other jobs on a shared machine only add time), measured
    round-robin so load changes hit every candidate alike."""
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


def _dispatched(event) -> bool:
    """An op that launches a kernel: a non-view aten op, or a kernel Inductor generated for the CPU."""
    return (event.name.startswith("aten::") and event.name not in _NO_KERNEL) or "cpp_fused" in event.name


def kernel_count(fn: Callable[[], object], device: str) -> int:
    """Kernels one call of fn launches (after two warm-up calls): CUDA kernels, memcpys and memsets on a GPU;
    on CPU the outermost kernel-launching operations (see the module docstring)."""
    fn()
    fn()
    _sync(device)
    cuda = device.startswith("cuda")
    with profile(activities=[ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]) as prof:
        fn()
        _sync(device)
    events = prof.events()
    if cuda:
        return sum(e.device_type == torch.autograd.DeviceType.CUDA for e in events)

    def outermost(e) -> bool:
        parent = e.cpu_parent
        while parent is not None:
            if _dispatched(parent):
                return False
            parent = parent.cpu_parent
        return True

    return sum(_dispatched(e) and outermost(e) for e in events)


def peak_memory(fn: Callable[[], object], device: str) -> int:
    """Bytes above what was allocated before one call of fn, at the call's peak (after a warm-up call). On
    CPU from the profiler's allocation records, replayed in time order."""
    fn()
    _sync(device)
    if device.startswith("cuda"):
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        _sync(device)
        return torch.cuda.max_memory_allocated() - base
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    changes = sorted((e.time_range.start, e.self_cpu_memory_usage) for e in prof.events() if e.self_cpu_memory_usage)
    held = peak = 0
    for _, change in changes:
        held += change
        peak = max(peak, held)
    return peak


def make_batch(B: int, T: int, device: str, seed: int = 0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    old = (torch.randn(B, T, generator=g) * 0.8 - 1.5).clamp(max=-1e-3)
    roll = old + torch.randn(B, T, generator=g) * 0.1
    lp = old + torch.randn(B, T, generator=g) * 0.05
    adv = torch.randn(B, 1, generator=g).expand(B, T).contiguous()
    lengths = torch.randint(T // 4, T + 1, (B,), generator=g)
    am = (torch.arange(T)[None, :] < lengths[:, None]).float()
    return [t.to(device) for t in (lp, old, roll, adv, am)]


def loss_steps(batch: list[torch.Tensor], upstream_policy_loss: type | None, compile: bool,
               fork: ModuleType = correction) -> dict[str, Callable[[], object]]:
    """One forward + backward of each policy loss row of part 1 on `batch` (make_batch's), upstream's first
    when given. `fork` is the module with `policy_loss` and `preset` (another revision's, to compare)."""
    lp0, old, roll, adv, am = batch
    counts = {"batch_num_tokens": am.sum(), "global_batch_size": float(am.shape[0]), "dp_size": 1}

    def step(loss_fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[], None]:
        def run() -> None:
            lp = lp0.clone().requires_grad_(True)
            loss_fn(lp).backward()
        return run

    def fork_step(name: str, with_metrics: bool = True, **options) -> Callable[[], None]:
        if _has_compile_metrics(fork):  # eager unless a row asks otherwise, on every device
            options = {"compile_metrics": "off", **options}
        cfg = fork.preset(name, **options)
        return step(lambda lp: fork.policy_loss(lp, old, adv, am, roll, cfg, with_metrics=with_metrics,
                                                **counts).loss)

    steps: dict[str, Callable[[], None]] = {}
    if upstream_policy_loss is not None:
        off = upstream_policy_loss()
        icepop = upstream_policy_loss(is_correction_level="token", is_correction_mode="mask",
                                      is_correction_threshold=[0.5, 5.0])
        steps["upstream PolicyLoss, no correction"] = step(lambda lp: off(lp, old, adv, am, roll, **counts)[0])
        steps["upstream PolicyLoss, its own correction (token ICEPOP)"] = step(
            lambda lp: icepop(lp, old, adv, am, roll, **counts)[0])
    rows = {name: label for name, label in EAGER_ROWS.items() if name in fork.PRESETS}  # an older revision's
    for name, label in rows.items():
        steps[label] = fork_step(name)
    steps["fork, mis_full, no metrics"] = fork_step("mis_full", with_metrics=False)
    if compile and _has_compile_metrics(fork):
        for name, label in COMPILED_METRICS_ROWS.items():
            if name in fork.PRESETS:
                steps[label] = fork_step(name, compile_metrics="on")
    if compile:
        steps["fork, mis_full + all metrics, whole correction compiled"] = fork_step("mis_full", compile=True)
    return steps


EAGER_ROWS = {"off": "fork, off (metrics only) + all metrics, eager",
              "tis": "fork, tis + all metrics, eager",
              "adaptive": "fork, adaptive + all metrics, eager",
              "mis_full": "fork, mis_full + all metrics, eager"}
COMPILED_METRICS_ROWS = {"off": "fork, off + all metrics, metrics compiled",
                         "tis": "fork, tis + all metrics, metrics compiled",
                         "adaptive": "fork, adaptive + all metrics, metrics compiled",
                         "mis_full": "fork, mis_full + all metrics, metrics compiled"}


def _has_compile_metrics(fork: ModuleType) -> bool:
    return "compile_metrics" in fork.CorrectionConfig.__dataclass_fields__


def loss_costs(steps: dict[str, Callable[[], object]], repeats: int, device: str) -> dict[str, dict[str, float]]:
    """{row: {ms, kernels, peak_mib}} of each step; ratios are to the first row."""
    times = time_all(steps, repeats, device)
    return {name: {"ms": times[name] * 1e3, "kernels": kernel_count(fn, device),
                   "peak_mib": peak_memory(fn, device) / 2**20} for name, fn in steps.items()}


def print_costs(costs: dict[str, dict[str, float]], title: str) -> None:
    base = next(iter(costs.values()))
    print(f"\n== {title} ==")
    ratio = f"{'ratio':>6s}"
    print(f"{'configuration':58s} {'ms':>9s} {ratio} {'kernels':>8s} {ratio} {'peak MiB':>9s} {ratio}")
    for name, c in costs.items():
        print(f"{name:58s} {c['ms']:9.2f} {c['ms'] / base['ms']:6.2f} {c['kernels']:8d} "
              f"{c['kernels'] / base['kernels']:6.2f} {c['peak_mib']:9.1f} {c['peak_mib'] / base['peak_mib']:6.2f}")
    print("(ratios: x the first row; targets for the fork with all metrics: time and kernels <= 2x, memory <= 1.25x)")


def part1(args, upstream_policy_loss) -> None:
    batch = make_batch(args.batch, args.seq, args.device)
    costs = loss_costs(loss_steps(batch, upstream_policy_loss, args.compile), args.repeats, args.device)
    print_costs(costs, f"policy loss forward+backward on {args.batch}x{args.seq} tokens ({args.device})")

    # ── the bare core against one fused elementwise pass over the same tensors ──
    _, old, roll, _, am = batch
    mis = correction.preset("mis_full", compile_metrics="off")
    U = mis.upper

    def fused(o, r, m):
        return torch.where(m > 0, torch.exp(o - r).clamp(max=U), 0.0)

    fns = {"one eager elementwise op (old − rollout)": lambda: old - roll,
           "fused pass, eager (4 ops)": lambda: fused(old, roll, am)}
    if args.compile:
        fused_c = torch.compile(fused, dynamic=True)
        fns["fused pass, compiled (1 kernel)  <- reference"] = lambda: fused_c(old, roll, am)
    for name in ("tis", "adaptive", "mis_full"):
        cfg = correction.preset(name, compile_metrics="off")
        fns[f"core {name}, eager, no metrics"] = lambda c=cfg: correction.compute_correction(old, roll, am, c,
                                                                                             with_metrics=False)
        fns[f"core {name}, eager, all metrics"] = lambda c=cfg: correction.compute_correction(old, roll, am, c)
        if args.compile:
            cc = cfg.replace(compile=True)
            fns[f"core {name}, compiled, no metrics"] = lambda c=cc: correction.compute_correction(
                old, roll, am, c, with_metrics=False)
            fns[f"core {name}, compiled, all metrics"] = lambda c=cc: correction.compute_correction(old, roll, am, c)
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
        out = correction.policy_loss(log_probs(), old, adv, am, roll, correction.preset("off"), with_metrics=False)
        out.loss.backward()

    def old_forward():
        with torch.no_grad():
            log_probs()

    fns: dict[str, Callable[[], object]] = {"step": train_step, "fwd": old_forward}
    variants = {"": {"compile_metrics": "off"}}
    if args.compile:
        variants |= {", metrics compiled": {"compile_metrics": "on"}, ", compiled": {"compile": True}}
    for name in ("tis", "adaptive", "mis_full"):
        for suffix, options in variants.items():
            c = correction.preset(name, **options)
            tag = name + suffix
            fns[f"{tag}: core + all metrics"] = lambda c=c: correction.compute_correction(old, roll, am, c,
                                                                                          log_probs=old)
            fns[f"{tag}: bare core"] = lambda c=c: correction.compute_correction(old, roll, am, c,
                                                                                 with_metrics=False)
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

        # upstream imports flash_attn at module level
        patches.apply_platform_patches("cuda" if args.device.startswith("cuda") else "cpu")
        from openrlhf.models import PolicyLoss as upstream
    part1(args, upstream)
    if not args.skip_model:
        part2(args)


if __name__ == "__main__":
    main()
