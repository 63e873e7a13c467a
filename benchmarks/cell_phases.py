"""Where a study cell's time goes, from what its cells wrote (status, config, metrics, held-out files and train.log).

Why: a cell runs ≈ 5.5 min on an idle machine and the studies need dozens; before cutting anything, measure which
part is training and which is repeated or idle. Per cell (and the median over the folder's cells):
- notebook + CLI: from the cell's start (status.json) to its run's config (written by the training CLI before Ray
  starts): papermill's kernel, building the command, the CLI's imports, flag checks and the reward probe;
- Ray + engine start: from there to the start of step 1, less the untrained policy's evaluation: Ray's head, the
  DeepSpeed and vLLM actors, the model loads, the sync check's baseline;
- untrained eval: the in-run held-out pass before step 1 (`eval_start/seconds`; a lookup where it was reused);
- steps: generation / make experience / train / weight sync: upstream's `timing/*` summed over the steps;
- between steps: the loop's span less the steps and the final evaluation (metrics lines, token dumps, the parts'
  hooks);
- final eval: the in-run held-out pass after the last step (`eval/seconds`);
- kept: base model / trained model: heldout_kept.json's scorings (each with its own engine start); the base model's
  only where it was not cached;
- rest: the cell's wall time less all of the above: saving the model, Ray's stop, the kept scorer's process start,
  papermill's end.

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

from openrlhf_tis.metric_names import STEP_SECONDS, TIMING_GENERATION, TIMING_MAKE_EXPERIENCE
from openrlhf_tis.runs.reader import read_metrics_records

STEP_PARTS = {"steps: generation": TIMING_GENERATION, "steps: make experience": TIMING_MAKE_EXPERIENCE,
              "steps: train": "timing/ppo_train", "steps: weight sync": "timing/broadcast"}
PHASES = ("notebook + CLI", "Ray + engine start", "untrained eval", *STEP_PARTS, "between steps", "final eval",
          "kept: base model", "kept: trained model", "rest", "total")


def _utc(stamp: str) -> float:
    return float(calendar.timegm(time.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ")))


def _kept_seconds(kept: dict, side: str) -> float:
    scored = kept.get(side, {})
    return 0.0 if scored.get("cached", False) else float(scored.get("seconds", 0.0))


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
    configured = _utc(json.loads((run / "config.json").read_text())["time"])
    started = _utc(status["started"]) if status.get("started") else configured
    parts = {
        "notebook + CLI": configured - started,
        "Ray + engine start": step1_start - configured,
        "untrained eval": untrained,
        **{phase: float(sum(r.get(key, 0.0) for r in rows)) for phase, key in STEP_PARTS.items()},
        "final eval": float(rows[-1].get("eval/seconds", 0.0)),
        "kept: base model": _kept_seconds(kept, "before"),
        "kept: trained model": _kept_seconds(kept, "after"),
        "total": float(status["seconds"]),
    }
    steps = float(sum(r.get(STEP_SECONDS, 0.0) for r in rows))
    parts["between steps"] = rows[-1]["wall_time"] - step1_start - untrained - steps - parts["final eval"]
    parts["rest"] = parts["total"] - sum(v for k, v in parts.items() if k != "total")
    return {phase: parts[phase] for phase in PHASES}


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
