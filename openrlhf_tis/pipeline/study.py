"""`python -m openrlhf_tis.pipeline.study`: the rollout-training mismatch study, one command (scripts/study.sh).

The TIS talk's claims, tested on the demo task with the main job's recipe (pipeline/main_job.py): int8
rollouts x correction {off, tis, token_mis} x seeds, beside the reference: rollouts in the trainer's own
dtype, uncorrected (`--reference_corrections` adds corrections there; with no mismatch they should change
nothing), plus the talk's unstable baselines ppo_is and vanilla_is with `--baselines`. Every cell is
train.ipynb run by the sweep (pipeline/sweep.py: cells checked first, a re-run skips finished cells, a
failing cell is reported and the study goes on); the sweep's comparison report holds the curves, held-out
scores, k3 KL, max |Δp|, entropy and mismatch by token probability. The study then averages the cells over
seeds into one table (`study_table.md`, printed at the end): the table the README quotes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import pandas as pd

from openrlhf_tis.correction.config import PRESETS
from openrlhf_tis.pipeline.main_job import job_params
from openrlhf_tis.pipeline.params import ParameterError
from openrlhf_tis.pipeline.sweep import SweepResult, results_table, run_sweep
from openrlhf_tis.runs.reader import load_metrics
from openrlhf_tis.viz.compare import final_table

CORRECTIONS = ("off", "tis", "token_mis")
BASELINES = ("ppo_is", "vanilla_is")  # the TIS talk's: PPO-IS (μ inside the clip) and untruncated IS
SEEDS = (1, 2)
TABLE_COLUMNS = {  # final_table column -> the study table's heading
    "reward_first": "reward first", "reward_last": "reward last", "held_out_first": "held-out before",
    "held_out_last": "held-out after", "k3_kl_mean": "k3 KL(μ‖π_old)", "abs_dp_max": "max |Δp|",
    "masked_frac_mean": "masked", "entropy_last": "entropy (last)", "step_seconds": "s / step",
}


def study_grid(out: Path, model: str, *, baselines: bool, seeds: tuple[int, ...], steps: int | None,
               reference_corrections: tuple[str, ...] = ("off",)) -> dict:
    """The sweep grid: the main job's parameters as the base; int8 x corrections and reference x
    `reference_corrections`, each x seeds (two grid tables: the sweep runs their union)."""
    base = job_params(out / "task", model)
    reference = "bf16" if base["train_dtype"] == "bf16" else "fp32"  # the trainer's own dtype: no mismatch by design
    if steps is not None:
        base["steps"] = steps
    corrections = list(CORRECTIONS + (BASELINES if baselines else ()))
    return {"base": base, "grid": [
        {"rollout_precision": [reference], "correction": list(reference_corrections), "seed": list(seeds)},
        {"rollout_precision": ["int8"], "correction": corrections, "seed": list(seeds)},
    ]}


def cell_key(params: dict[str, Any]) -> tuple[str, str]:
    return params["rollout_precision"], params["correction"]


def seed_table(result: SweepResult) -> pd.DataFrame:
    """Mean over seeds of each (precision, correction): the final-table columns the README quotes."""
    rows = []
    for cell in result.results:
        if cell.status == "failed":
            continue
        row = final_table({cell.cell.name: load_metrics(cell.run_dir)}).iloc[0]
        precision, correction = cell_key(cell.cell.params)
        rows.append({"precision": precision, "correction": correction, **{k: row[k] for k in TABLE_COLUMNS}})
    if not rows:
        return pd.DataFrame()
    frame = pd.DataFrame(rows)
    grouped = frame.groupby(["precision", "correction"], sort=False)
    table = grouped[list(TABLE_COLUMNS)].mean().rename(columns=TABLE_COLUMNS)
    table.insert(0, "seeds", grouped.size())
    return table


def markdown(table: pd.DataFrame) -> str:
    """The table as GitHub markdown, numbers to three significant figures."""
    if table.empty:
        return "(no cell completed)"
    header = [h.replace("|", "\\|") for h in ("precision", "correction", *table.columns)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for (precision, correction), row in table.iterrows():
        cells = [f"{v:.3g}" if isinstance(v, float) else str(v) for v in row]
        lines.append("| " + " | ".join([precision, correction, *cells]) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="study", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="work/study", help="working directory (task, grid, cells, report)")
    parser.add_argument("--model", default="default", help="'default' (SmolLM2-135M-Instruct), 'tiny' or a directory")
    parser.add_argument("--baselines", action="store_true", help=f"add the corrections {', '.join(BASELINES)}")
    parser.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS), help="training seeds (default 1 2)")
    parser.add_argument("--steps", type=int, default=None, help="steps per cell (default: the main job's)")
    parser.add_argument("--reference_corrections", nargs="+", default=["off"], choices=list(PRESETS),
                        help="corrections run with the reference precision too (default: off)")
    args = parser.parse_args(argv)
    if args.steps is not None and args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    out = Path(args.out).expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    grid = study_grid(out, args.model, baselines=args.baselines, seeds=tuple(args.seeds), steps=args.steps,
                      reference_corrections=tuple(args.reference_corrections))
    grid_file = out / "study_grid.json"
    grid_file.write_text(json.dumps(grid, indent=1))
    cells = sum(len(g["rollout_precision"]) * len(g["correction"]) * len(g["seed"]) for g in grid["grid"])
    print(f"[study] {cells} cells of {grid['base']['steps']} steps, trainer {grid['base']['train_dtype']}; "
          f"grid {grid_file}", file=sys.stderr)
    try:
        result = run_sweep(grid_file, out, title=f"Mismatch study: {cells} cells")
    except ParameterError as err:
        print(f"study: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    print(results_table(result).to_string())
    table = markdown(seed_table(result))
    (out / "study_table.md").write_text(table + "\n")
    print(table)
    if result.html:
        print(f"report: {result.html}")
    if result.failures:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
