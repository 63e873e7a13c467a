"""`--vllm.routing_replay r3` is refused before Ray starts, naming the flag and the reason: no engine to return
routed experts, a dense model, an MoE architecture the trainer's replay does not cover, an engine that cannot return
them, and (while the engine side is not wired) any other request. `off` is upstream's run, unchanged."""

from __future__ import annotations

import importlib.util
import json

import pytest
from _support import error_line, refused

from openrlhf_tis.moe import coverage


def _model_dir(tmp_path, config: dict):
    """A model directory as far as the checks before Ray read it: its config.json."""
    path = tmp_path / config["model_type"]
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


QWEN3_MOE = {"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2}
QWEN2_MOE = {"model_type": "qwen2_moe", "num_experts": 4, "num_experts_per_tok": 2}


def _replacing_model(argv: list[str], path: str) -> list[str]:
    i = argv.index("--actor.model_name_or_path")
    return [*argv[:i + 1], path, *argv[i + 2:]]


def test_without_an_engine_r3_is_refused(valid_argv, capsys):
    line = error_line(refused(valid_argv + ["--vllm.routing_replay", "r3"], capsys))
    assert "--vllm.routing_replay" in line and "no engine" in line


@pytest.mark.parametrize("config, reason", [
    (None, "dense model"),  # the tiny Qwen2 of valid_argv
    (QWEN2_MOE, "'qwen2_moe' is a mixture of experts whose router the fork does not replace"),
])
def test_a_model_without_replayable_routing_is_refused(valid_argv, tmp_path, capsys, config, reason):
    argv = valid_argv if config is None else _replacing_model(valid_argv, _model_dir(tmp_path, config))
    line = error_line(refused(argv + ["--vllm.num_engines", "1", "--vllm.routing_replay", "r3"], capsys))
    assert "--vllm.routing_replay" in line and reason in line


def _triton(monkeypatch, tmp_path, *, cpu_backend: bool) -> None:
    """A Triton install seen through importlib, with or without a CPU backend (the checks import nothing)."""
    package = tmp_path / "triton"
    (package / "backends" / ("cpu" if cpu_backend else "nvidia")).mkdir(parents=True)
    (package / "__init__.py").write_text("")
    spec = importlib.util.spec_from_file_location("triton", package / "__init__.py")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: spec if name == "triton" else real(name, *a))


@pytest.mark.parametrize("cpu_backend, reason", [
    (False, "returns routed experts only from its Model Runner V2"),
    (True, "not yet wired to the engines"),
])
def test_a_covered_moe_is_refused_by_the_engine_or_as_not_yet_wired(valid_argv, tmp_path, capsys, monkeypatch,
                                                                     cpu_backend, reason):
    _triton(monkeypatch, tmp_path, cpu_backend=cpu_backend)
    argv = _replacing_model(valid_argv, _model_dir(tmp_path, QWEN3_MOE))
    line = error_line(refused(argv + ["--vllm.num_engines", "1", "--vllm.routing_replay", "r3"], capsys))
    assert "--vllm.routing_replay" in line and reason in line


def test_the_installed_engines_answer(monkeypatch, tmp_path):
    """vLLM 0.32 has enable_return_routed_experts; on CPU it needs Triton with a CPU backend."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a))
    assert "Triton" in coverage.engine_refusal(cuda=False)
    assert coverage.engine_refusal(cuda=True) is None
    _triton(monkeypatch, tmp_path, cpu_backend=False)
    assert "Triton" in coverage.engine_refusal(cuda=False)


@pytest.mark.parametrize("config, moe", [
    ({"model_type": "qwen2"}, False),
    ({"model_type": "qwen3_moe", "num_experts": 0}, False),  # zero experts: dense
    (QWEN3_MOE, True),
    ({"model_type": "mixtral", "num_local_experts": 8}, True),
    ({"model_type": "deepseek_v3", "n_routed_experts": 256}, True),
    ({"model_type": "llava", "text_config": {"model_type": "mixtral", "num_local_experts": 8}}, True),
])
def test_moe_is_read_from_the_config(config, moe):
    assert coverage.is_moe(config) is moe
    refusal = coverage.replay_refusal(config)
    covered = moe and (config.get("text_config") or config)["model_type"] in coverage.COVERED_MODEL_TYPES
    assert (refusal is None) is covered
