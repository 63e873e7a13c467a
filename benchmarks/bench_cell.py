"""One study cell before and after the untrained scores are shared: where its time goes, side by side.

Why: a cell of the collapse study costs ≈ 5.5–8.5 min on an idle 2-core machine and a study needs dozens. Before,
every cell scored the untrained policy in its run (`eval_start/*`); now a sweep keeps those scores in OUT/untrained
and every later cell with the same key (trainer/untrained_scores.py) reuses them. This runs the same cell (the
collapse study's K = 8 TIS cell of one seed, study/collapse.py) twice through the sweep's own cell runner
(pipeline/sweep.py `run_cell`: papermill, train.ipynb, the training CLI, the kept-policy scoring):

- before: an empty OUT/untrained, so the run evaluates the untrained policy (what every cell did before);
- after: OUT/untrained holding the scores the first run stored, so the run reuses them (every cell of a study but
  the first of each seed and setting of the engine).

Both share one kept-score cache (OPENRLHF_TIS_CACHE, a fresh folder under --work unless given), so the base model's
kept score, cached per seed before this change too, is computed by the first cell only; the table shows it on a row
of its own and the ratio without it. Then the phases of each (cell_phases.py) and after / before, and whether the
two cells' results are the same (the untrained scores, metrics.jsonl step by step, the kept policy's score):

    python benchmarks/bench_cell.py --model tiny --steps 4      # minutes
    python benchmarks/bench_cell.py --model default --steps 8   # the real model: ≈ 15–25 min on a loaded 2-core machine

Times are wall clock on whatever else the machine does: run it on an idle machine, or say what else ran (uptime).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cell_phases import PHASES, cell_phases  # noqa: E402

from openrlhf_tis.pipeline.sweep import UNTRAINED_DIR, load_grid, run_cell  # noqa: E402
from openrlhf_tis.runs.kept_score import read_kept_heldout  # noqa: E402
from openrlhf_tis.runs.reader import read_metrics_records  # noqa: E402
from openrlhf_tis.runs.repeat import first_divergence  # noqa: E402
from openrlhf_tis.study.collapse import collapse_grid  # noqa: E402

SIDES = ("before", "after")


def one_cell_grid(work: Path, model: str, seed: int, steps: int) -> Path:
    """The collapse study's K = 8 TIS cell of `seed` as a one-cell grid file under `work`."""
    spec = collapse_grid(work, model, [1e-4], 8, [seed], ("tis",), steps)
    table = {**spec["grid"][-1], "correction": ["tis"]}
    grid = work / "grid.json"
    grid.write_text(json.dumps({"base": spec["base"], "grid": [table]}, indent=1))
    return grid


def run_side(grid: Path, out: Path, stored: Path | None) -> Path:
    """Run the grid's one cell under `out`, OUT/untrained seeded from `stored` (None: empty); returns its cell dir."""
    [cell] = load_grid(grid)
    if stored is not None:
        shutil.copytree(stored, out / UNTRAINED_DIR)
    result = run_cell(cell, out)
    if result.status != "complete":
        raise SystemExit(f"{out.name}: the cell failed: {result.error}")
    return result.run_dir.parent


def reused(cell: Path) -> bool:
    return "untrained held-out scores:" in (cell / "run" / "train.log").read_text(errors="replace")


def same_results(before: Path, after: Path) -> str:
    """Whether the cell's results are the same both ways: the untrained scores, every step's metrics (timings
    aside; runs repeat under their seed) and the kept policy's score."""
    rows = [read_metrics_records(run) for run in (before, after)]
    untrained = [{k: v for k, v in r[0].items() if k.startswith("eval_start/") and k != "eval_start/seconds"}
                 for r in rows]
    found = first_divergence(*rows)
    kept = [read_kept_heldout(run) for run in (before, after)]
    same_kept = None not in kept and (kept[0].before.pass1, kept[0].after.pass1) == (kept[1].before.pass1,
                                                                                      kept[1].after.pass1)
    return (f"untrained scores reused = computed: {untrained[0] == untrained[1] and bool(untrained[0])}; "
            f"metrics.jsonl: {'the same at every step' if found.step is None else f'part at step {found.step}'}; "
            f"kept-policy pass@1 before / after the same: {same_kept}")


def table(phases: dict[str, dict[str, float]]) -> str:
    rows = ["| phase | " + " | ".join(f"{side} (s)" for side in SIDES) + " | after / before |",
            "|---|---|---|---|"]
    for phase in PHASES:
        before, after = phases["before"][phase], phases["after"][phase]
        ratio = f"{after / before:.2f}" if before > 0.5 else "–"
        rows.append(f"| {phase} | {before:.1f} | {after:.1f} | {ratio} |")
    base = {side: phases[side]["kept: base model"] for side in SIDES}
    net = {side: phases[side]["total"] - base[side] for side in SIDES}
    rows.append(f"| total less the base model's kept score (cached per seed before too) | {net['before']:.1f} | "
                f"{net['after']:.1f} | {net['after'] / net['before']:.2f} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny", help="'tiny', 'default' (SmolLM2-135M) or a model folder")
    parser.add_argument("--steps", type=int, default=4, help="training steps of the cell (the study's: 24)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--work", type=Path, default=None, help="where the two cells go (default: a temporary "
                        "folder, removed after)")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps: must be >= 1")
    work = args.work or Path(tempfile.mkdtemp(prefix="bench_cell-"))
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("OPENRLHF_TIS_CACHE", str(work / "cache"))
    try:
        grid = one_cell_grid(work, args.model, args.seed, args.steps)
        cells = {"before": run_side(grid, work / "before", None)}
        cells["after"] = run_side(grid, work / "after", work / "before" / UNTRAINED_DIR)
        if reused(cells["before"]) or not reused(cells["after"]):
            raise SystemExit("the cells did not do what the benchmark compares: before must evaluate, after reuse")
        phases = {side: cell_phases(cell) for side, cell in cells.items()}
        print(f"model {args.model}, {args.steps} steps, seed {args.seed}, load {os.getloadavg()}")
        print(table(phases))
        print(same_results(*(cells[side] / "run" for side in SIDES)))
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
