"""Which models routing replay can serve, read from config.json alone (no torch), so a bad request is refused
before Ray starts.

A model is a mixture of experts when its config counts routed experts under one of the names transformers'
architectures use; replay covers the architectures whose router `routing_replay.py` re-classes.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from pathlib import Path
from typing import Any

REPLAY_FLAG = "--vllm.routing_replay"
REPLAY_MODES = ("off", "r3")
"""off: no replay (upstream); r3: the engines' expert choices replayed in the trainer's forwards."""

COVERED_MODEL_TYPES = ("mixtral", "olmoe", "qwen3_moe")
"""model_type values whose transformers 5.19 top-k router routing_replay.py replaces (tests/test_routing_replay.py
builds one model of each)."""

EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
"""Where transformers' MoE configs count their routed experts (Qwen2/3-MoE and OLMoE, Mixtral, DeepSeek, others)."""


def _text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """A multimodal config keeps its language model's fields under text_config."""
    return config.get("text_config") or config


def is_moe(config: Mapping[str, Any]) -> bool:
    """Whether config.json describes a model with routed experts."""
    text = _text_config(config)
    return any(isinstance(text.get(key), int) and text[key] > 0 for key in EXPERT_COUNT_KEYS)


def replay_refusal(config: Mapping[str, Any]) -> str | None:
    """Why routing replay cannot serve this config.json's model (None when it can)."""
    model_type = _text_config(config).get("model_type", config.get("model_type"))
    if not is_moe(config):
        return f"model_type {model_type!r} is a dense model (no routed experts in config.json): there is no routing " \
               "to replay"
    if model_type not in COVERED_MODEL_TYPES:
        return f"model_type {model_type!r} is a mixture of experts whose router the fork does not replace; " \
               f"covered: {', '.join(COVERED_MODEL_TYPES)}"
    return None


CAPTURE_SEAM = ("model_executor", "layers", "fused_moe", "router", "base_router.py")
"""The installed vLLM file whose routers offer `set_capture_fn`: the seam of rollout/routing_capture.py."""


def engine_refusal(*, cuda: bool) -> str | None:
    """Why the engines of a CUDA (`cuda`) or CPU run cannot return each sampled token's routed experts (None when they
    can); read from the installed files, without importing vLLM.

    On CPU the fork captures them itself on vLLM's default (V1) runner, through each MoE router's `capture_fn`
    (rollout/routing_capture.py): vLLM's own `enable_return_routed_experts` needs its Model Runner V2, which needs
    Triton with a CPU backend that the Triton torch installs lacks (docs/moe.md). On CUDA neither the fork's capture
    nor vLLM's own option is wired into the engines yet."""
    if cuda:
        return "r3 is built for CPU runs only: on CUDA the engines' routed experts (vLLM's " \
               "enable_return_routed_experts) are not yet wired to the samples (docs/moe.md)"
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        return "vLLM is not installed"
    seam = Path(spec.origin).parent.joinpath(*CAPTURE_SEAM)
    if not seam.is_file() or "set_capture_fn" not in seam.read_text(encoding="utf-8"):
        return f"the installed vLLM's MoE routers have no set_capture_fn ({'/'.join(CAPTURE_SEAM)}), through which " \
               "the fork captures the experts a CPU engine routed each token to"
    return None
