"""What a sync must load into its engine: the trainer's float weights, or their INT8 re-quantization.

Upstream's protocol broadcasts every parameter in the trainer's dtype (bf16). Sending int8 tensors plus scales
instead would mean rewriting the trainer's loop, which has no seam; so the engine quantizes what it received with
the same pure-torch functions that wrote its initial INT8 checkpoint (rollout/quantize.py), using the calibration
stored in the rollout model directory. The arithmetic is the same whichever process and device run it; what
matters (docs/design.md §5, trap 5) is that float weights are never cast unscaled into the engine's int8
parameters.
"""

from __future__ import annotations

import sys
import time

import torch

from openrlhf_tis.rollout.checkpoint import load_int8_plan, read_plan
from openrlhf_tis.rollout.quantize import is_quantized_weight, quantize_named_weights

_PLAN_ATTR = "_openrlhf_tis_rollout_plan"


class QuantizedSyncError(RuntimeError):
    """A sync would load float weights into an INT8 engine without quantizing them."""


def _plan(model_runner):
    cached = getattr(model_runner, _PLAN_ATTR, None)
    if cached is None:
        model_dir = model_runner.model_config.model
        meta = read_plan(model_dir) or {"precision": "none"}
        plan = load_int8_plan(model_dir) if meta["precision"] == "int8" else None
        cached = (model_dir, meta, plan, [0])
        setattr(model_runner, _PLAN_ATTR, cached)
    return cached


def prepare_for_engine(model_runner, named_tensors: list[tuple[str, torch.Tensor]]
                       ) -> tuple[list[tuple[str, torch.Tensor]], dict | None]:
    """Checkpoint-format trainer weights -> what this engine must load (quantized for INT8 engines), and the
    re-quantization's statistics (this engine's sync count, scale mode, seconds, saturation; None if none ran)."""
    model_dir, meta, plan, counter = _plan(model_runner)
    if plan is None:
        if getattr(model_runner.model_config, "quantization", None) == "compressed-tensors" and any(
            is_quantized_weight(n) and t.is_floating_point() for n, t in named_tensors
        ):
            raise QuantizedSyncError(
                f"weight sync: engine {model_dir} holds int8 weights but has no {model_dir}/openrlhf_tis_rollout.json "
                "plan; float weights would be cast into int8 parameters unscaled. Start it from a directory written "
                "by openrlhf_tis.rollout.checkpoint.write_rollout_model."
            )
        return named_tensors, None
    t0 = time.perf_counter()
    out, stats = quantize_named_weights(named_tensors, plan, model_runner.model_config.dtype)
    counter[0] += 1
    record = {"sync": counter[0], "scale_mode": plan.scale_mode, "quantize_s": time.perf_counter() - t0,
              **stats.as_dict()}
    print(f"[openrlhf_tis] int8 sync {counter[0]}: {stats.saturated} of {stats.values} weights saturated "
          f"({stats.saturated_fraction:.2e}, scales {plan.scale_mode}), quantized in {record['quantize_s']:.3f}s",
          file=sys.stderr, flush=True)
    return out, record
