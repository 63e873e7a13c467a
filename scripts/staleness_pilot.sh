#!/usr/bin/env bash
# The staleness axis's pilot (docs/study.md "The staleness axis"): the precision study's recipe (the main
# job's task, SmolLM2-135M, bf16 trainer and rollouts, 24 steps, seed 1) with the weights synced after every 8th step
# only (--vllm.sync_every 8: lags 0..7, each measured by mismatch_by_lag/k3_lag_<k>), uncorrected and with TIS, at
# each learning rate in OPENRLHF_TIS_PILOT_LRS (default: the recipe's 2e-5). A learning rate other than the recipe's
# also gets its own reference (synced every step, uncorrected), since the rate moves the reference too.
# Cells land under results/study/staleness-pilot-<profile> (resumable: a re-run skips finished cells;
# `touch results/study/staleness-pilot-<profile>/STOP` ends the sitting after the cell in flight).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$ROOT/scripts/setup_env.sh"
source "$ROOT/scripts/study_folder.sh"
OUT=${OPENRLHF_TIS_PILOT:-$(study_folder staleness-pilot)}
GRID=$(mktemp --suffix=.json)
trap 'rm -f "$GRID"' EXIT
"$ROOT/.venv/bin/python" - "$OUT" "$GRID" "${OPENRLHF_TIS_PILOT_LRS:-2e-5}" <<'PY'
import json
import sys
from pathlib import Path

from openrlhf_tis.study.dose_response import study_grid

out, grid, rates = Path(sys.argv[1]).resolve(), Path(sys.argv[2]), [float(r) for r in sys.argv[3].split()]
spec = study_grid(out, "default", cells={"none": ("off", "tis")}, seeds=(1,), steps=24)  # absolute task paths
(table,) = spec["grid"]
recipe = spec["base"]["lr"]


def cell(rate: float, every: int, correction: str) -> dict:
    return {**table, "sync_every": [every], "correction": [correction], **({"lr": [rate]} if rate != recipe else {})}


# The dose at every rate first (uncorrected, stale), then each new rate's reference, then the corrections.
spec["grid"] = ([cell(rate, 8, "off") for rate in rates] + [cell(rate, 1, "off") for rate in rates if rate != recipe]
                + [cell(rate, 8, "tis") for rate in rates])
grid.write_text(json.dumps(spec, indent=1) + "\n")
PY
exec "$ROOT/.venv/bin/openrlhf-tis-sweep" "$GRID" "$OUT"
