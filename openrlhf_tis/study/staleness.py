"""`python -m openrlhf_tis.study.staleness`: the staleness study (scripts/staleness_study.sh; docs/study.md).

The precision study's recipe (the main job's task and model, 24 steps, the CPU profile's trainer) with its dose
set by staleness instead of precision: weights synced after every K-th step only (`--vllm.sync_every K`), so the
samples of a step lag 0..K−1 versions behind π_old, a lag known from the step. Sized by its pilot
(results/study/staleness-pilot-avx512): at the main job's learning rate a lag moves the policy too little to matter,
so the study trains at LR, where K = 8 gives a stale k3 near 0.15 a token (the precision doses' range); its folder
therefore has its own reference (synced every step, uncorrected), the setting every other is paired with.

Seed-major, so a sitting that stops part-way leaves whole seeds of every setting; for each seed: the reference, each
K × CORRECTIONS (token_mis: the mask that did least harm at W5A8 in the precision study), and the largest K with INT8
rollouts × COMBINED (precision and staleness together). The sweep skips finished cells, so a study resumes where it
stopped; `touch OUT/STOP` ends a sitting after the cell in flight. `--corrections` and `--no_int8` narrow the grid to
the comparisons that decide the answer, so more seeds go there under the full grid's cell names; `--steps` sets
another horizon (the pilot's horizon check) in its own folder. A cadence that cannot be honoured (below 2: 1 is the
reference, already in; asked for twice) and a folder holding cells of another CPU profile or horizon are refused
before any cell runs, naming the flag.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from openrlhf_tis.params import ParameterError
from openrlhf_tis.pipeline.main_job import MODEL_HELP, check_model_option
from openrlhf_tis.study.dose_response import (
    cell_count,
    dose_params,
    estimate_seconds,
    rebuild_report,
    study_grid,
    write_grid,
    write_outputs,
)
from openrlhf_tis.study.revision import run_sitting

LR = 6e-5
EVERY = (4, 8)
SEEDS = (1, 2, 3)
STEPS = 24
CORRECTIONS = ("off", "tis", "token_mis")
OPT_IN = ("adaptive",)  # by name only: the default grid (the committed folders' cells) stays as it was
COMBINED = ("off", "tis")  # with INT8 rollouts at the largest cadence


def check_cadences(every: list[int]) -> None:
    """Refuse cadences a study cannot honour, naming --every: none, below 2 (1 is the reference, always run) or one
    asked for twice (its cells would be one setting under two names)."""
    if not every:
        raise ParameterError("--every: give at least one cadence K >= 2")
    if min(every) < 2:
        raise ParameterError(f"--every: cadences must be 2 or more (1, a sync after every step, is the reference the "
                             f"study always runs), got {every}")
    if len(set(every)) < len(every):
        raise ParameterError(f"--every: each cadence once, got {every}")


def check_corrections(corrections: list[str]) -> None:
    """Refuse a correction the study does not run (its cells would be a new setting, not more seeds of one) or one
    asked for twice, naming --corrections."""
    unknown = [c for c in corrections if c not in CORRECTIONS + OPT_IN]
    if unknown:
        raise ParameterError(f"--corrections: the study runs {' '.join(CORRECTIONS + OPT_IN)}, got "
                             f"{' '.join(unknown)}")
    if len(set(corrections)) < len(corrections):
        raise ParameterError(f"--corrections: each correction once, got {corrections}")


def staleness_grid(out: Path, model: str, every: list[int], seeds: list[int],
                   corrections: tuple[str, ...] = CORRECTIONS, combined: bool = True, steps: int = STEPS,
                   lr: float = LR) -> dict:
    """The sweep grid (module docstring): the main job's parameters at `steps` steps and `lr`, one table per seed and
    setting, seed-major. `corrections` (a subset of CORRECTIONS) and `combined` (the INT8 cells) narrow it, so
    extra seeds go to the comparisons that decide the answer under the very cell names the full grid gives."""
    spec = study_grid(out, model, cells={"none": ("off",)}, seeds=(1,), steps=steps)
    trainer = spec["base"]["train_dtype"]
    bf16, int8 = ({k: [v] for k, v in dose_params(dose, trainer).items()} for dose in ("none", "int8"))

    both = tuple(c for c in COMBINED if c in corrections) if combined else ()

    def table(precision: dict, cadence: int, corrections: tuple[str, ...], seed: int) -> dict:
        return {**precision, "sync_every": [cadence], "lr": [lr], "correction": list(corrections), "seed": [seed]}

    spec["grid"] = [t for seed in seeds for t in (
        table(bf16, 1, ("off",), seed),
        *(table(bf16, cadence, corrections, seed) for cadence in every),
        *([table(int8, max(every), both, seed)] if both else []))]
    return spec


def report_title(out: Path) -> str:
    return f"Staleness study {out.name}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m openrlhf_tis.study.staleness", description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="the study's folder (task, grid, cells, report)")
    parser.add_argument("--model", default="default", help=MODEL_HELP)
    parser.add_argument("--every", type=int, nargs="+", default=list(EVERY), metavar="K",
                        help=f"sync cadences K >= 2 (lags 0..K-1); default {' '.join(map(str, EVERY))}")
    parser.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS), help="training seeds (default 1 2 3)")
    parser.add_argument("--corrections", nargs="+", default=list(CORRECTIONS), metavar="C",
                        help=f"corrections at each cadence, a subset of {' '.join(CORRECTIONS + OPT_IN)} (the INT8 "
                        f"cells run those of {' '.join(COMBINED)} among them); default {' '.join(CORRECTIONS)}: narrow "
                        "it to add seeds to the comparisons that decide the answer")
    parser.add_argument("--no_int8", action="store_true", help="leave out the INT8 cells (precision and staleness "
                        "together)")
    parser.add_argument("--steps", type=int, default=STEPS, help=f"steps per cell (default {STEPS}, the study's "
                        "horizon; a longer one is the pilot's horizon check: give it its own --out)")
    parser.add_argument("--dry_run", action="store_true", help="check every cell, print the grid's size and time, "
                        "run nothing")
    parser.add_argument("--report", action="store_true", help="rebuild the report and tables from the cells under "
                        "--out, run nothing (any machine)")
    args = parser.parse_args(argv)
    out = Path(args.out).expanduser().resolve()
    if args.report:
        rebuild_report(parser, out, report_title(out))
        return
    check_model_option(parser, args.model)
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    if len(set(args.seeds)) < len(args.seeds):
        parser.error(f"--seeds: each seed once, got {args.seeds}")
    try:
        check_cadences(args.every)
        check_corrections(args.corrections)
        out.mkdir(parents=True, exist_ok=True)
        grid = staleness_grid(out, args.model, args.every, args.seeds, tuple(args.corrections), not args.no_int8,
                              args.steps)
        grid_file = write_grid(out, grid)
    except ParameterError as err:
        parser.error(str(err))
    print(f"[staleness] {cell_count(grid)} cells of {args.steps} steps at lr {LR:g}, cadences {args.every}, seeds "
          f"{args.seeds}; all cells ≈ {estimate_seconds(grid) / 60:.0f} min on this CPU's profile (finished cells "
          f"skip); grid {grid_file}", file=sys.stderr)
    if args.dry_run:
        return
    write_outputs(run_sitting(parser, grid_file, out, report_title(out)), out)


if __name__ == "__main__":
    main()
