"""The MoE demo model: the embedded SmolLM2-135M (a Llama) upcycled into a small Mixtral, no MoE download.

No small pretrained MoE is in the package registries, so the demo makes one (sparse upcycling): attention, norms and
embeddings are copied; every layer's dense MLP becomes `experts` experts, each a copy of it whose weights are
multiplied elementwise by (1 + expert_noise · N(0, 1)), seeded; a fresh router (N(0, router_std²), seeded, the
std transformers initialises a router with) picks the top-k of them for every token. Mixtral renormalises its top-k
gates, so with expert_noise = 0 every expert is the dense MLP and the model computes the dense model's function
(up to float rounding): the noise alone is what makes a different expert a different function, and the flat fresh
router's near-ties are what makes the engine's and the trainer's routing differ (docs/moe.md, the demo).

    python -m openrlhf_tis.demo.upcycle [DEST] [--source DENSE_DIR]

DEST defaults to `work/models/smollm2-135m-upcycled-mixtral` beside the default model; the source to the default
model (built first when missing). Published atomically (demo/publish.py) and built once: a complete DEST of the same
recipe is returned at once, one of another recipe refused.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from openrlhf_tis.demo.default_model import MARKER as SOURCE_MARKER
from openrlhf_tis.demo.default_model import DefaultModelError, default_model_dir, ensure_default_model
from openrlhf_tis.demo.publish import publish_atomically

UPCYCLED_DIR_NAME = "smollm2-135m-upcycled-mixtral"
MARKER = "openrlhf_tis_upcycled.json"  # written last: its presence is what "complete" means
REQUIRED_FILES = ("config.json", "tokenizer_config.json", MARKER)
_TMP_PREFIX = ".tmp-upcycled-model-"
_NOT_COPIED = ("model.safetensors", "model.safetensors.index.json", "config.json", SOURCE_MARKER)


class UpcycleError(RuntimeError):
    """The dense model cannot be upcycled, or DEST holds something else; the message says which and why."""


@dataclass(frozen=True)
class Recipe:
    """How the MoE is made from the dense model. 4 experts, top-2: the smallest MoE whose router keeps a gradient
    under renormalisation (top-1 of renormalised gates is always 1) and has a choice to get wrong, at twice the
    dense MLP's compute per token."""

    experts: int = 4
    top_k: int = 2
    expert_noise: float = 0.05  # relative std of each expert weight's multiplicative perturbation
    router_std: float = 0.02  # transformers' initializer_range: a fresh, flat router, so near-ties are common
    seed: int = 0


def upcycled_model_dir() -> Path:
    """Beside the default model: `<repo>/work/models/smollm2-135m-upcycled-mixtral`."""
    return default_model_dir().parent / UPCYCLED_DIR_NAME


def is_complete(model_dir: str | Path) -> bool:
    """True when model_dir holds every file a finished upcycle writes (the marker is written last)."""
    return all((Path(model_dir) / name).is_file() for name in REQUIRED_FILES)


def upcycled_config(dense: Any, recipe: Recipe) -> Any:
    """The MixtralConfig of `dense` (a LlamaConfig) with `recipe`'s experts; refused for a Llama that Mixtral's
    modules cannot compute (biases, tensor-parallel pretraining)."""
    from transformers import MixtralConfig

    if dense.model_type != "llama":
        raise UpcycleError(f"upcycling takes a Llama (Mixtral's attention is Llama's); got model_type "
                           f"{dense.model_type!r}")
    for field, ok in (("attention_bias", False), ("mlp_bias", False), ("pretraining_tp", 1)):
        if getattr(dense, field, ok) != ok:
            raise UpcycleError(f"a Llama with {field}={getattr(dense, field)!r} has no Mixtral equivalent")
    if not 1 <= recipe.top_k <= recipe.experts or recipe.experts < 2:
        raise UpcycleError(f"top_k {recipe.top_k} of {recipe.experts} experts: need 1 <= top_k <= experts, "
                           "experts >= 2")
    config = MixtralConfig(
        vocab_size=dense.vocab_size, hidden_size=dense.hidden_size, intermediate_size=dense.intermediate_size,
        num_hidden_layers=dense.num_hidden_layers, num_attention_heads=dense.num_attention_heads,
        num_key_value_heads=dense.num_key_value_heads, head_dim=dense.head_dim, hidden_act=dense.hidden_act,
        max_position_embeddings=dense.max_position_embeddings, rms_norm_eps=dense.rms_norm_eps,
        rope_parameters=dict(dense.rope_parameters), attention_dropout=dense.attention_dropout,
        tie_word_embeddings=dense.tie_word_embeddings, initializer_range=dense.initializer_range,
        bos_token_id=dense.bos_token_id, eos_token_id=dense.eos_token_id, pad_token_id=dense.pad_token_id,
        num_local_experts=recipe.experts, num_experts_per_tok=recipe.top_k, sliding_window=None,
    )
    config.architectures = ["MixtralForCausalLM"]
    return config


def upcycled_state_dict(dense_state: dict, num_layers: int, recipe: Recipe) -> dict:
    """Mixtral's parameters (transformers 5.19's in-memory layout: each layer's experts fused as
    `mlp.experts.gate_up_proj` (E, 2I, H), gate rows first, and `mlp.experts.down_proj` (E, H, I); the router is
    `mlp.gate.weight` (E, H)) from a Llama's. Draws are made in one fixed order from one seeded generator."""
    import torch

    rng = torch.Generator().manual_seed(recipe.seed)

    def perturbed(weight: torch.Tensor) -> torch.Tensor:
        noise = torch.randn(weight.shape, generator=rng, dtype=torch.float32)
        return weight * (1 + recipe.expert_noise * noise).to(weight.dtype)

    state = {name: tensor for name, tensor in dense_state.items() if ".mlp." not in name}
    for i in range(num_layers):
        prefix = f"model.layers.{i}.mlp."
        gate, up, down = (dense_state[f"{prefix}{p}_proj.weight"] for p in ("gate", "up", "down"))
        gate_up = torch.cat([gate, up], dim=0)
        state[f"{prefix}experts.gate_up_proj"] = torch.stack([perturbed(gate_up) for _ in range(recipe.experts)])
        state[f"{prefix}experts.down_proj"] = torch.stack([perturbed(down) for _ in range(recipe.experts)])
        router = torch.randn((recipe.experts, gate.shape[1]), generator=rng, dtype=torch.float32)
        state[f"{prefix}gate.weight"] = (router * recipe.router_std).to(gate.dtype)
    return state


def parameter_counts(config: Any) -> dict[str, int]:
    """Total parameters and those a token runs through (its top-k experts, not the others), embeddings counted
    once when tied."""
    h, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    heads, kv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    attention = h * heads * d * 2 + h * kv * d * 2
    per_layer = attention + 2 * h + config.num_local_experts * h  # the norms and the router
    expert = 3 * h * inter
    embeddings = config.vocab_size * h * (1 if config.tie_word_embeddings else 2) + h
    shared = embeddings + layers * per_layer
    return {"total": shared + layers * config.num_local_experts * expert,
            "active": shared + layers * config.num_experts_per_tok * expert}


def upcycle(dense_dir: str | Path, out_dir: str | Path, recipe: Recipe = Recipe()) -> Path:
    """Write the Mixtral upcycled from the Llama in dense_dir (fp32 safetensors, the tokenizer and generation
    config copied) to out_dir, with its marker last; returns out_dir."""
    import torch
    from transformers import AutoModelForCausalLM, MixtralForCausalLM

    dense_dir, out_dir = Path(dense_dir), Path(out_dir)
    dense = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32)
    config = upcycled_config(dense.config, recipe)
    state = upcycled_state_dict(dense.state_dict(), config.num_hidden_layers, recipe)
    del dense
    with torch.device("meta"):
        model = MixtralForCausalLM(config)
    model.load_state_dict(state, strict=True, assign=True)
    model.tie_weights()
    model.save_pretrained(out_dir)  # transformers writes Mixtral's checkpoint layout (experts.<e>.w1/w2/w3)
    for source in dense_dir.iterdir():
        if source.is_file() and source.name not in _NOT_COPIED and not source.name.startswith("model-"):
            shutil.copy2(source, out_dir / source.name)
    _write_marker(out_dir, dense_dir, recipe, parameter_counts(config))
    return out_dir


def _write_marker(out_dir: Path, dense_dir: Path, recipe: Recipe, counts: dict[str, int]) -> None:
    import transformers

    source_marker = dense_dir / SOURCE_MARKER
    info = {
        "recipe": asdict(recipe), "parameters": counts, "source": str(dense_dir),
        "source_marker": json.loads(source_marker.read_text()) if source_marker.is_file() else None,
        "transformers": transformers.__version__, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    (out_dir / MARKER).write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")


def ensure_upcycled_model(dest: str | Path | None = None, *, source: str | Path | None = None,
                          recipe: Recipe = Recipe()) -> Path:
    """Return dest holding the upcycled model, building it first (from `source`, by default the default model,
    itself built when missing) when it is not complete. A complete dest of another recipe, or a non-empty dest
    that is not complete, is refused rather than overwritten."""
    dest = Path(dest) if dest is not None else upcycled_model_dir()
    dest = dest.expanduser().absolute()
    if is_complete(dest):
        built = json.loads((dest / MARKER).read_text())["recipe"]
        if built != asdict(recipe):
            raise UpcycleError(f"{dest} was upcycled with {built}, not {asdict(recipe)}: remove it or pick another "
                               "path")
        return dest
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise UpcycleError(f"{dest} exists but is not a complete upcycled model: remove it or pick another path")
    dense_dir = Path(source) if source is not None else ensure_default_model()
    return publish_atomically(dest, _TMP_PREFIX, lambda work: upcycle(dense_dir, work / "model", recipe),
                              is_complete)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dest", nargs="?", default=None, help=f"model directory (default: {upcycled_model_dir()})")
    parser.add_argument("--source", default=None, help="the dense Llama directory (default: the default model)")
    args = parser.parse_args(argv)
    try:
        path = ensure_upcycled_model(args.dest, source=args.source)
    except (UpcycleError, DefaultModelError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(1) from e
    print(path)


if __name__ == "__main__":
    main()
