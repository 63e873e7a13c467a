"""Where a study cell's time goes, from what its cells wrote (status, config, metrics and held-out files).

Why: a cell runs ≈ 5.5 min on an idle machine and the studies need dozens; before cutting anything, measure which
part is training and which is repeated or idle. Per cell (and the median over the folder's cells):
- start-up: from the run's config (written before Ray starts) to the start of step 1, less the untrained policy's
  evaluation: Ray, DeepSpeed, the vLLM engine, the reward probe;
- untrained eval: the in-run held-out pass before step 1 (`eval_start/seconds`);
- steps: the sum of `timing/step_total`;
- final eval: the in-run held-out pass after the last step (`eval/seconds`);
- kept scoring: heldout_kept.json's scoring of the kept model (and of the base model where it was not cached);
- rest: the cell's wall time less all of the above: papermill's kernel, saving the model, Ray's stop, the kept
  scorer's engine start, the report and its HTML.

    python benchmarks/cell_phases.py results/study/collapse-pilot-avx512 [...]

Times are wall clock on whatever else the machine was doing: compare cells of one sitting only.
"""

from __future__ import annotations

import argparse
import calendar
import json
import time
from pathlib import Path

import numpy as np

from openrlhf_tis.metric_names import STEP_SECONDS
from openrlhf_tis.runs.reader import read_metrics_records

PHASES = ("start-up", "untrained eval", "steps", "final eval", "kept scoring", "rest", "total")


def _utc(stamp: str) -> float:
    return float(calendar.timegm(time.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ")))


def cell_phases(cell: Path) -> dict[str, float] | None:
    """The phases of one finished cell in seconds (None: not finished, or written before these files existed)."""
    status = json.loads((cell / "status.json").read_text()) if (cell / "status.json").is_file() else {}
    run = cell / "run"
    if status.get("status") != "complete" or not (run / "config.json").is_file():
        return None
    rows = read_metrics_records(run)
    kept = json.loads((run / "heldout_kept.json").read_text()) if (run / "heldout_kept.json").is_file() else {}
    if not rows:
        return None
    first = rows[0]
    untrained = float(first.get("eval_start/seconds", 0.0))
    step1_start = first["wall_time"] - float(first.get(STEP_SECONDS, 0.0)) - untrained
    parts = {
        "start-up": step1_start - _utc(json.loads((run / "config.json").read_text())["time"]),
        "untrained eval": untrained,
        "steps": float(sum(r.get(STEP_SECONDS, 0.0) for r in rows)),
        "final eval": float(rows[-1].get("eval/seconds", 0.0)),
        "kept scoring": sum(float(kept.get(side, {}).get("seconds", 0.0)) for side in ("before", "after")
                            if not kept.get(side, {}).get("cached", False)),
        "total": float(status["seconds"]),
    }
    parts["rest"] = parts["total"] - sum(v for k, v in parts.items() if k != "total")
    return parts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("folders", nargs="+", type=Path, help="study folders (their cells/ are read)")
    args = parser.parse_args(argv)
    table = {}
    for folder in args.folders:
        for cell in sorted((folder / "cells").glob("*/")):
            phases = cell_phases(cell)
            if phases is not None:
                table[f"{folder.name}: {cell.name.rsplit('-', 1)[0]}"] = phases
    if not table:
        parser.error("no finished cell with a run config under " + ", ".join(map(str, args.folders)))
    print("| cell | " + " | ".join(PHASES) + " |")
    print("|---|" + "---|" * len(PHASES))
    for name, phases in table.items():
        print(f"| {name} | " + " | ".join(f"{phases[p]:.0f}" for p in PHASES) + " |")
    median = {p: float(np.median([t[p] for t in table.values()])) for p in PHASES}
    share = " | ".join(f"{median[p]:.0f} ({median[p] / median['total']:.0%})" for p in PHASES)
    print(f"| median of {len(table)} cells (share of total) | {share} |")


if __name__ == "__main__":
    main()
