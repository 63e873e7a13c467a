"""A tiny random-weight Qwen2 model (or Llama), a tiny Qwen3-MoE and a locally trained byte-level BPE tokenizer, no
hub access.

Used by the tests and the benchmarks' quick modes, on the demo task (demo/task.py) with its dense reward
(demo/dense_reward.py: a random model never answers right). The shapes obey
vLLM's CPU attention (head size 32) and the tokenizer carries a chat template, so the model goes
through exactly the code path of a real one.
"""

from __future__ import annotations

import random
from pathlib import Path

WORDS = (
    "the a quick brown fox jumps over lazy dog policy reward value model token sample rollout math answer "
    "question solve equation number plus minus times equals one two three four five six seven eight nine ten"
).split()
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _corpus(rng: random.Random, lines: int = 400) -> list[str]:
    text = []
    for _ in range(lines):
        text.append(" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 15))))
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        text.append(f"{a} + {b} = {a + b}")
    return text


def build_tokenizer(vocab_size: int = 500, seed: int = 0):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(_corpus(random.Random(seed)), trainer=trainer)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    hf_tok.model_max_length = 2048
    return hf_tok


def build_tiny_model(out_dir: str | Path, hidden: int = 128, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                     seed: int = 0, family: str = "qwen2") -> Path:
    """Write a tiny Qwen2 (fp32 safetensors) and its tokenizer to out_dir; return the path. `family` "llama": a
    Llama of the same shapes, SmolLM2's architecture (what demo/upcycle.py takes)."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_class, model_class = {"qwen2": (Qwen2Config, Qwen2ForCausalLM),
                                 "llama": (LlamaConfig, LlamaForCausalLM)}[family]

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(seed=seed)
    tok.save_pretrained(out)
    vocab = 512
    config = config_class(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=2048,
        tie_word_embeddings=True, bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, torch_dtype="float32",
    )
    config.architectures = [model_class.__name__]
    torch.manual_seed(seed)
    model_class(config).save_pretrained(out)
    GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id).save_pretrained(out)
    return out


def build_tiny_moe(out: str | Path, router_std: float = 0.5, architecture: str = "qwen3_moe") -> Path:
    """A tiny MoE with a tokenizer, head size 32 for vLLM's CPU attention, top-2. `qwen3_moe`: 3 layers, layer 1
    dense (`mlp_only_layers`, so its routing slot stays empty), 6 experts. `mixtral`: 2 layers of 4 experts, whose
    transformers 5 parameters are not its checkpoint's (rollout/weight_sync/checkpoint_layout.py). fp32 safetensors
    holding bf16-representable values, so a bf16 engine and an fp32 trainer start from the same weights. The routers
    are spread (std `router_std`) so that near-ties are rare, as in a trained model. The routing tests' model and the
    GPU check's (benchmarks/gpu_check.py, moe)."""
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    tok = build_tokenizer()
    tok.save_pretrained(out)
    shapes = dict(vocab_size=512, hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  num_experts_per_tok=2, max_position_embeddings=256, tie_word_embeddings=False,
                  bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    if architecture == "qwen3_moe":
        config, model_class = Qwen3MoeConfig(**shapes, intermediate_size=128, moe_intermediate_size=64,
                                             num_hidden_layers=3, num_experts=6, norm_topk_prob=True,
                                             mlp_only_layers=[1]), Qwen3MoeForCausalLM
    elif architecture == "mixtral":
        config, model_class = MixtralConfig(**shapes, intermediate_size=64, num_hidden_layers=2,
                                            num_local_experts=4), MixtralForCausalLM
    else:
        raise ValueError(f"architecture {architecture!r}: qwen3_moe or mixtral")
    config.architectures = [model_class.__name__]
    torch.manual_seed(0)
    model = model_class(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.normal_(0.0, router_std)
            param.copy_(param.to(torch.bfloat16).float())
    model.save_pretrained(out)
    return Path(out)


if __name__ == "__main__":  # `python -m openrlhf_tis.demo.tiny_model OUT_DIR`: how the pipeline builds it
    import sys

    print(build_tiny_model(sys.argv[1]))
