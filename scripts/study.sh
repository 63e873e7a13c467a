#!/usr/bin/env bash
# The off-policy dose-response study: set up .venv if needed, then `python -m openrlhf_tis.study.dose_response`: the main
# job's recipe (demo task, embedded SmolLM2-135M-Instruct, CPU) under a dose axis of rollout precision
# {none (trainer dtype), fp8 where it runs, int8, w6a8, w5a8, w4a8} x correction {off, tis, token_mis, seq_mis} x
# seeds {1, 2, 3}, each cell train.ipynb under papermill, then one seed-aggregated report (report.html), the headline
# table and figure (dose_response.md, .png), the seed-averaged table (study_table.md) and the cost per sitting and
# cell (study_cost.md) under $OPENRLHF_TIS_STUDY (default work/study). A re-run skips finished cells, so the study runs in several sittings;
# `touch $OPENRLHF_TIS_STUDY/STOP` ends a sitting after the cell in flight.
# Extra arguments go to the study: --quick (coarse curve, 2 seeds, ~1 h on 2 AVX2 cores), --doses ..., --corrections
# ..., --seeds ..., --steps N, --baselines, --dry_run (print the grid and its time estimate), --report (rebuild the
# report and tables from the cells under the study folder, run nothing; docs/study.md).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$ROOT/scripts/setup_env.sh"
exec "$ROOT/.venv/bin/python" -m openrlhf_tis.study.dose_response --out "${OPENRLHF_TIS_STUDY:-$ROOT/work/study}" "$@"
