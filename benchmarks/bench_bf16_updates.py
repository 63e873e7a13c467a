"""How far a trainer's weights can move, and did move, when the model holds them in bf16.

Why: DeepSpeed keeps an fp32 master copy, but the model that generates, scores and is saved holds the weights
rounded to bf16, so an update smaller than half a bf16 spacing at a weight leaves that weight as it was. Prints
(1) the fraction of the base model's weights on which an update of each size survives the rounding, and (2) for
each run directory given, the fraction of its saved weights that differ from the base (rounded to the run's
dtype) and their relative change ‖θ − θ₀‖ / ‖θ₀‖ (docs/study.md, "Why the earlier studies read differently").

    python benchmarks/bench_bf16_updates.py [RUN_DIR ...] [--model DIR] [--updates 2e-5 1e-4 4.8e-4]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch


def load_weights(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of a model directory's safetensors files, by name."""
    from safetensors.torch import load_file

    weights: dict[str, torch.Tensor] = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        weights.update(load_file(str(file)))
    if not weights:
        raise SystemExit(f"{model_dir}: no *.safetensors file")
    return weights


def survival(weights: torch.Tensor, update: float) -> float:
    """Fraction of `weights` (flat) where adding `update` changes the bf16 value: half the spacing is below it."""
    rounded = weights.to(torch.bfloat16).abs()
    spacing = torch.nextafter(rounded, torch.full_like(rounded, float("inf"))).float() - rounded.float()
    return float((spacing / 2 < update).float().mean())


def movement(base: dict[str, torch.Tensor], run: dict[str, torch.Tensor]) -> tuple[float, float]:
    """Fraction of the shared weights that changed, and ‖θ − θ₀‖ / ‖θ₀‖, θ₀ the base rounded to the run's dtype."""
    changed = total = 0
    moved = norm = 0.0
    for name, after in run.items():
        if name not in base:  # a tied head saved under its own name
            continue
        start = base[name].to(after.dtype).double()
        delta = after.double() - start
        changed += int((delta != 0).sum())
        total += delta.numel()
        moved += float(delta.pow(2).sum())
        norm += float(start.pow(2).sum())
    return changed / total, (moved / norm) ** 0.5


def main() -> None:
    from openrlhf_tis.demo.default_model import default_model_dir

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=str(default_model_dir()), help="the base model (default: embedded SmolLM2)")
    parser.add_argument("--updates", type=float, nargs="+", default=[2e-5, 1e-4, 4.8e-4],
                        help="update sizes to test (default: one Adam step at lr 2e-5, and larger drifts)")
    parser.add_argument("runs", nargs="*", help="run directories whose model/ holds the trained weights")
    args = parser.parse_args()
    base = load_weights(args.model)
    flat = torch.cat([w.flatten().float() for w in base.values()])
    print(f"base {args.model}: {flat.numel():,} weights, median |w| {float(flat.abs().median()):.3g}")
    print(f"{'update':>10} {'survives bf16 rounding':>24}")
    for update in args.updates:
        print(f"{update:10.2g} {survival(flat, update):24.3f}")
    if args.runs:
        print(f"{'run':60} {'dtype':>8} {'changed':>8} {'rel change':>11}")
    for run_dir in args.runs:
        trained = load_weights(Path(run_dir) / "model")
        changed, relative = movement(base, trained)
        dtype = str(next(iter(trained.values())).dtype).removeprefix("torch.")
        print(f"{str(run_dir)[-60:]:60} {dtype:>8} {changed:8.3f} {relative:11.2e}")


if __name__ == "__main__":
    main()
