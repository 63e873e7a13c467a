"""A weight sync sends each parameter in its checkpoint's layout (rollout/weight_sync/checkpoint_layout.py): for every
model the fork builds, the converted parameters are exactly the tensors `save_pretrained` wrote, names and values."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from openrlhf_tis.demo.tiny_model import build_tiny_model, build_tiny_moe
from openrlhf_tis.rollout.weight_sync.checkpoint_layout import check_convertible, checkpoint_tensors

BUILDS = {"dense": build_tiny_model, "qwen3_moe": build_tiny_moe,
          "mixtral": lambda out: build_tiny_moe(out, architecture="mixtral")}


@pytest.mark.parametrize("kind", sorted(BUILDS))
def test_the_sent_tensors_are_the_checkpoints(kind, tmp_path):
    model_dir = BUILDS[kind](tmp_path / kind)
    saved = load_file(next(model_dir.glob("*.safetensors")))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    check_convertible(model)
    sent = checkpoint_tensors(model, model.named_parameters())
    names = [name for name, _ in sent]
    assert len(names) == len(set(names)) and set(names) == set(saved)
    for name, tensor in sent:
        assert torch.equal(tensor, saved[name]), name
    if kind == "mixtral":  # what the trainer holds is not what the engine loaded: without the conversion, no sync
        assert not {name for name, _ in model.named_parameters()} <= set(saved)


def test_a_trained_experts_change_reaches_its_own_checkpoint_tensor(tmp_path):
    """Expert 2's up projection moved in the fused tensor arrives as expert 2's w3, the others untouched."""
    model_dir = build_tiny_moe(tmp_path / "mixtral", architecture="mixtral")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    saved = load_file(next(model_dir.glob("*.safetensors")))
    fused = model.model.layers[1].mlp.experts.gate_up_proj  # [experts, 2 x intermediate, hidden]: w1 rows, then w3
    intermediate = fused.shape[1] // 2
    with torch.no_grad():
        fused[2, intermediate:] += 1.0
    sent = dict(checkpoint_tensors(model, model.named_parameters()))
    changed = {name for name in saved if not torch.equal(sent[name], saved[name])}
    assert changed == {"model.layers.1.block_sparse_moe.experts.2.w3.weight"}
    assert torch.equal(sent["model.layers.1.block_sparse_moe.experts.2.w3.weight"],
                       saved["model.layers.1.block_sparse_moe.experts.2.w3.weight"] + 1.0)


def test_a_conversion_that_splits_a_checkpoint_tensor_is_refused(tmp_path):
    model = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "dense"), dtype=torch.float32)
    model._weight_conversions = [type("Chunk", (), {"target_patterns": [".q_proj", ".k_proj", ".v_proj"]})()]
    with pytest.raises(RuntimeError, match="one parameter at a time"):
        check_convertible(model)
