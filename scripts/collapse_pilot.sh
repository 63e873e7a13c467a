#!/usr/bin/env bash
# The collapse-regime pilot (docs/study.md "The collapse regime"): where stale, uncorrected runs may fall. The
# staleness study's recipe (main job's task and model, bf16 rollouts, 24 steps) at learning rate 1e-4 (the staleness
# pilot's one run there, K = 8 uncorrected, fell), K = 8, seeds 1..6: per seed the reference (synced every step),
# K = 8 uncorrected and K = 8 with TIS. The endpoint (a run fell: kept-policy gain < 0.1) and the code revision are
# fixed in the folder by the first sitting (openrlhf_tis/study/collapse.py). Extra arguments pass through (e.g.
# --lrs 1e-4 1.5e-4, --seeds 7 8, --dry_run). Cells land under results/study/collapse-pilot-<profile>
# (scripts/study_folder.sh; resumable: `touch <folder>/STOP` ends a sitting after the cell in flight). Run it from
# a clone that is not being edited.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$ROOT/scripts/setup_env.sh"
source "$ROOT/scripts/study_folder.sh"
OUT=${OPENRLHF_TIS_COLLAPSE:-$(study_folder collapse-pilot)}
exec "$ROOT/.venv/bin/python" -m openrlhf_tis.study.collapse --out "$OUT" "$@"
