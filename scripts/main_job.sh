#!/usr/bin/env bash
# The main job: set up .venv if needed, then `python -m openrlhf_tis.pipeline.main_job`: the embedded
# SmolLM2-135M-Instruct (built once from its PyPI wheel) learns the demo task (single-digit arithmetic,
# openrlhf_tis/demo/task.py) by GRPO on CPU through Ray + DeepSpeed + vLLM, with INT8 rollouts and token TIS,
# driven by notebooks/train.ipynb under papermill. The console shows a progress bar and one line per step; the
# executed notebook, its HTML report and the full log (train.log) land in the run directory under
# $OPENRLHF_TIS_WORK (default work/main_job). OPENRLHF_TIS_MAIN_MODEL=tiny uses a random 2-layer model (seconds
# per step; it never answers, so its rewards stay 0). Extra arguments: main_job options (--set NAME=VALUE) or
# training CLI flags, which win over the job's own.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$ROOT/scripts/setup_env.sh"
exec "$ROOT/.venv/bin/python" -m openrlhf_tis.pipeline.main_job \
  --out "${OPENRLHF_TIS_WORK:-$ROOT/work/main_job}" --model "${OPENRLHF_TIS_MAIN_MODEL:-default}" "$@"
