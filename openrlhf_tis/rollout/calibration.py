"""Calibrate once on data, reuse at every sync: SmoothQuant factors and static activation scales.

SmoothQuant (Xiao et al. 2023, arXiv:2211.10438, eq. 4): for a projection group fed by one norm,
  s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)
per input channel j, with max|X_j| from activations on calibration prompts and max|W_j| over the
group's weights. Dividing the norm's weight by s and multiplying the projections' columns by s is
exact in real arithmetic and moves activation outliers into the (per-channel quantized) weights.

Static activation scales (optional, `static_activations=True`): one symmetric per-tensor int8 scale
per quantized projection, s_x = max|x| / 127 over every calibration token of that projection's
input *as the int8 GEMM sees it*, i.e. after smoothing (x_j / s_j for the norm-fed groups, the raw
input for o_proj and down_proj). Since division by s_j > 0 is monotone, max_t |x_tj / s_j| =
(max_t |x_tj|) / s_j exactly, so one pass of per-channel maxima serves both calibrations. vLLM fuses
q/k/v and gate/up into one Linear with a single input scale (its loader keeps whichever shard's scale
arrives last), so each fused group gets one scale, stored identically under every member's name.

Dynamic fallback: a static scale serves a projection well only if its tokens have similar ranges.
The calibration measures, per projection, how many of the 127 levels the median calibration token
keeps under the static scale, and keeps the projections below `min_levels` on dynamic per-token
activations (SmolLM2's massive activations in some down_proj inputs leave the median token 0.1 level).

Everything is stored in one safetensors file with the model's fingerprint and a list of what it
contains (its format, writer and reader: `calibration_file`), so a file from another model, or one
without the tensors a run asks for, is refused before any engine starts.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch

from openrlhf_tis.errors import UsageError
from openrlhf_tis.rollout.calibration_file import (
    BLOCK_OF,
    Calibration,
    dynamic_projections,
    load_calibration,
    save_calibration,
)
from openrlhf_tis.rollout.quantize import INT8_MAX, PROJECTIONS, SMOOTH_GROUPS, fused_group
from openrlhf_tis.sigint import INTERRUPTED_EXIT, take_sigint

_PROJ_MODULE = re.compile(r"^(.*\.layers\.(\d+))\.(self_attn|mlp)\.(" + "|".join(PROJECTIONS) + r")$")


@torch.no_grad()
def _collect_inputs(model: torch.nn.Module, prompts_token_ids: list[list[int]], reduce,
                    merge) -> dict[str, torch.Tensor]:
    """Run the prompts through an HF causal LM and fold every decoder projection's input, as a float32
    [tokens, channels] matrix, into one tensor per projection module: reduce(name, x), then merge(prev, new)."""
    seen: dict[str, torch.Tensor] = {}
    hooks = []
    for name, module in model.named_modules():
        m = _PROJ_MODULE.match(name)
        if m is None or BLOCK_OF[m.group(4)] != m.group(3):
            continue

        def hook(_mod, inputs, _name=name):
            x = reduce(_name, inputs[0].detach().float().reshape(-1, inputs[0].shape[-1]))
            seen[_name] = x if _name not in seen else merge(seen[_name], x)

        hooks.append(module.register_forward_pre_hook(hook))
    try:
        model.eval()
        for ids in prompts_token_ids:
            model(torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()
    return seen


def activation_absmax(model: torch.nn.Module, prompts_token_ids: list[list[int]]) -> dict[str, torch.Tensor]:
    """Per-input-channel max |x| of every decoder projection's input, keyed by projection module name.

    One forward pass per prompt through an HF causal LM; float32 maxima (a max does not round).
    """
    return _collect_inputs(model, prompts_token_ids, lambda _n, x: x.abs().amax(0), torch.maximum)


def _gemm_divisor(module_name: str, smoothing: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """The smoothing factor s that divides this projection's input before the int8 GEMM (None: not smoothed)."""
    layer, block, proj = module_name.rsplit(".", 2)
    norm = next((n for n, (b, projs) in SMOOTH_GROUPS.items() if b == block and proj in projs), None)
    return smoothing.get(f"{layer}.{norm}.weight") if norm else None


def median_token_levels(model: torch.nn.Module, prompts_token_ids: list[list[int]],
                        smoothing: dict[str, torch.Tensor]) -> dict[str, float]:
    """How many of the 127 int8 levels a static per-tensor scale leaves the median calibration token.

    Per projection: 127 * median_t(max_j |x_tj / s_j|) / max_t(max_j |x_tj / s_j|), on the input the
    int8 GEMM sees (after smoothing). Near 127 when tokens have similar ranges; near 0 when a few
    tokens carry massive activations (SmolLM2-135M's later down_proj inputs: one token at 3086, the
    median at 1.6), where a static scale rounds ordinary tokens to zero.
    """
    def per_token_max(name, x):
        s = _gemm_divisor(name, smoothing)
        return (x if s is None else x / s.float()).abs().amax(1)

    token_max = _collect_inputs(model, prompts_token_ids, per_token_max, lambda a, b: torch.cat([a, b]))
    return {name: float(INT8_MAX * t.median() / t.max().clamp(min=torch.finfo(torch.float32).tiny))
            for name, t in token_max.items()}


def dynamic_fallback(levels: dict[str, float], min_levels: float) -> list[str]:
    """Projection modules to keep on dynamic per-token activations: those whose median token would get
    fewer than `min_levels` levels under a static scale. A fused group (q/k/v, gate/up) shares one input
    and one vLLM Linear, so it falls back whole, judged on its first member."""
    out = []
    for name, value in levels.items():
        layer, block, proj = name.rsplit(".", 2)
        group = fused_group(proj)
        if proj == group[0] and value < min_levels:
            out.extend(f"{layer}.{block}.{member}" for member in group)
    return sorted(out)


def smoothing_from_absmax(model: torch.nn.Module, act_max: dict[str, torch.Tensor],
                          alpha: float = 0.5) -> dict[str, torch.Tensor]:
    """SmoothQuant factors per norm (eq. 4) from the projection input maxima of `activation_absmax`."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    params = dict(model.named_parameters())
    smoothing = {}
    for norm, (block, projs) in SMOOTH_GROUPS.items():
        for module_name, x_max in act_max.items():
            if not module_name.endswith(f".{block}.{projs[0]}"):
                continue
            layer = module_name.rsplit(".", 2)[0]
            weights = [params[f"{layer}.{block}.{p}.weight"].detach().float() for p in projs]
            w_max = torch.stack([w.abs().amax(0) for w in weights]).amax(0)
            s = x_max.clamp(min=1e-5).pow(alpha) / w_max.clamp(min=1e-5).pow(1 - alpha)
            smoothing[f"{layer}.{norm}.weight"] = s.clamp(min=1e-5)
    return smoothing


def input_scales_from_absmax(act_max: dict[str, torch.Tensor],
                             smoothing: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Static per-tensor int8 scales max|x / s| / 127, keyed `<projection>.input_scale` (shape [1], fp32).

    A fused group's members share their input, so the group's scale is computed once (from its first
    member) and stored under every member's name: bitwise identical, whichever shard vLLM keeps.
    """
    scales: dict[str, torch.Tensor] = {}
    for module_name, x_max in act_max.items():
        layer, block, proj = module_name.rsplit(".", 2)
        group = fused_group(proj)
        if proj != group[0]:
            continue  # filled in from the group's first member
        s = _gemm_divisor(module_name, smoothing)
        x = x_max.float() if s is None else x_max.float() / s.float()
        scale = (x.amax() / INT8_MAX).clamp(min=torch.finfo(torch.float32).tiny).reshape(1)
        for member in group:
            scales[f"{layer}.{block}.{member}.input_scale"] = scale.clone()
    return scales


# Keep a projection static only if its median calibration token keeps >= 64 of the 127 levels (it
# loses at most one bit against its own per-token scale). The sweep over this threshold on SmolLM2-135M
# (docs/rollout_precision.md, "Static activation scales and the fallback threshold"): fewer levels cost
# accuracy fast, and at 64 the mismatch is near all-dynamic's.
DEFAULT_MIN_LEVELS = 64.0


def calibrate(model: torch.nn.Module, prompts_token_ids: list[list[int]], alpha: float = 0.5,
              static_activations: bool = False, min_levels: float = DEFAULT_MIN_LEVELS) -> Calibration:
    """Smoothing factors, and for static activations the per-projection scales with the dynamic fallback.

    One pass gives the per-channel maxima both calibrations need; static activations take a second
    pass for the per-token ranges that decide the fallback (`min_levels=0`: every projection static).
    """
    act_max = activation_absmax(model, prompts_token_ids)
    smoothing = smoothing_from_absmax(model, act_max, alpha)
    if not static_activations:
        return Calibration(smoothing)
    levels = median_token_levels(model, prompts_token_ids, smoothing)
    dynamic = dynamic_fallback(levels, min_levels)
    scales = {k: v for k, v in input_scales_from_absmax(act_max, smoothing).items()
              if k[: -len(".input_scale")] not in dynamic}
    return Calibration(smoothing, scales, dynamic, levels)


def calibrate_to_file(model_dir: str | Path, texts: list[str], out: str | Path, alpha: float = 0.5,
                      static_activations: bool = False, min_levels: float = DEFAULT_MIN_LEVELS,
                      chat_template: bool = False) -> Path:
    """Calibrate the HF model in `model_dir` (fp32) on prompt texts and write the file a run takes.

    `chat_template`: format each text as a user turn with the generation prompt, as a run with
    `--data.apply_chat_template` feeds the engine; the special tokens of the template carry their own
    activation ranges, so calibrating on raw text under-covers them.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from openrlhf_tis.rollout.checkpoint import read_config

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if chat_template:
        texts = [tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True)
                 for t in texts]
    ids = [tok(t, add_special_tokens=not chat_template)["input_ids"] for t in texts]
    cal = calibrate(model, ids, alpha, static_activations=static_activations, min_levels=min_levels)
    return save_calibration(out, cal, read_config(model_dir), alpha, len(ids))


def read_prompt_texts(path: str, input_key: str, limit: int) -> list[str]:
    """The first `limit` prompt texts of a prompt file; UsageError naming --prompts / --input_key otherwise."""
    from itertools import islice

    from openrlhf_tis.prompt_files import PromptFileError, prompt_records, read_prompt_file

    try:
        read_prompt_file(path, [input_key])
        records = list(islice(prompt_records(path), limit))
    except PromptFileError as err:
        raise UsageError("--input_key" if err.key else "--prompts", str(err)) from None
    for where, record in records:
        if not isinstance(record[input_key], str):
            raise UsageError("--input_key", f"{where}: {input_key!r} holds a {type(record[input_key]).__name__}, "
                             "not a prompt text")
    return [record[input_key] for _, record in records]


def _check_main_args(args) -> list[str]:
    """Every input of the command, checked before a model loads; returns the prompt texts."""
    from openrlhf_tis.model_files import check_model_path

    check_model_path("--model", args.model, required=True)
    if not 0.0 <= args.alpha <= 1.0:
        raise UsageError("--alpha", f"must be in [0, 1], got {args.alpha}")
    if args.max_prompts < 1:
        raise UsageError("--max_prompts", f"must be >= 1, got {args.max_prompts}")
    if args.min_levels < 0:
        raise UsageError("--min_levels", f"must be >= 0, got {args.min_levels}")
    out = Path(args.out)
    if out.is_dir():
        raise UsageError("--out", f"{out} is a directory; name the .safetensors file to write")
    if not out.resolve().parent.is_dir():
        raise UsageError("--out", f"directory {out.resolve().parent} does not exist")
    if not os.access(out.resolve().parent, os.W_OK):
        raise UsageError("--out", f"directory {out.resolve().parent} is not writable")
    return read_prompt_texts(args.prompts, args.input_key, args.max_prompts)


def main(argv: list[str] | None = None) -> None:
    """`python -m openrlhf_tis.rollout.calibration --model DIR --prompts F.jsonl --out F [--static_activations]`."""
    import argparse

    take_sigint()
    parser = argparse.ArgumentParser(description="Calibrate INT8 rollouts once per run: SmoothQuant factors and, "
                                     "optionally, static activation scales.")
    parser.add_argument("--model", required=True, help="HF model directory (the actor's initial weights)")
    parser.add_argument("--prompts", required=True, help="JSONL calibration prompts")
    parser.add_argument("--input_key", default="input", help="JSON key holding the prompt text")
    parser.add_argument("--max_prompts", type=int, default=64)
    parser.add_argument("--alpha", type=float, default=0.5, help="SmoothQuant migration strength")
    parser.add_argument("--static_activations", action="store_true",
                        help="also store one static int8 input scale per projection (max|x/s|/127), for "
                        "--vllm.int8_activations static")
    parser.add_argument("--min_levels", type=float, default=DEFAULT_MIN_LEVELS,
                        help="with --static_activations: keep a projection on dynamic per-token activations when "
                        "its median calibration token would get fewer int8 levels than this (0: all static)")
    parser.add_argument("--apply_chat_template", action="store_true",
                        help="format each prompt with the tokenizer's chat template (as --data.apply_chat_template)")
    parser.add_argument("--out", required=True, help="output .safetensors (pass it as --vllm.int8_calibration)")
    args = parser.parse_args(argv)
    try:
        texts = _check_main_args(args)
        out = calibrate_to_file(args.model, texts, args.out, args.alpha, args.static_activations, args.min_levels,
                                args.apply_chat_template)
    except KeyboardInterrupt:  # safetensors writes --out through a temp file: an old file stays whole
        parser.exit(INTERRUPTED_EXIT, f"{parser.prog}: interrupted\n")
    except UsageError as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    except OSError as err:  # transformers' "no file named model.safetensors", a weight file that cannot be read
        parser.exit(2, f"{parser.prog}: error: --model: cannot load {args.model}: {str(err).splitlines()[0]}\n")
    if args.static_activations:
        meta = load_calibration(out, json.loads((Path(args.model) / "config.json").read_text()))[1]
        dynamic = dynamic_projections(meta)
        print(f"static input scales for {len(meta['median_levels']) - len(dynamic)} projections; {len(dynamic)} kept "
              f"dynamic (median token < {args.min_levels:g} levels){': ' + ', '.join(dynamic[:4]) if dynamic else ''}"
              f"{', ...' if len(dynamic) > 4 else ''} (all listed in the file's metadata)")
    print(out)


if __name__ == "__main__":
    main()
