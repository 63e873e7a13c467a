"""What a sync must load into its engine: the trainer's float weights, or their re-quantization (INT8 or block FP8).

Upstream's protocol broadcasts every parameter in the trainer's dtype (bf16). Sending quantized tensors plus scales
instead would mean rewriting the trainer's loop, which has no seam; so the engine quantizes what it received with
the same pure-torch functions that wrote its initial quantized checkpoint (rollout/quantize.py for INT8 W8A8 with the
calibration stored in the rollout model directory, rollout/fp8_blocks.py for block FP8). The arithmetic is the same
whichever process and device run it; what matters (docs/design.md §5, trap 5) is that float weights are never cast
unscaled into the engine's quantized parameters.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import torch

from openrlhf_tis.rollout.checkpoint import load_int8_plan, read_plan
from openrlhf_tis.rollout.fp8_blocks import quantize_named_fp8
from openrlhf_tis.rollout.quantize import is_quantized_weight, quantize_named_weights

_PLAN_ATTR = "_openrlhf_tis_rollout_plan"
Named = list[tuple[str, torch.Tensor]]
Requantize = Callable[[Named, torch.dtype], tuple[Named, dict]]


class QuantizedSyncError(RuntimeError):
    """A sync would load float weights into a quantized engine without quantizing them."""


def requantizer(meta: dict, model_dir: str) -> Requantize | None:
    """How a sync into the engine of rollout plan `meta` quantizes the trainer's weights (None: it does not)."""
    if meta["precision"] == "int8":
        plan = load_int8_plan(model_dir)

        def int8(named: Named, dtype: torch.dtype) -> tuple[Named, dict]:
            out, stats = quantize_named_weights(named, plan, dtype)
            return out, {"scale_mode": plan.scale_mode, **stats.as_dict()}
        return int8
    if meta["precision"] == "fp8" and meta.get("fp8_block"):
        block = tuple(meta["fp8_block"])

        def fp8(named: Named, dtype: torch.dtype) -> tuple[Named, dict]:
            out, stats = quantize_named_fp8(named, is_quantized_weight, dtype, block)
            return out, {"fp8_block": list(block), **stats}
        return fp8
    return None


def _plan(model_runner):
    cached = getattr(model_runner, _PLAN_ATTR, None)
    if cached is None:
        model_dir = model_runner.model_config.model
        meta = read_plan(model_dir) or {"precision": "none"}
        cached = (model_dir, meta["precision"], requantizer(meta, model_dir), [0])
        setattr(model_runner, _PLAN_ATTR, cached)
    return cached


def prepare_for_engine(model_runner, named_tensors: Named) -> tuple[Named, dict | None]:
    """Checkpoint-format trainer weights -> what this engine must load (quantized for INT8 and block-FP8 engines),
    and the re-quantization's statistics (this engine's sync count, seconds, error; None if none ran)."""
    t0 = time.perf_counter()
    out, stats = requantize_part(model_runner, named_tensors)
    if stats is None:
        return out, None
    return out, sync_record(model_runner, stats, time.perf_counter() - t0)


def requantize_part(model_runner, named_tensors: Named) -> tuple[Named, dict | None]:
    """Part of a sync's weights -> what this engine must load, and that part's statistics (None for a float
    engine); a sync streamed tensor by tensor (layerwise.py) merges the parts' (merged_stats) and counts the sync
    once (sync_record)."""
    model_dir, _, requantize, _ = _plan(model_runner)
    if requantize is None:
        if getattr(model_runner.model_config, "quantization", None) in ("compressed-tensors", "fp8") and any(
            is_quantized_weight(n) and t.is_floating_point() and t.element_size() > 1 for n, t in named_tensors
        ):
            raise QuantizedSyncError(
                f"weight sync: engine {model_dir} holds quantized weights but has no "
                f"{model_dir}/openrlhf_tis_rollout.json plan to re-quantize with; float weights would be cast into "
                "its quantized parameters unscaled. Start it from a directory written by "
                "openrlhf_tis.rollout.checkpoint.write_rollout_model."
            )
        return named_tensors, None
    return requantize(named_tensors, model_runner.model_config.dtype)


def merged_stats(total: dict | None, part: dict | None) -> dict | None:
    """Two parts' statistics as one pass's: maxima (`max_*`) of the maxima, sums of the counts, the rest (the
    plan's block, scale mode) as the first part says, and the saturated share recomputed from the sums."""
    if total is None or part is None:
        return total or part
    out = dict(total)
    for key, value in part.items():
        if key.startswith("max_"):
            out[key] = max(out.get(key, value), value)
        elif isinstance(value, int) and not isinstance(value, bool):
            out[key] = out.get(key, 0) + value
    if "saturated" in out:
        out["saturated_fraction"] = out["saturated"] / out["values"] if out["values"] else 0.0
    return out


def sync_record(model_runner, stats: dict, seconds: float) -> dict:
    """One sync's re-quantization counted for this engine, said on its console, and returned as the metrics'
    record (this engine's sync count, seconds spent quantizing, the pass's statistics)."""
    _, precision, _, counter = _plan(model_runner)
    counter[0] += 1
    record = {"sync": counter[0], "precision": precision, "quantize_s": seconds, **stats}
    print(f"[openrlhf_tis] {precision} sync {counter[0]}: {stats['tensors']} weights re-quantized "
          f"(max rel. error {stats['max_rel_error']:.2e}"
          + (f", {stats['saturated']} of {stats['values']} saturated" if "saturated" in stats else "")
          + f") in {record['quantize_s']:.3f}s", file=sys.stderr, flush=True)
    return record
