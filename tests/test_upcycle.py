"""The upcycled MoE demo model (demo/upcycle.py), built from a tiny dense Llama written here (the real SmolLM2 may be
absent): with no perturbation it computes the dense model's function; with it, each expert is its own function; the
written checkpoint is a Mixtral that routing replay covers; the build is atomic, cached and refuses what it cannot
upcycle. References: the dense model's own logits and weights, and parameter counts read off the loaded model."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from openrlhf_tis.demo import upcycle as up
from openrlhf_tis.demo.tiny_model import build_tiny_model
from openrlhf_tis.moe.coverage import is_moe, moe_layers, replay_refusal

LAYERS = 3
EXACT = up.Recipe(expert_noise=0.0)


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("dense"), layers=LAYERS, family="llama")


@pytest.fixture(scope="module")
def upcycled(dense_dir, tmp_path_factory) -> Path:
    return up.ensure_upcycled_model(tmp_path_factory.mktemp("models") / "moe", source=dense_dir)


def _logits(model_dir: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    ids = torch.randint(0, 512, (3, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()(ids).logits


def test_without_perturbation_it_computes_the_dense_model(dense_dir, tmp_path):
    exact = up.upcycle(dense_dir, tmp_path / "exact", EXACT)
    dense, moe = _logits(dense_dir), _logits(exact)
    # Every expert is the dense MLP and Mixtral renormalises its top-2 gates, so a layer computes g1·f + g2·f with
    # g1 + g2 = 1 up to float32 rounding, in another summation order (grouped GEMM): a few ulps (1.2e-7) of each
    # layer's output. Measured 6e-7 on logits of magnitude ~2; 2e-5 leaves 30x, and the perturbed model is 1e3x off.
    torch.testing.assert_close(moe, dense, rtol=0, atol=2e-5)
    weights, source = load_file(exact / "model.safetensors"), load_file(dense_dir / "model.safetensors")
    for e in range(EXACT.experts):
        for mixtral, llama in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
            assert torch.equal(weights[f"model.layers.1.block_sparse_moe.experts.{e}.{mixtral}.weight"],
                               source[f"model.layers.1.mlp.{llama}.weight"])


def test_perturbed_experts_are_distinct_functions(dense_dir, upcycled):
    recipe = up.Recipe()
    assert (_logits(upcycled) - _logits(dense_dir)).abs().max() > 1e-2
    weights, source = load_file(upcycled / "model.safetensors"), load_file(dense_dir / "model.safetensors")
    for layer in range(LAYERS):
        dense_up = source[f"model.layers.{layer}.mlp.up_proj.weight"]
        moe = f"model.layers.{layer}.block_sparse_moe"
        experts = [weights[f"{moe}.experts.{e}.w3.weight"] for e in range(recipe.experts)]
        for e, w in enumerate(experts):
            relative = w / dense_up - 1  # (1 + noise·N(0,1)) - 1: its std is the recipe's noise
            assert relative.std().item() == pytest.approx(recipe.expert_noise, rel=0.05)
            assert all(not torch.equal(w, other) for other in experts[e + 1:])
        router = weights[f"{moe}.gate.weight"]
        assert router.shape == (recipe.experts, 128)
        assert router.std().item() == pytest.approx(recipe.router_std, rel=0.1)
    # the draws are seeded: the same recipe drawn again gives the saved experts, in Mixtral's fused layout
    again = up.upcycled_state_dict(source, LAYERS, recipe)
    for e in range(recipe.experts):
        saved = [weights[f"model.layers.2.block_sparse_moe.experts.{e}.{w}.weight"] for w in ("w1", "w3", "w2")]
        assert torch.equal(again["model.layers.2.mlp.experts.gate_up_proj"][e], torch.cat(saved[:2]))
        assert torch.equal(again["model.layers.2.mlp.experts.down_proj"][e], saved[2])


def test_the_checkpoint_is_a_mixtral_that_replay_covers(upcycled, dense_dir):
    from transformers import AutoModelForCausalLM

    config = json.loads((upcycled / "config.json").read_text())
    assert config["model_type"] == "mixtral" and config["architectures"] == ["MixtralForCausalLM"]
    assert is_moe(config) and replay_refusal(config) is None and moe_layers(config) == list(range(LAYERS))
    assert config["tie_word_embeddings"] is True and "lm_head.weight" not in load_file(upcycled / "model.safetensors")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (upcycled / name).read_bytes() == (dense_dir / name).read_bytes()
    model = AutoModelForCausalLM.from_pretrained(upcycled, dtype=torch.float32)
    unique = {p.data_ptr(): p.numel() for p in model.parameters()}  # the tied head counted once
    counts = json.loads((upcycled / up.MARKER).read_text())["parameters"]
    assert counts["total"] == sum(unique.values())
    expert = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n) // 4  # one expert, all layers
    assert counts["active"] == counts["total"] - 2 * expert


def test_a_complete_model_is_returned_untouched_and_another_recipe_refused(upcycled, dense_dir, monkeypatch):
    before = (upcycled / "model.safetensors").stat().st_mtime_ns
    monkeypatch.setattr(up, "upcycle", lambda *a: pytest.fail("a complete model must not be rebuilt"))
    assert up.ensure_upcycled_model(upcycled, source=dense_dir) == upcycled
    assert (upcycled / "model.safetensors").stat().st_mtime_ns == before
    with pytest.raises(up.UpcycleError, match=r"was upcycled with .*'experts': 4.*not .*'experts': 8"):
        up.ensure_upcycled_model(upcycled, source=dense_dir, recipe=up.Recipe(experts=8))
    assert json.loads((upcycled / up.MARKER).read_text())["recipe"] == asdict(up.Recipe())


def test_an_interrupted_build_leaves_nothing_that_looks_complete(dense_dir, tmp_path, monkeypatch):
    stale = tmp_path / f"{up._TMP_PREFIX}999999999-stale"  # a killed build's: its pid is gone
    stale.mkdir()
    written = []

    def interrupted(out_dir: Path, *args) -> None:  # called once the weights and tokenizer are fully written
        written.extend(p.name for p in out_dir.iterdir())
        raise KeyboardInterrupt

    monkeypatch.setattr(up, "_write_marker", interrupted)
    with pytest.raises(KeyboardInterrupt):
        up.ensure_upcycled_model(tmp_path / "moe", source=dense_dir)
    assert "model.safetensors" in written and "config.json" in written
    assert list(tmp_path.iterdir()) == []

    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "config.json").write_text("{}")
    with pytest.raises(up.UpcycleError, match="not a complete upcycled model"):
        up.ensure_upcycled_model(partial, source=dense_dir)
    assert [p.name for p in partial.iterdir()] == ["config.json"]


def test_what_cannot_be_upcycled_is_refused(tmp_path, capsys):
    qwen = build_tiny_model(tmp_path / "qwen2")  # attention biases: no Mixtral equivalent
    with pytest.raises(SystemExit) as exit_info:
        up.main([str(tmp_path / "moe"), "--source", str(qwen)])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert "takes a Llama" in err and "'qwen2'" in err
    assert not (tmp_path / "moe").exists()
    from transformers import LlamaConfig

    with pytest.raises(up.UpcycleError, match="attention_bias=True"):
        up.upcycled_config(LlamaConfig(attention_bias=True), up.Recipe())
    with pytest.raises(up.UpcycleError, match="top_k 3 of 2 experts"):
        up.upcycled_config(LlamaConfig(), up.Recipe(experts=2, top_k=3))


def test_the_pipeline_takes_it_by_name(upcycled, tmp_path, monkeypatch):
    from openrlhf_tis.pipeline.train import resolve_model
    from openrlhf_tis.pipeline.train_params import TrainParams

    assert TrainParams.spec()["model"].problem("upcycled") is None
    monkeypatch.setattr(up, "upcycled_model_dir", lambda: upcycled)  # built: returned, nothing run
    with open(tmp_path / "train.log", "w") as log:
        assert resolve_model("upcycled", tmp_path / "cache", log) == upcycled
    assert (tmp_path / "train.log").read_text() == ""
