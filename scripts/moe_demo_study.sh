#!/usr/bin/env bash
# The MoE demo study (docs/moe.md "The upcycled demo"): the main job's task and recipe (token TIS) on SmolLM2-135M
# upcycled into a 4-expert top-2 Mixtral (openrlhf_tis/demo/upcycle.py, built once on first use), with routing replay
# off and r3 x bf16 and INT8 rollouts, seeds 1..3. Writes moe_table.md (routing agreement, k3 by cause, kept gain, with
# t intervals over seeds) beside the sweep's report. Extra arguments pass through (e.g. --seeds 4 5, --steps 6,
# --dry_run). Cells land under results/study/moe-demo-<profile> (avx512 or fp32: scripts/study_folder.sh; resumable:
# `touch <folder>/STOP` ends a sitting after the cell in flight). Run it from a clone that is not being edited.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$ROOT/scripts/setup_env.sh"
source "$ROOT/scripts/study_folder.sh"
OUT=${OPENRLHF_TIS_MOE_DEMO:-$(study_folder moe-demo)}
exec "$ROOT/.venv/bin/python" -m openrlhf_tis.study.moe_demo --out "$OUT" "$@"
