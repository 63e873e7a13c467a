#!/usr/bin/env bash
# The mismatch study: set up .venv if needed, then `python -m openrlhf_tis.pipeline.study`: the main job's recipe
# (demo task, embedded SmolLM2-135M-Instruct, CPU) under rollout precision {the trainer's dtype, int8} x correction
# {off, tis, token_mis} x seeds {1, 2}, each cell train.ipynb under papermill, then one comparison report
# (report.html) and the seed-averaged table (study_table.md) under $OPENRLHF_TIS_STUDY (default work/study).
# A re-run skips finished cells (so --seeds 1 2 3 after a two-seed study runs only seed 3). Extra arguments go to
# the study: --baselines (adds ppo_is and vanilla_is), --seeds 1 2 3, --steps N.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$ROOT/scripts/setup_env.sh"
exec "$ROOT/.venv/bin/python" -m openrlhf_tis.pipeline.study --out "${OPENRLHF_TIS_STUDY:-$ROOT/work/study}" "$@"
