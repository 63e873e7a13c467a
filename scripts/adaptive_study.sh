#!/usr/bin/env bash
# Adaptive truncation against the fixed corrections where fixed ones cost (issue 51; docs/study.md "Adaptive against
# the fixed corrections"): the precision study's W5A8 rollouts (main job's learning rate) and the staleness study's
# K = 4 (its lr 6e-5), each with off, TIS and adaptive, seeds 1..6 — two folders, one after the other, each fixed to
# one code revision by its first sitting. Resumable (finished cells skip; `touch <folder>/STOP` ends a sitting after
# the cell in flight). Extra arguments go to both (e.g. --dry_run, --report). Run it from a clone nobody edits.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$ROOT/scripts/setup_env.sh"
PY="$ROOT/.venv/bin/python"
source "$ROOT/scripts/study_folder.sh"
SEEDS=(${OPENRLHF_TIS_ADAPTIVE_SEEDS:-1 2 3 4 5 6})
"$PY" -m openrlhf_tis.study.dose_response --out "${OPENRLHF_TIS_ADAPTIVE_W5A8:-$(study_folder adaptive-w5a8)}" \
    --doses w5a8 --corrections off tis adaptive --seeds "${SEEDS[@]}" "$@"
exec "$PY" -m openrlhf_tis.study.staleness --out "${OPENRLHF_TIS_ADAPTIVE_K4:-$(study_folder adaptive-k4)}" \
    --every 4 --no_int8 --corrections off tis adaptive --seeds "${SEEDS[@]}" "$@"
