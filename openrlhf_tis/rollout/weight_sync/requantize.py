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
    model_dir, precision, requantize, counter = _plan(model_runner)
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
    t0 = time.perf_counter()
    out, stats = requantize(named_tensors, model_runner.model_config.dtype)
    counter[0] += 1
    record = {"sync": counter[0], "precision": precision, "quantize_s": time.perf_counter() - t0, **stats}
    print(f"[openrlhf_tis] {precision} sync {counter[0]}: {stats['tensors']} weights re-quantized "
          f"(max rel. error {stats['max_rel_error']:.2e}"
          + (f", {stats['saturated']} of {stats['values']} saturated" if "saturated" in stats else "")
          + f") in {record['quantize_s']:.3f}s", file=sys.stderr, flush=True)
    return out, record
