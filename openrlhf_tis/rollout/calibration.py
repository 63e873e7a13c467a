"""Calibrate once on data, reuse at every sync: SmoothQuant smoothing factors for INT8 rollouts.

SmoothQuant (Xiao et al. 2023, arXiv:2211.10438, eq. 4): for a projection group fed by one norm,
  s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)
per input channel j, with max|X_j| from activations on calibration prompts and max|W_j| over the
group's weights. Dividing the norm's weight by s and multiplying the projections' columns by s is
exact in real arithmetic and moves activation outliers into the (per-channel quantized) weights.
The factors are stored in a safetensors file with the model's fingerprint, so a file from another
model is refused before any engine starts.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from openrlhf_tis.rollout.quantize import SMOOTH_GROUPS, fingerprint_mismatch, model_fingerprint

META_KEY = "openrlhf_tis_calibration"


class CalibrationMismatchError(ValueError):
    """The calibration file was made for a different model."""


@torch.no_grad()
def calibrate_smoothing(model, prompts_token_ids: list[list[int]], alpha: float = 0.5) -> dict[str, torch.Tensor]:
    """Per-norm smoothing factors from an HF causal LM run on calibration prompts (fp32)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    act_max: dict[str, torch.Tensor] = {}
    hooks = []
    for name, module in model.named_modules():
        for norm, (block, projs) in SMOOTH_GROUPS.items():
            if name.endswith(f".{block}.{projs[0]}"):
                norm_name = name.rsplit(".", 2)[0] + f".{norm}.weight"

                def hook(_mod, inputs, _norm_name=norm_name):
                    x = inputs[0].detach().float().reshape(-1, inputs[0].shape[-1]).abs().amax(0)
                    prev = act_max.get(_norm_name)
                    act_max[_norm_name] = x if prev is None else torch.maximum(prev, x)

                hooks.append(module.register_forward_pre_hook(hook))
    try:
        model.eval()
        for ids in prompts_token_ids:
            model(torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()
    params = dict(model.named_parameters())
    smoothing = {}
    for norm_name, x_max in act_max.items():
        layer, norm = norm_name.rsplit(".", 2)[0], norm_name.rsplit(".", 2)[1]
        block, projs = SMOOTH_GROUPS[norm]
        weights = [params[f"{layer}.{block}.{p}.weight"].detach().float() for p in projs]
        w_max = torch.stack([w.abs().amax(0) for w in weights]).amax(0)
        s = x_max.clamp(min=1e-5).pow(alpha) / w_max.clamp(min=1e-5).pow(1 - alpha)
        smoothing[norm_name] = s.clamp(min=1e-5)
    return smoothing


def save_calibration(path: str | Path, smoothing: dict[str, torch.Tensor], model_config: dict, alpha: float,
                     n_prompts: int) -> Path:
    from safetensors.torch import save_file

    meta = {"fingerprint": model_fingerprint(model_config), "alpha": alpha, "n_prompts": n_prompts,
            "kind": "smoothquant"}
    path = Path(path)
    tensors = {k: v.contiguous().float() for k, v in smoothing.items()}
    save_file(tensors, str(path), metadata={META_KEY: json.dumps(meta)})
    return path


def load_calibration(path: str | Path, model_config: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """Smoothing factors and metadata; CalibrationMismatchError when made for another model."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        raw = (f.metadata() or {}).get(META_KEY)
        if raw is None:
            raise CalibrationMismatchError(f"{path} is not an openrlhf_tis calibration file (no {META_KEY} metadata)")
        meta = json.loads(raw)
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    diff = fingerprint_mismatch(model_fingerprint(model_config), meta.get("fingerprint", {}))
    if diff:
        raise CalibrationMismatchError(f"{path} was calibrated for another model ({'; '.join(diff)})")
    hidden = model_config.get("hidden_size")
    for k, v in tensors.items():
        if v.shape != (hidden,):
            raise CalibrationMismatchError(
                f"{path}: factor {k} has shape {tuple(v.shape)}, model hidden size is {hidden}")
    return tensors, meta


def main(argv: list[str] | None = None) -> None:
    """`python -m openrlhf_tis.rollout.calibration --model DIR --prompts FILE.jsonl --out FILE`."""
    import argparse

    parser = argparse.ArgumentParser(description="Calibrate SmoothQuant factors for INT8 rollouts (once per run).")
    parser.add_argument("--model", required=True, help="HF model directory (the actor's initial weights)")
    parser.add_argument("--prompts", required=True, help="JSONL calibration prompts")
    parser.add_argument("--input_key", default="input", help="JSON key holding the prompt text")
    parser.add_argument("--max_prompts", type=int, default=64)
    parser.add_argument("--alpha", type=float, default=0.5, help="SmoothQuant migration strength")
    parser.add_argument("--out", required=True, help="output .safetensors (pass it as --vllm.int8_calibration)")
    args = parser.parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    with open(args.prompts, encoding="utf-8") as f:
        texts = [json.loads(line)[args.input_key] for line in f if line.strip()][: args.max_prompts]
    ids = [tok(t)["input_ids"] for t in texts]
    smoothing = calibrate_smoothing(model, ids, args.alpha)
    with open(Path(args.model) / "config.json", encoding="utf-8") as f:
        config = json.load(f)
    print(save_calibration(args.out, smoothing, config, args.alpha, len(ids)))


if __name__ == "__main__":
    main()
