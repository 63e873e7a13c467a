#!/usr/bin/env bash
# The staleness study (issue 43; docs/study.md "The staleness axis"), sized by its pilot
# (results/study/staleness-pilot-avx512): the main job's task and model, bf16 trainer, 24 steps, learning rate 6e-5,
# where weights synced after every 8th step give a stale k3 of 0.15 a token on average (the precision doses' range)
# and cost the kept policy nearly all of the reference's gain on the pilot's seed.
#
# Seed-major, so a sitting that stops part-way leaves whole seeds of every setting; for each seed:
#   the reference (weights synced every step, uncorrected),
#   each lag K in OPENRLHF_TIS_STALENESS_EVERY (default "4 8": lags 0..K-1) x {off, tis, token_mis}
#   (token_mis: the mask that did least harm at W5A8 in the precision study),
#   the harshest lag with INT8 rollouts x {off, tis} (precision and staleness together).
# Cells land under results/study/staleness-avx512 (resumable: a re-run skips finished cells;
# `touch results/study/staleness-avx512/STOP` ends the sitting after the cell in flight). Run it from a clone that
# is not being edited: a cell imports the working tree's code.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$ROOT/scripts/setup_env.sh"
OUT=${OPENRLHF_TIS_STALENESS:-$ROOT/results/study/staleness-avx512}
GRID=$(mktemp --suffix=.json)
trap 'rm -f "$GRID"' EXIT
"$ROOT/.venv/bin/python" - "$OUT" "$GRID" "${OPENRLHF_TIS_STALENESS_EVERY:-4 8}" \
    "${OPENRLHF_TIS_STALENESS_SEEDS:-1 2 3}" <<'PY'
import json
import sys
from pathlib import Path

from openrlhf_tis.study.dose_response import dose_params, study_grid

out, grid = Path(sys.argv[1]).resolve(), Path(sys.argv[2])
lags, seeds = [int(k) for k in sys.argv[3].split()], [int(s) for s in sys.argv[4].split()]
if not lags or min(lags) < 2:
    sys.exit(f"OPENRLHF_TIS_STALENESS_EVERY: lags must be 2 or more (1 is the reference), got {sys.argv[3]!r}")
LR = 6e-5
spec = study_grid(out, "default", cells={"none": ("off",)}, seeds=(1,), steps=24)  # absolute task paths
bf16 = {k: [v] for k, v in dose_params("none", spec["base"]["train_dtype"]).items()}
int8 = {k: [v] for k, v in dose_params("int8", spec["base"]["train_dtype"]).items()}


def table(precision: dict, every: int, corrections: list[str], seed: int) -> dict:
    return {**precision, "sync_every": [every], "lr": [LR], "correction": corrections, "seed": [seed]}


spec["grid"] = [t for seed in seeds for t in (
    table(bf16, 1, ["off"], seed),
    *(table(bf16, every, ["off", "tis", "token_mis"], seed) for every in lags),
    table(int8, max(lags), ["off", "tis"], seed))]
grid.write_text(json.dumps(spec, indent=1) + "\n")
PY
exec "$ROOT/.venv/bin/openrlhf-tis-sweep" "$GRID" "$OUT"
