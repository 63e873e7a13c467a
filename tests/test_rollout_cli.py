"""--vllm.rollout_precision through train_ppo_ray: checks before Ray, and the engines' start directory."""

from __future__ import annotations

import pytest
from _support import refused, write_calibration

from openrlhf_tis.cli import train_ppo_ray
from openrlhf_tis.rollout.calibration_file import Calibration, save_calibration
from openrlhf_tis.rollout.checkpoint import read_config, read_plan
from openrlhf_tis.run_spec import run_spec


def test_bad_precision_requests_are_one_message_before_ray(valid_argv, tiny_model_dir, tmp_path, capsys):
    other = dict(read_config(tiny_model_dir), num_hidden_layers=12)
    cal = save_calibration(tmp_path / "cal.safetensors", Calibration({}), other, 0.5, 0)
    err = refused(valid_argv + ["--vllm.rollout_precision", "int8", "--vllm.int8_calibration", str(cal)], capsys)
    assert "--vllm.int8_calibration" in err and "another model" in err and "num_hidden_layers" in err
    err = refused(valid_argv + ["--vllm.int8_scales", "frozen"], capsys)
    assert "--vllm.int8_scales: only applies" in err
    err = refused(valid_argv + ["--vllm.int8_weight_bits", "8"], capsys)
    assert "--vllm.int8_weight_bits: only applies" in err
    err = refused(valid_argv + ["--vllm.rollout_precision", "int8", "--vllm.int8_weight_bits", "3"], capsys)
    assert "--vllm.int8_weight_bits" in err and "invalid choice" in err  # argparse names it
    assert not (tmp_path / "run" / "rollout_model").exists()


def test_bad_static_activation_requests_are_one_message_before_ray(valid_argv, tiny_model_dir, tmp_path, capsys):
    int8 = ["--vllm.rollout_precision", "int8"]
    err = refused(valid_argv + int8 + ["--vllm.int8_activations", "static"], capsys)
    assert "--vllm.int8_activations: static needs --vllm.int8_calibration" in err
    smooth_only = write_calibration(tiny_model_dir, tmp_path / "smooth.safetensors", static=False)
    static = ["--vllm.int8_activations", "static"]
    err = refused(valid_argv + int8 + static + ["--vllm.int8_calibration", str(smooth_only)], capsys)
    assert "--vllm.int8_activations: static, but" in err and "has no activation scales" in err
    err = refused(valid_argv + ["--vllm.rollout_precision", "fp32", "--vllm.int8_activations", "static"], capsys)
    assert "--vllm.int8_activations: only applies to --vllm.rollout_precision int8, not fp32" in err
    err = refused(valid_argv + int8 + ["--vllm.int8_activations", "per_token"], capsys)  # argparse names it too
    assert "--vllm.int8_activations" in err and "invalid choice" in err
    assert not (tmp_path / "run" / "rollout_model").exists()


@pytest.fixture()
def engine_calls(monkeypatch):
    """Upstream's engine factory recorded instead of run; the rollout_engine patch undone after the test."""
    import openrlhf.trainer.ray as upstream_ray
    import openrlhf.trainer.ray.vllm_engine as upstream_engine

    calls = []
    monkeypatch.setattr(upstream_ray, "create_vllm_engines", lambda *a, **k: calls.append((a, k)))
    for module in (upstream_ray, upstream_engine):
        monkeypatch.setattr(module, "__openrlhf_tis_originals__", {}, raising=False)
    monkeypatch.setattr(upstream_engine, "RolloutRayActor", upstream_engine.RolloutRayActor)
    return calls


def test_int8_run_writes_the_rollout_model_and_points_the_engines_at_it(valid_argv, tmp_path, engine_calls):
    import openrlhf.trainer.ray as upstream_ray
    import openrlhf.trainer.ray.vllm_engine as upstream_engine

    calls = engine_calls
    args = train_ppo_ray.parse(valid_argv + ["--vllm.rollout_precision", "int8", "--vllm.int8_scales", "frozen",
                                             "--vllm.fp32_lm_head", "--vllm.int8_weight_bits", "7"], cpu=True)
    dst = train_ppo_ray.prepare_rollout_engines(args, run_spec(args).rollout)
    assert dst == str((tmp_path / "run" / "rollout_model").resolve())
    assert read_plan(dst)["scale_mode"] == "frozen" and read_plan(dst)["weight_bits"] == 7
    cfg = read_config(dst)
    assert cfg["head_dtype"] == "float32" and cfg["quantization_config"]["format"] == "int-quantized"
    upstream_ray.create_vllm_engines(1, 1, "actor_model", 42, logprobs_mode="processed_logprobs")
    assert calls == [((1, 1, dst, 42), {"logprobs_mode": "processed_logprobs"})]
    assert "PrecisionRolloutRayActor" in upstream_engine.RolloutRayActor.__ray_metadata__.class_name


def test_default_precision_changes_nothing(valid_argv):
    args = train_ppo_ray.parse(valid_argv, cpu=True)
    assert getattr(args, "vllm.rollout_precision") == "bf16"
    assert train_ppo_ray.prepare_rollout_engines(args, run_spec(args).rollout) is None


@pytest.mark.parametrize(
    ("precision", "expected"),
    [("fp32", {"dtype": "float32"}), ("fp8", {"dtype": "bfloat16", "quantization": "fp8_per_channel"}),
     ("int8", {"dtype": "bfloat16"})],
)
def test_engines_take_dtype_and_quantization_from_the_rollout_dir(valid_argv, precision, expected, engine_calls):
    from openrlhf_tis.rollout.engine_actor import plan_engine_overrides

    args = train_ppo_ray.parse(valid_argv + ["--vllm.rollout_precision", precision], cpu=True)
    rollout_dir = train_ppo_ray.prepare_rollout_engines(args, run_spec(args).rollout)
    assert read_plan(rollout_dir)["precision"] == precision
    assert plan_engine_overrides(rollout_dir, cuda=False) == expected
    assert plan_engine_overrides(getattr(args, "actor.model_name_or_path"), cuda=False) == {}  # plain model


def test_static_int8_run_writes_scales_into_the_rollout_model(valid_argv, tiny_model_dir, tmp_path, engine_calls,
                                                             without_amx):
    from openrlhf_tis.rollout.checkpoint import load_int8_plan

    cal = write_calibration(tiny_model_dir, tmp_path / "cal.safetensors", static=True)
    args = train_ppo_ray.parse(valid_argv + ["--vllm.rollout_precision", "int8", "--vllm.int8_activations", "static",
                                             "--vllm.int8_calibration", str(cal)], cpu=True)
    dst = train_ppo_ray.prepare_rollout_engines(args, run_spec(args).rollout)
    plan = read_plan(dst)
    assert plan["activations"] == "static" and plan["input_scales"]["count"] == 14
    acts = read_config(dst)["quantization_config"]["config_groups"]["group_0"]["input_activations"]
    assert acts == {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "tensor", "dynamic": False}
    int8_plan = load_int8_plan(dst)  # what every sync re-sends
    assert int8_plan.activations == "static" and len(int8_plan.input_scales) == 14
