"""Which models routing replay can serve, read from config.json alone (no torch), so a bad request is refused
before Ray starts.

A model is a mixture of experts when its config counts routed experts under one of the names transformers'
architectures use; replay covers the architectures whose router `routing_replay.py` re-classes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

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
