"""What the fork does on this machine's GPU, in one command and one table (under 10 minutes on one GPU).

    python benchmarks/gpu_check.py                       # on a machine with one NVIDIA GPU
    python benchmarks/gpu_check.py --device cpu --small  # the same checks at toy sizes (tests/test_gpu_check.py)
    python benchmarks/prepare_gpu_check.py               # a folder to copy to a GPU machine without network

It runs from a plain clone with only torch (with CUDA), transformers and triton installed: it puts the repository
on sys.path itself, and a check whose optional package (openrlhf, transformers, vLLM, DeepSpeed, Ray) is missing is
a skipped row, never an error. Where `openrlhf.models` does not import, upstream's PolicyLoss is the project's own
statement of its formula (benchmarks/upstream_formula.py, held equal to upstream's by
tests/test_upstream_formula.py), and the rows that use it say so.

Checks (`--checks` picks some):
    core      every preset in fp32 on the device against float64 on the CPU: loss, gradient, mask, weights and
              every metric; with the metrics pass compiled (the CUDA default) for four presets as well
    upstream  `off`, `upstream_icepop`, `upstream_tis`, `upstream_seq_mask_tis` against OpenRLHF 0.11.2's
              PolicyLoss on the device
    cost      the loss + metrics against upstream's PolicyLoss: time, kernels and peak memory
              (benchmarks/bench_correction.py's rows), and the host synchronizations of one call on CUDA
    step      the fork's share of a bf16 training step of a SmolLM2-135M-shaped model (random weights from a
              LlamaConfig: nothing is downloaded) at micro-batch 8×1024
    fp8       FP8 e4m3 128×128 block quantization (rollout/fp8_blocks.py) of a SmolLM2-135M-shaped model's
              projections on the device: scales against float64 on the CPU, the round-trip bound, an all-zero
              block, and the time to re-quantize every projection once (one sync's quantization)
    cli       where vLLM, DeepSpeed and Ray are installed and a GPU is present: a 1-GPU run of the training CLI
              on the tiny model (TIS) for each of `--cli-precisions` (bf16 and fp8 rollouts by default) whose
              metrics.jsonl, sync check, token dumps and (quantized rollouts) re-quantization error are read
    moe       where vLLM 0.29.0 (its `enable_return_routed_experts`) and a GPU are present: a tiny Qwen3-MoE served
              by a float32 engine returns each request's routed experts (routing replay's GPU path,
              rollout/cuda_routing.py), compared with the transformers model's own routing of the same tokens,
              prefix-cached prompt tokens included; else skipped, with the reason

Each row says ok, MISMATCH (a result disagrees with its reference), ERROR (a check raised), goal met / over
goal (a cost against the issue's goal), info or skipped (with the reason). The exit status is 1 when any row
is MISMATCH or ERROR. `--perturb-reference` shifts the float64 reference's log π_old, which every preset that
reads π_old must report as a mismatch: the self-test of the comparison.

The float64 reference is the same core run on the CPU: tests/test_correction_core.py holds that one to an
independent loop-by-loop reference. Its log-probs lie on a 1/64 grid, exact in both precisions, so no ratio
falls within rounding of a bound and the two precisions must agree on every mask.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import math
import os
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

VENDOR = "vendor"
"""A prepared bundle's folder of pure-Python packages (benchmarks/prepare_gpu_check.py)."""


def _add_repository_to_path() -> Path:
    """The repository root (its `openrlhf_tis`) and this folder (the benchmarks reused here) first on sys.path, so
    that a plain clone or a prepared bundle runs with nothing installed; a bundle's vendor/ last, so that a package
    the machine has wins over the bundle's copy. Returns the root."""
    here = Path(__file__).resolve().parent
    root = here.parent
    for path in (here, root):
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))
    if (root / VENDOR).is_dir() and str(root / VENDOR) not in sys.path:
        sys.path.append(str(root / VENDOR))
    return root


REPO = _add_repository_to_path()

import bench_correction as bench  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from upstream_formula import StatedPolicyLoss  # noqa: E402

import openrlhf_tis  # noqa: E402
from openrlhf_tis import metric_names as names  # noqa: E402
from openrlhf_tis.correction import PRESETS, policy_loss, preset  # noqa: E402

CHECKS = ("core", "upstream", "cost", "step", "fp8", "cli", "moe")
FAILING = ("MISMATCH", "ERROR")
OPTIONAL = ("openrlhf", "transformers", "vllm", "deepspeed", "ray", "flash_attn", "pandas", "pyarrow", "duckdb")
"""Packages a check may need that a GPU machine with only torch may lack: a check missing one is skipped."""
SMOLLM2_135M = {"vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                "num_attention_heads": 9, "num_key_value_heads": 3, "max_position_embeddings": 8192,
                "rope_theta": 100000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": True}
"""SmolLM2-135M's shape (its config.json), for a random-weight model of the same cost."""
TOY_MODEL = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
             "tie_word_embeddings": True}
REWARD = "dense_reward.py"  # the demo task's reward with its dense term: a random tiny model gets advantages
COMPILED_PRESETS = ("tis", "adaptive", "mis_full", "seq_mis")
UPSTREAM_SCHEMES = {"off": {},
                    "upstream_icepop": {"is_correction_level": "token", "is_correction_mode": "mask"},
                    "upstream_tis": {"is_correction_level": "token", "is_correction_mode": "clip"},
                    "upstream_seq_mask_tis": {"is_correction_level": "seq", "is_correction_mode": "mask"}}
"""The presets upstream's PolicyLoss computes too, and the PolicyLoss arguments that make it do so (with its
default band [0.5, 5], which config.from_upstream maps too)."""
GOALS = {"time": 2.0, "kernels": 2.0, "memory": 1.25, "step": 1.02}
"""The correction's cost goals for the eager loss + metrics against upstream's PolicyLoss, and for a training step
(docs/correction.md)."""
REQUANTIZED = {"fp8": ("rollout/fp8_max_rel_error", 1 / 16), "int8": ("rollout/int8_max_rel_error", 0.5 / 127)}
"""The metric of each quantized rollout's re-quantization and its bound: e4m3's half step (2^-4, relative), the 8-bit
grid's half step of the row's largest weight (0.5/127)."""


@dataclass
class Sizes:
    core: tuple[int, int]  # B × T of the reference checks
    cost: tuple[int, int]  # of the cost rows (bench_correction's default batch)
    step: tuple[int, int]  # micro-batch of the training step
    model: dict
    repeats: int
    fp8_block: tuple[int, int]  # the FP8 weight blocks (vLLM's and verl's 128×128; the toy model is smaller)


FULL = Sizes(core=(32, 512), cost=(256, 1024), step=(8, 1024), model=SMOLLM2_135M, repeats=10, fp8_block=(128, 128))
SMALL = Sizes(core=(4, 24), cost=(8, 32), step=(2, 32), model=TOY_MODEL, repeats=2, fp8_block=(16, 16))


@dataclass
class Row:
    check: str
    case: str
    result: str
    expected: str
    status: str


# ── the batch ────────────────────────────────────────────────────────────────────────────────────────

def grid_batch(B: int, T: int, seed: int = 0, nonfinite: bool = True) -> list[torch.Tensor]:
    """[log π_θ, log π_old, log μ, advantages, action mask] in float64 on the CPU, every log-prob on a 1/64 grid.

    Most ratios r = π_old/μ lie within e^±1.5 (some beyond every preset's bounds), a few tokens are far off
    (r = e^10: the veto's territory), and every fourth sequence is on-policy, which every rejection keeps.
    `nonfinite` puts a NaN and a −inf rollout log-prob on action tokens and NaN on the padding, all of which
    must stay inert (upstream's PolicyLoss needs finite padding).
    """
    g = torch.Generator().manual_seed(seed)

    def grid(x: torch.Tensor) -> torch.Tensor:
        return torch.round(x * 64) / 64

    old = grid(-1.6 - 2.0 * torch.rand(B, T, generator=g, dtype=torch.float64))
    log_r = grid(0.4 * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(-1.5, 1.5)
    log_r[torch.rand(B, T, generator=g) < 0.01] = 10.0
    log_r[3::4] = 0.0  # every fourth sequence on-policy (mean log r exactly 0): kept by rejection sampling too
    log_r[3::4, 0], log_r[3::4, 1] = 1 / 64, -1 / 64
    lp = grid(old + 0.1 * torch.randn(B, T, generator=g, dtype=torch.float64))
    adv = grid(torch.randn(B, T, generator=g, dtype=torch.float64))
    lengths = torch.randint(T // 2, T + 1, (B,), generator=g)
    am = (torch.arange(T)[None, :] < lengths[:, None]).to(torch.float64)
    roll = old - log_r
    if nonfinite and B >= 2:
        roll[0, 1], roll[1, 2] = math.nan, -math.inf
    if nonfinite:
        for x in (old, roll, lp):
            x[am == 0] = math.nan
    return [lp, old, roll, adv, am]


def _run(batch: list[torch.Tensor], cfg, device: str, dtype: torch.dtype) -> dict:
    """The fork's policy loss on `batch` moved to device/dtype: loss, gradient, mask, weights, metrics."""
    lp, old, roll, adv, am = (t.to(device=device, dtype=dtype, copy=True) for t in batch)
    lp.requires_grad_(True)
    out = policy_loss(lp, old, adv, am, roll, cfg, batch_num_tokens=am.sum(), global_batch_size=float(am.shape[0]))
    out.loss.backward()
    return {"loss": out.loss.item(), "grad": lp.grad.double().cpu(), "mask": out.correction.mask.cpu(),
            "weights": out.correction.weights.double().cpu(), "metrics": out.correction.metrics}


def _worst_metric(got: dict[str, float], ref: dict[str, float], rtol: float, atol: float) -> tuple[str, float, bool]:
    """(key, relative gap, within tolerance) of the metric farthest from its reference."""
    worst, gap, ok = "", 0.0, True
    for key, want in ref.items():
        diff = abs(got[key] - want)
        rel = diff / max(abs(want), atol / rtol)
        if rel > gap:
            worst, gap = key, rel
        ok &= diff <= rtol * abs(want) + atol
    return worst, gap, ok


# ── core: every preset against float64 ───────────────────────────────────────────────────────────────

def check_core(args, sizes: Sizes) -> Iterator[Row]:
    batch = grid_batch(*sizes.core)
    reference_batch = [t.clone() for t in batch]
    if args.perturb_reference:
        reference_batch[1] += 1e-3  # log π_old: every loss and ratio moves
    compiled = args.compile
    for name in PRESETS:
        variants = {"eager": {"compile_metrics": "off"}}
        if compiled and name in COMPILED_PRESETS:
            variants["metrics compiled"] = {"compile_metrics": "on"}
        ref = _run(reference_batch, preset(name, compile_metrics="off"), "cpu", torch.float64)
        for label, options in variants.items():
            got = _run(batch, preset(name, **options), args.device, torch.float32)
            yield _compare("core", f"{name} ({label})", got, ref)


def _compare(check: str, case: str, got: dict, ref: dict) -> Row:
    d_loss = abs(got["loss"] - ref["loss"])
    d_grad = (got["grad"] - ref["grad"]).abs().max().item()
    flips = int((got["mask"].bool() != ref["mask"].bool()).sum())
    d_w = ((got["weights"] - ref["weights"]).abs() / ref["weights"].abs().clamp(min=1)).max().item()
    key, d_metric, metrics_ok = _worst_metric(got["metrics"], ref["metrics"], rtol=1e-4, atol=1e-6)
    ok = (d_loss <= 1e-5 * abs(ref["loss"]) + 1e-7 and d_grad <= 1e-5 * ref["grad"].abs().max().item() + 1e-9
          and flips == 0 and d_w <= 1e-5 and metrics_ok)
    result = (f"Δloss {d_loss:.1e}, Δgrad {d_grad:.1e}, {flips} mask flips, Δw {d_w:.1e}, "
              f"metrics {d_metric:.1e} ({key.split('/')[-1]})")
    return Row(check, case, result, "float64 CPU: 1e-5 rel, no flip, metrics 1e-4", "ok" if ok else "MISMATCH")


# ── upstream: the presets OpenRLHF computes too ──────────────────────────────────────────────────────

def installed(package: str) -> bool:
    """Whether `package` can be imported here (a None entry in sys.modules, which blocks an import, counts as
    missing: the tests simulate a machine without it that way)."""
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        return False


@dataclass(frozen=True)
class Upstream:
    """The upstream PolicyLoss of the upstream, cost and step rows, and where it comes from."""

    policy_loss: Callable[..., tuple]
    """OpenRLHF's class, or the statement of its formula (same constructor keywords and call)."""
    stand_in: str = ""
    """Why the statement stands in for OpenRLHF's class ("" where the class itself is used)."""

    @property
    def name(self) -> str:
        if not self.stand_in:
            return "OpenRLHF PolicyLoss"
        return f"the fork's statement of OpenRLHF 0.11.2's PolicyLoss formula ({self.stand_in})"


@functools.cache
def load_upstream(device: str) -> Upstream:
    """OpenRLHF's PolicyLoss where `openrlhf.models` imports (its flash-attn import needs the fork's platform
    patches where flash-attn is absent: those of a run on `device`), else the project's statement of its formula:
    upstream's numbers are still compared, and the rows say which side they came from."""
    if not installed("openrlhf"):
        return Upstream(StatedPolicyLoss, "openrlhf not installed")
    try:
        _apply_platform_patches(device)
        from openrlhf.models import PolicyLoss
    except Exception as exc:  # whatever stops the import (a missing DeepSpeed, flash-attn...): the statement stands in
        return Upstream(StatedPolicyLoss, f"openrlhf.models did not import: {type(exc).__name__}: {exc}")
    return Upstream(PolicyLoss)


def _apply_platform_patches(device: str) -> None:
    """The fork's platform patches of a run on `device`, where the fork is installed: setup.py maps patches/ to
    `openrlhf_tis.patches`, which a plain clone lacks (there openrlhf.models is imported as it is)."""
    if not installed("openrlhf_tis.patches"):
        return
    from openrlhf_tis import patches

    patches.apply_platform_patches("cuda" if device.startswith("cuda") else "cpu")


def check_upstream(args, sizes: Sizes) -> Iterator[Row]:
    upstream = load_upstream(args.device)
    lp, old, roll, adv, am = (t.to(device=args.device, dtype=torch.float32)
                              for t in grid_batch(*sizes.core, seed=1, nonfinite=False))
    counts = {"batch_num_tokens": am.sum(), "global_batch_size": float(am.shape[0]), "dp_size": 1}
    for name, mode in UPSTREAM_SCHEMES.items():
        scheme = {"is_correction_threshold": [0.5, 5.0], **mode} if mode else {}
        up_lp = lp.clone().requires_grad_(True)
        up_loss, up_clip, up_kl, vllm_kl, _ = upstream.policy_loss(**scheme)(up_lp, old, adv, am, roll, **counts)
        up_loss.backward()
        ours_lp = lp.clone().requires_grad_(True)
        ours = policy_loss(ours_lp, old, adv, am, roll, preset(name), **counts)
        ours.loss.backward()
        d_loss = abs(ours.loss.item() - up_loss.item())
        d_grad = (ours_lp.grad - up_lp.grad).abs().max().item()
        d_kl = abs(ours.ppo_kl.item() - up_kl.item()) + abs(ours.clip_ratio.item() - up_clip.item())
        if vllm_kl is not None:  # both E_μ[log μ − log π_old]
            d_kl += abs(ours.correction.metrics[names.K1_KL] - vllm_kl.item())
        scale = up_lp.grad.abs().max().item()
        ok = d_loss <= 1e-6 * abs(up_loss.item()) + 1e-8 and d_grad <= 1e-6 * scale + 1e-10 and d_kl <= 1e-6
        yield Row("upstream", name, f"Δloss {d_loss:.1e}, Δgrad {d_grad:.1e}, Δ(ppo_kl, clip, k1) {d_kl:.1e}",
                  f"{upstream.name}: 1e-6 rel", "ok" if ok else "MISMATCH")


# ── cost: the loss + metrics against upstream's ──────────────────────────────────────────────────────

def check_cost(args, sizes: Sizes) -> Iterator[Row]:
    upstream = load_upstream(args.device)
    batch = bench.make_batch(*sizes.cost, args.device)
    steps = bench.loss_steps(batch, upstream.policy_loss, args.compile)
    costs = bench.loss_costs(steps, sizes.repeats, args.device)
    base = next(iter(costs.values()))
    graded = {*bench.EAGER_ROWS.values(), *bench.COMPILED_METRICS_ROWS.values()}
    where = f"{sizes.cost[0]}×{sizes.cost[1]}"
    for name, cost in costs.items():
        ratios = {key: cost[unit] / base[unit] for key, unit in
                  (("time", "ms"), ("kernels", "kernels"), ("memory", "peak_mib"))}
        result = (f"{cost['ms']:.2f} ms ({ratios['time']:.2f}×), {cost['kernels']} kernels "
                  f"({ratios['kernels']:.2f}×), {cost['peak_mib']:.1f} MiB ({ratios['memory']:.2f}×)")
        if name not in graded:
            status = "info"
        else:
            status = "goal met" if all(ratios[key] <= GOALS[key] for key in ratios) else "over goal"
        case = name.removeprefix("fork, ")
        if upstream.stand_in:
            case = case.replace("upstream PolicyLoss", "upstream PolicyLoss (stated formula)")
        expected = "≤ 2× time and kernels, ≤ 1.25× memory" if name in graded else ""
        if upstream.stand_in and (name in graded or name.startswith("upstream")):
            expected = f"{expected} (baseline: {upstream.name})".lstrip()
        yield Row("cost", f"{case}, {where}", result, expected, status)
    yield _host_syncs(args, batch)


def _host_syncs(args, batch: list[torch.Tensor]) -> Row:
    """The host synchronizations of one call of the fork's loss + metrics (CUDA's sync debug mode)."""
    if not args.device.startswith("cuda"):
        return Row("cost", "host syncs per call", "", "", "skipped: CUDA only (the CPU never waits on a device)")
    import warnings

    lp0, old, roll, adv, am = batch
    counts = {"batch_num_tokens": am.sum(), "global_batch_size": float(am.shape[0]), "dp_size": 1}
    found = {}
    for name in ("tis", "adaptive", "mis_full"):
        cfg = preset(name, compile_metrics="on")  # the CUDA default ("auto"), compiled once for every check
        policy_loss(lp0, old, adv, am, roll, cfg, **counts)  # warm, compiled
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                policy_loss(lp0, old, adv, am, roll, cfg, **counts)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        found[name] = sum("synchroniz" in str(w.message) for w in caught)
    result = ", ".join(f"{name}: {n}" for name, n in found.items())
    return Row("cost", "host syncs per call", result, "1 (the metric vector's transfer)",
               "ok" if all(n <= 1 for n in found.values()) else "MISMATCH")


# ── step: a SmolLM2-135M-shaped bf16 training step ───────────────────────────────────────────────────

def check_step(args, sizes: Sizes) -> Iterator[Row]:
    if not installed("transformers"):
        yield Row("step", "bf16 training step", "", "", "skipped: transformers not installed (it builds the model)")
        return
    from transformers import LlamaConfig, LlamaForCausalLM

    upstream = load_upstream(args.device)
    torch.manual_seed(0)
    config = LlamaConfig(**sizes.model, attn_implementation="sdpa")
    model = LlamaForCausalLM(config).to(device=args.device, dtype=torch.bfloat16).train()
    B, T = sizes.step
    g = torch.Generator().manual_seed(0)
    seqs = torch.randint(0, config.vocab_size, (B, T), generator=g).to(args.device)
    lengths = torch.randint(T // 2, T, (B,), generator=g)
    am = (torch.arange(T - 1)[None, :] < lengths[:, None]).float().to(args.device)
    counts = {"batch_num_tokens": am.sum(), "global_batch_size": float(B), "dp_size": 1}

    def log_probs() -> torch.Tensor:
        logits = model(seqs).logits[:, :-1].float()
        return torch.log_softmax(logits, -1).gather(-1, seqs[:, 1:, None]).squeeze(-1)

    with torch.no_grad():
        old = log_probs()
    roll = old + 0.05 * torch.randn(old.shape, generator=g).to(args.device)
    adv = torch.randn(B, 1, generator=g).expand(B, T - 1).contiguous().to(args.device)

    def step(loss: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[], None]:
        def run() -> None:
            model.zero_grad(set_to_none=True)
            loss(log_probs()).backward()
        return run

    baseline = upstream.policy_loss()
    steps = {"upstream PolicyLoss": step(lambda lp: baseline(lp, old, adv, am, roll, **counts)[0])}
    for name in bench.EAGER_ROWS:
        cfg = preset(name, compile_metrics="on" if args.compile else "off")
        steps[name] = step(lambda lp, cfg=cfg: policy_loss(lp, old, adv, am, roll, cfg, **counts).loss)
    times = bench.time_all(steps, max(3, sizes.repeats // 2), args.device)
    base = times.pop("upstream PolicyLoss")
    metrics = "metrics compiled" if args.compile else "metrics eager"
    against = "upstream (stated formula)" if upstream.stand_in else "upstream"
    goal = f"≤ {GOALS['step']}×" + (f" (baseline: {upstream.name})" if upstream.stand_in else "")
    for name, t in times.items():
        ratio = t / base
        yield Row("step", f"{name} ({metrics}), {B}×{T}, {config.num_hidden_layers} layers",
                  f"{t * 1e3:.1f} ms vs {against} {base * 1e3:.1f} ms: {ratio:.3f}×", goal,
                  "goal met" if ratio <= GOALS["step"] else "over goal")


# ── fp8: block quantization of the projections, as a sync re-quantizes them ─────────────────────────

def projection_shapes(model: dict) -> dict[str, tuple[int, int]]:
    """[out, in] of each decoder projection of a Llama-style config (q, k, v, o, gate, up, down)."""
    h, i = model["hidden_size"], model["intermediate_size"]
    kv = model["num_key_value_heads"] * h // model["num_attention_heads"]
    return {"q_proj": (h, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, h),
            "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}


def _float64_block_scales(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """max |W_b| / 448 per block, block by block in float64 on the CPU (an all-zero block: the smallest normal)."""
    w = w.double().cpu()
    bn, bk = block
    rows, cols = math.ceil(w.shape[0] / bn), math.ceil(w.shape[1] / bk)
    out = torch.empty(rows, cols, dtype=torch.float64)
    for r in range(rows):
        for c in range(cols):
            amax = w[r * bn:(r + 1) * bn, c * bk:(c + 1) * bk].abs().max().item()
            out[r, c] = amax / 448.0 if amax > 0 else torch.finfo(torch.float32).tiny
    return out.float()


def check_fp8(args, sizes: Sizes) -> Iterator[Row]:
    from openrlhf_tis.rollout.fp8_blocks import dequantize_blocks, quantize_blocks

    block = bn, bk = sizes.fp8_block

    g = torch.Generator().manual_seed(0)
    shapes = projection_shapes(sizes.model)
    weights = {}
    for name, shape in shapes.items():
        w = (0.02 * torch.randn(shape, generator=g)).to(torch.bfloat16)
        w[:bn, :bk] = 0  # an all-zero block in every weight
        weights[name] = w.to(args.device)
    for name, w in weights.items():
        q, scale = quantize_blocks(w, block)
        exact = torch.equal(scale.cpu(), _float64_block_scales(w, block))
        back, w64 = dequantize_blocks(q, scale, block).double().cpu(), w.double().cpu()
        rows = torch.arange(w.shape[0]) // bn
        cols = torch.arange(w.shape[1]) // bk
        bound = torch.maximum(w64.abs() / 16, scale.double().cpu()[rows][:, cols] / 1024) * (1 + 1e-6)
        within = bool(((back - w64).abs() <= bound).all())
        zero = bool((back[:bn, :bk] == 0).all()) and bool(torch.isfinite(scale).all())
        rel = float((back - w64).abs().max() / w64.abs().max())
        yield Row("fp8", f"{name} {tuple(w.shape)}, scales {tuple(scale.shape)}",
                  f"scales {'exact' if exact else 'DIFFER'}, max rel. error {rel:.3f}, "
                  f"{'within' if within else 'OUTSIDE'} e4m3's bound, zero block {'ok' if zero else 'NaN/non-zero'}",
                  "float64 CPU scales; |ΔW| ≤ max(|W|/16, s/1024)", "ok" if exact and within and zero else "MISMATCH")
    try:
        yield int8_host_plan_row(weights, args.device)
    except ModuleNotFoundError as exc:  # the INT8 plan's module reads the flags, which need what a plain clone lacks
        if not (missing := _missing_optional(exc)):
            raise
        yield Row("fp8", "int8 sync, plan on the host", "", "", f"skipped: {missing} not installed")
    layers = sizes.model["num_hidden_layers"]
    every = [w for _ in range(layers) for w in weights.values()]  # one sync: every projection of every layer
    sync = {"sync": lambda: [quantize_blocks(w, block) for w in every]}
    seconds = bench.time_all(sync, sizes.repeats, args.device)["sync"]
    mib = sum(w.numel() * w.element_size() for w in every) / 2**20
    yield Row("fp8", f"one sync's quantization: {len(every)} projections, {mib:.1f} MiB bf16, blocks {bn}×{bk}",
              f"{seconds * 1e3:.1f} ms ({mib / seconds:.0f} MiB/s)", "", "info")


def int8_host_plan_row(weights: dict[str, torch.Tensor], device: str) -> Row:
    """INT8's re-quantization of one layer's projections on `device` with its plan read on the host, as a CUDA sync
    runs it (smoothing factors, frozen scales and static input scales: checkpoint.load_int8_plan reads them on the
    CPU), against the same on the CPU: every tensor it loads on the device, the int8 values within one step (a
    quotient at a tie may round apart) and the scales equal."""
    from openrlhf_tis.rollout.quantize import (
        Int8Plan,
        input_scale_name,
        per_channel_scale,
        quantize_named_weights,
        scale_name,
    )

    g = torch.Generator().manual_seed(1)
    hidden = weights["q_proj"].shape[1]
    norms = {"input_layernorm": ("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
             "post_attention_layernorm": ("mlp", ("gate_proj", "up_proj", "down_proj"))}
    named, smoothing = [], {}
    for norm, (block, projections) in norms.items():
        name = f"model.layers.0.{norm}.weight"
        smoothing[name] = 0.5 + torch.rand(hidden, generator=g)
        named.append((name, torch.ones(hidden, dtype=torch.bfloat16, device=device)))
        named += [(f"model.layers.0.{block}.{p}.weight", weights[p]) for p in projections]
    projections = [n for n, _ in named if n.endswith("_proj.weight")]
    frozen = {scale_name(n): per_channel_scale(w.float().cpu()) for n, w in named if n in projections}
    plan = Int8Plan(scale_mode="frozen", smoothing=smoothing, frozen_scales=frozen, activations="static",
                    input_scales={input_scale_name(n): torch.tensor([0.05]) for n in projections})
    on_device, _ = quantize_named_weights(named, plan, torch.bfloat16)
    on_cpu, _ = quantize_named_weights([(n, w.cpu()) for n, w in named], plan, torch.bfloat16)
    pairs = [(a, b) for (_, a), (_, b) in zip(on_device, on_cpu, strict=True)]
    placed = all(a.device == weights["q_proj"].device for a, _ in pairs)
    steps = max(int((a.cpu().int() - b.int()).abs().max()) for a, b in pairs if a.dtype == torch.int8)
    floats = all(torch.equal(a.cpu(), b) for a, b in pairs if a.dtype != torch.int8)
    ok = placed and steps <= 1 and floats
    return Row("fp8", f"int8 sync, plan on the host: {len(projections)} projections, smoothed, frozen + input scales",
               f"{'on the device' if placed else 'NOT on the device'}, int8 within {steps} step(s) of the CPU's, "
               f"scales and norms {'equal' if floats else 'DIFFER'}", "on the device; = CPU (int8 ±1)",
               "ok" if ok else "MISMATCH")


# ── cli: a 1-GPU run of the training command ─────────────────────────────────────────────────────────

def check_cli(args, sizes: Sizes) -> Iterator[Row]:
    missing = [m for m in ("vllm", "deepspeed", "ray", "openrlhf") if not installed(m)]
    reasons = [f"{', '.join(missing)} not installed"] if missing else []
    if not missing and not installed("openrlhf_tis.patches"):  # a plain clone: setup.py maps patches/ there
        reasons.append("openrlhf_tis.patches not installed (`pip install -e .` maps patches/ there)")
    if not args.device.startswith("cuda") or not torch.cuda.is_available():
        reasons.append(f"needs a CUDA device (this run: {args.device})")
    if reasons:
        yield Row("cli", "1-GPU training run", "", "", f"skipped: {'; '.join(reasons)}")
        return
    for precision in args.cli_precisions:
        yield from _cli_run(args, precision)


def _cli_run(args, precision: str) -> Iterator[Row]:
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        work = Path(tmp)
        argv = cli_argv(work, precision)
        path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)  # this checkout's fork
        proc = subprocess.run(argv, cwd=work, capture_output=True, text=True, timeout=args.cli_timeout,
                              env={**os.environ, "RAY_DEDUP_LOGS": "0", "PYTHONPATH": path})
        if proc.returncode != 0:
            log = Path(args.cli_log).with_suffix(f".{precision}.log")
            log.write_text(proc.stdout + proc.stderr)
            yield Row("cli", f"1-GPU training run, {precision} rollouts", f"exit status {proc.returncode}; log: {log}",
                      "exit 0", "MISMATCH")
            return
        yield from check_run_dir(work / "run", steps=2, precision=precision)


def cli_argv(work: Path, precision: str = "bf16") -> list[str]:
    """The training command of the cli check: the tiny model, two GRPO steps of 4 prompts × 2 samples, `precision`
    rollouts + TIS, actor and engine colocated on one GPU, a token dump every step. The tiny model has 2 KV heads of
    64, so every projection is whole 128×128 blocks (FP8 rollouts need it)."""
    from openrlhf_tis.demo.task import write_prompts
    from openrlhf_tis.demo.tiny_model import build_tiny_model

    model = build_tiny_model(work / "model", heads=2, kv_heads=2)
    prompts = write_prompts(work / "prompts.jsonl", 8)
    attention = "flash_attention_2" if importlib.util.find_spec("flash_attn") else "sdpa"
    return [
        sys.executable, "-m", "openrlhf_tis.cli.train_ppo_ray",
        "--actor.model_name_or_path", str(model), "--reward.remote_url", str(REPO / "openrlhf_tis" / "demo" / REWARD),
        "--data.prompt_dataset", str(prompts), "--data.input_key", "input", "--data.label_key", "label",
        "--data.apply_chat_template", "--actor.num_nodes", "1", "--actor.num_gpus_per_node", "1",
        "--vllm.num_engines", "1", "--vllm.tensor_parallel_size", "1", "--train.colocate_all",
        "--vllm.gpu_memory_utilization", "0.3", "--vllm.enforce_eager", "--vllm.rollout_precision", precision,
        "--algo.correction.preset", "tis", "--ds.attn_implementation", attention,
        "--algo.advantage.estimator", "group_norm", "--algo.kl.init_coef", "0",
        "--rollout.n_samples_per_prompt", "2", "--rollout.batch_size", "4", "--rollout.micro_batch_size", "8",
        "--train.batch_size", "8", "--train.micro_batch_size", "8", "--data.max_len", "128",
        "--rollout.max_new_tokens", "24", "--data.max_samples", "8", "--train.num_episodes", "1",
        "--ds.zero_stage", "2", "--actor.adam.lr", "1e-3", "--actor.lr_warmup_ratio", "0", "--actor.min_lr_ratio", "1",
        "--ckpt.path", str(work / "ckpt"), "--ckpt.save_steps", "-1", "--eval.steps", "-1", "--train.seed", "42",
        "--logger.run_dir", str(work / "run"), "--logger.token_dump_steps", "1",
    ]


def check_run_dir(run: Path, steps: int, precision: str = "bf16") -> Iterator[Row]:
    """What a finished run must hold: `steps` lines of finite mismatch metrics, the sync check's gap after every
    sync, readable token dumps with finite rollout and trainer log-probs for every step, and for quantized rollouts
    each sync's re-quantization error within its grid's half step."""
    from openrlhf_tis.runs.query import query_tokens
    from openrlhf_tis.runs.reader import read_metrics_records

    lines = read_metrics_records(run) if (run / "metrics.jsonl").is_file() else []
    wanted = (names.K1_KL, names.K3_KL, names.CHI2_TOKEN, names.KEPT_FRAC, names.TRUNCATED_FRAC)

    def finite(line: dict, key: str) -> bool:
        return isinstance(line.get(key), int | float) and math.isfinite(line[key])

    bad = sorted({key for line in lines for key in wanted if not finite(line, key)})
    yield Row("cli", "metrics.jsonl: mismatch and correction metrics",
              f"{len(lines)} steps" + (f"; missing or non-finite: {', '.join(bad)}" if bad else ""),
              f"{steps} steps, finite", "ok" if len(lines) == steps and not bad else "MISMATCH")
    checked = [line for line in lines if finite(line, names.SYNC_GAP_MEAN)]
    gaps = ", ".join(f"{line[names.SYNC_GAP_MEAN]:.2e}" for line in checked)
    yield Row("cli", "sync check (every step)", f"{len(checked)} checked syncs, |log μ − log π| {gaps}",
              f"{steps} checked syncs", "ok" if len(checked) == steps else "MISMATCH")
    if precision in REQUANTIZED:
        key, bound = REQUANTIZED[precision]
        errors = [line[key] for line in lines if finite(line, key)]
        within = len(errors) == steps and max(errors) <= bound
        yield Row("cli", f"{precision} re-quantization at each sync", f"{key}: {', '.join(f'{e:.3f}' for e in errors)}",
                  f"{steps} syncs, ≤ {bound:.3f}", "ok" if within else "MISMATCH")
    try:
        tokens = query_tokens(run, columns=["step", "rollout_logprob", "old_logprob", "train_logprob"])
    except (FileNotFoundError, ValueError, OSError) as exc:
        yield Row("cli", "token dumps", f"unreadable: {exc}", f"{steps} steps", "MISMATCH")
        return
    dumped = sorted(int(s) for s in tokens["step"].unique())
    numbers = tokens[["rollout_logprob", "old_logprob", "train_logprob"]].to_numpy()
    all_finite = bool(len(tokens)) and bool(torch.isfinite(torch.from_numpy(numbers)).all())
    yield Row("cli", "token dumps", f"{len(tokens)} tokens over steps {dumped}, log-probs finite: {all_finite}",
              f"steps 1..{steps}", "ok" if dumped == list(range(1, steps + 1)) and all_finite else "MISMATCH")


# ── moe: the routed experts a CUDA engine returns (routing replay) ─────────────────────────────────────

MOE_CASE = "routed experts returned by a float32 engine (tiny Qwen3-MoE)"
MOE_AGREEMENT = 0.99
"""A float32 engine and the float32 model differ only in summation order: a disagreement is a mapping error, bar rare
near-ties (the CPU capture's engine test agreed on 320 of 320 pairs)."""


def check_moe(args, sizes: Sizes) -> Iterator[Row]:
    reasons = []
    if not installed("vllm"):
        reasons.append("vllm not installed")
    else:
        from openrlhf_tis.moe.coverage import engine_refusal

        if refusal := engine_refusal(cuda=True):
            reasons.append(refusal)
    if not args.device.startswith("cuda") or not torch.cuda.is_available():
        reasons.append(f"needs a CUDA device (this run: {args.device}; vLLM-CPU returns routed experts only through "
                       "its Model Runner V2, which needs Triton's CPU backend: docs/moe.md)")
    if reasons:
        yield Row("moe", MOE_CASE, "", "", f"skipped: {'; '.join(reasons)}")
        return
    from openrlhf_tis.demo.tiny_model import build_tiny_moe

    with tempfile.TemporaryDirectory(prefix="gpu_check_moe_") as tmp:
        model_dir = build_tiny_moe(Path(tmp) / "moe")
        engine, cached = _engine_routings(model_dir)
        trainer = _trainer_routings(model_dir, engine, args.device)
    yield from routing_rows(engine, trainer, cached)


def _engine_routings(model_dir: Path) -> tuple[dict[tuple[int, ...], np.ndarray], dict[tuple[int, ...], int]]:
    """Each request's routing as the rollout gets it, and its prefix-cached prompt tokens, keyed by its tokens: two
    prompts, then two that extend them (their full blocks come from the prefix cache), 8 sampled tokens each."""
    import gc

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from openrlhf_tis.moe.coverage import moe_layers
    from openrlhf_tis.rollout.checkpoint import read_config
    from openrlhf_tis.rollout.cuda_routing import take_routing

    config = read_config(model_dir)
    llm = LLM(model=str(model_dir), dtype="float32", enforce_eager=True, max_model_len=256, seed=0,
              gpu_memory_utilization=0.3, enable_prefix_caching=True, enable_return_routed_experts=True)
    g = torch.Generator().manual_seed(0)
    first = [torch.randint(0, config["vocab_size"], (n,), generator=g).tolist() for n in (70, 40)]
    second = [first[0] + torch.randint(0, config["vocab_size"], (5,), generator=g).tolist(),
              first[1] + torch.randint(0, config["vocab_size"], (3,), generator=g).tolist()]
    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, detokenize=False)
    outputs = [out for prompts in (first, second)
               for out in llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)]
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    engine, cached = {}, {}
    for out in outputs:
        completion = out.outputs[0]
        tokens = (*out.prompt_token_ids, *completion.token_ids)
        engine[tokens] = take_routing(completion.routed_experts, prompt_tokens=len(out.prompt_token_ids),
                                      response_tokens=len(completion.token_ids),
                                      num_layers=config["num_hidden_layers"], moe_layers=moe_layers(config))
        cached[tokens] = out.num_cached_tokens or 0
    return engine, cached


def _trainer_routings(model_dir: Path, engine: dict, device: str) -> dict[tuple[int, ...], np.ndarray]:
    """The float32 transformers model's own routing of each sequence (the trainer's choice, recorded by the fork's
    replaying routers without replaying anything)."""
    from transformers import AutoModelForCausalLM

    from openrlhf_tis.moe.routing_replay import install_routing_replay, replaying

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    routers = install_routing_replay(model)
    own = {}
    for tokens in engine:
        with torch.no_grad(), replaying(routers, None, num_layers=model.config.num_hidden_layers) as record:
            model(torch.tensor([tokens], device=device))
        own[tokens] = record.trainer_choice().numpy()
    return own


def routing_rows(engine: dict, trainer: dict, cached: dict) -> Iterator[Row]:
    """What the returned routings must be: shaped as the trainer's, every (token, MoE layer) routed but the last token
    (prefix-cached prompt tokens too: vLLM 0.29.0 keys the routing by KV block), the layers without experts empty; and
    the same top-k sets as the trainer's own on at least MOE_AGREEMENT of the pairs, a one-position shift of them on
    under half (the control that a mapping error would fail)."""
    from openrlhf_tis.moe.routing_metrics import NO_ROUTE, routed, same_expert_sets

    wrong, cached_routed, agree, shifted_agree, pairs = [], 0, 0, 0, 0
    for tokens, routing in engine.items():
        own = trainer[tokens]
        moe = (own[..., 0] != NO_ROUTE).any(axis=0)  # the trainer's layers with experts
        expected = np.zeros(own.shape[:2], dtype=bool)
        expected[:-1, moe] = True
        if routing.shape != own.shape or not np.array_equal(routing[..., 0] != NO_ROUTE, expected):
            wrong.append(len(tokens))
            continue
        cached_routed += cached[tokens]
        both = routed(routing, own)
        agree += int((same_expert_sets(routing, own) & both).sum())
        pairs += int(both.sum())
        shifted = np.roll(routing, 1, axis=0)
        shifted_agree += int((same_expert_sets(shifted, own) & routed(shifted, own)).sum())
    yield Row("moe", f"{MOE_CASE}: layout", f"{len(engine) - len(wrong)} of {len(engine)} requests as expected, "
              f"{cached_routed} prefix-cached prompt tokens routed" + (f"; wrong: lengths {wrong}" if wrong else ""),
              "every token but the last routed, dense layers empty", "ok" if not wrong and engine else "MISMATCH")
    share, control = agree / max(pairs, 1), shifted_agree / max(pairs, 1)
    good = pairs > 0 and share >= MOE_AGREEMENT and control < 0.5
    yield Row("moe", f"{MOE_CASE}: against the trainer's own routing",
              f"{agree} of {pairs} top-k sets agree ({share:.3f}); shifted one position: {control:.3f}",
              f"≥ {MOE_AGREEMENT}; shifted < 0.5", "ok" if good else "MISMATCH")


# ── the table ────────────────────────────────────────────────────────────────────────────────────────

RUNNERS: dict[str, Callable[..., Iterator[Row]]] = {"core": check_core, "upstream": check_upstream,
                                                    "cost": check_cost, "step": check_step, "fp8": check_fp8,
                                                    "cli": check_cli, "moe": check_moe}


def run_checks(args, sizes: Sizes) -> list[Row]:
    rows = []
    for check in args.checks:
        try:
            rows.extend(RUNNERS[check](args, sizes))
        except Exception as exc:  # a check that cannot finish is a finding: the others still run
            missing = _missing_optional(exc)
            if missing:
                rows.append(Row(check, "(the rest of the check)", "", "", f"skipped: {missing} not installed"))
                continue
            traceback.print_exc()
            rows.append(Row(check, "(the check raised)", f"{type(exc).__name__}: {exc}", "", "ERROR"))
    return rows


def _missing_optional(exc: Exception) -> str | None:
    """The optional package (OPTIONAL) whose absence `exc` reports, else None: a check that imports one deeper
    than its own test for it reads as skipped, like the others, not as an error."""
    if not isinstance(exc, ModuleNotFoundError) or not exc.name:
        return None
    top = exc.name.split(".")[0]
    return top if top in OPTIONAL else None


def print_table(rows: list[Row], title: str) -> None:
    """The rows as a rich table, or as plain text where rich is missing (it only draws)."""
    if not installed("rich"):
        print_plain_table(rows, title)
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, show_lines=False)
    for column in ("check", "case", "result", "reference / goal", "status"):
        table.add_column(column, overflow="fold")
    style = {"ok": "green", "goal met": "green", "MISMATCH": "bold red", "ERROR": "bold red", "over goal": "yellow"}
    for row in rows:
        status = style.get(row.status.split(":")[0])
        table.add_row(row.check, row.case, row.result, row.expected,
                      f"[{status}]{row.status}[/{status}]" if status else row.status)
    Console(width=200).print(table)


def print_plain_table(rows: list[Row], title: str) -> None:
    """The same columns as text, one row a line, cells padded to the widest (the wrapping is the terminal's)."""
    header = ("check", "case", "result", "reference / goal", "status")
    cells = [header, *((r.check, r.case, r.result, r.expected, r.status) for r in rows)]
    widths = [max(len(line[i]) for line in cells) for i in range(len(header))]
    print(title)
    for i, line in enumerate(cells):
        print(" | ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip())
        if i == 0:
            print("-+-".join("-" * width for width in widths))


def describe_machine(device: str) -> str:
    where = torch.cuda.get_device_name() if device.startswith("cuda") else "CPU"
    cuda = f", CUDA {torch.version.cuda}" if device.startswith("cuda") else ""
    found = [m for m in ("openrlhf", "transformers", "vllm", "deepspeed", "ray", "flash_attn", "triton", "rich")
             if installed(m)]
    fork = Path(openrlhf_tis.__file__).resolve().parent.parent
    return (f"{where}: torch {torch.__version__}{cuda}; installed: {', '.join(found) or 'none of openrlhf/vllm/...'}"
            f"; the fork from {fork}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--small", action="store_true", help="toy sizes and a toy model (seconds, on any device)")
    ap.add_argument("--checks", default=",".join(CHECKS), help=f"comma-separated subset of {','.join(CHECKS)}")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                    help="also run the compiled metrics pass (default: on CUDA, where it is the default)")
    ap.add_argument("--perturb-reference", action="store_true",
                    help="self-test: shift the float64 reference's log π_old by 1e-3, which the core rows must catch")
    ap.add_argument("--cli-timeout", type=int, default=420, help="seconds the cli check's training run may take")
    ap.add_argument("--cli-log", default="gpu_check_cli.log", help="where a failed cli run's output is written")
    ap.add_argument("--cli-precisions", default="bf16,fp8",
                    help="the rollout precisions the cli check trains with, one run each (bf16, fp8, int8)")
    ap.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = ap.parse_args(argv)
    args.checks = [c.strip() for c in args.checks.split(",") if c.strip()]
    args.cli_precisions = [p.strip() for p in args.cli_precisions.split(",") if p.strip()]
    if bad := [p for p in args.cli_precisions if p not in ("bf16", "fp8", "int8")]:
        ap.error(f"--cli-precisions: unknown {bad}; choose from bf16,fp8,int8")
    unknown = [c for c in args.checks if c not in CHECKS]
    if unknown:
        ap.error(f"--checks: unknown {unknown}; choose from {','.join(CHECKS)}")
    if args.compile is None:
        args.compile = args.device.startswith("cuda")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sizes = SMALL if args.small else FULL
    machine = describe_machine(args.device)
    print(machine, flush=True)
    rows = run_checks(args, sizes)
    print_table(rows, f"openrlhf_tis GPU check on {args.device} ({machine.split(':')[0]})")
    if args.json:
        Path(args.json).write_text(json.dumps([row.__dict__ for row in rows], indent=1))
    failed = [row for row in rows if row.status in FAILING]
    print(f"{len(rows)} rows: {len(failed)} mismatches or errors" + ("" if failed else ", every result as expected"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
