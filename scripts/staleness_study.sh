#!/usr/bin/env bash
# The staleness study (docs/study.md "The staleness axis"), sized by its pilot
# (results/study/staleness-pilot-avx512): the main job's task and model, bf16 trainer, 24 steps, learning rate 6e-5,
# where weights synced after every 8th step give a stale k3 of 0.15 a token on average (the precision doses' range)
# and cost the kept policy nearly all of the reference's gain on the pilot's seed.
#
# Seed-major, so a sitting that stops part-way leaves whole seeds of every setting; for each seed:
#   the reference (weights synced every step, uncorrected),
#   each lag K in OPENRLHF_TIS_STALENESS_EVERY (default "4 8": lags 0..K-1) x {off, tis, token_mis}
#   (token_mis: the mask that did least harm at W5A8 in the precision study),
#   the harshest lag with INT8 rollouts x {off, tis} (precision and staleness together).
# openrlhf_tis/study/staleness.py builds the grid (cadences via OPENRLHF_TIS_STALENESS_EVERY, seeds via
# OPENRLHF_TIS_STALENESS_SEEDS; extra arguments, e.g. --dry_run, pass through) and refuses what it cannot honour.
# Cells land under results/study/staleness-<profile> (resumable: a re-run skips finished cells;
# `touch results/study/staleness-<profile>/STOP` ends the sitting after the cell in flight). Run it from a clone that
# is not being edited: a cell imports the working tree's code.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$ROOT/scripts/setup_env.sh"
source "$ROOT/scripts/study_folder.sh"
OUT=${OPENRLHF_TIS_STALENESS:-$(study_folder staleness)}
exec "$ROOT/.venv/bin/python" -m openrlhf_tis.study.staleness --out "$OUT" \
    --every ${OPENRLHF_TIS_STALENESS_EVERY:-4 8} --seeds ${OPENRLHF_TIS_STALENESS_SEEDS:-1 2 3} "$@"
