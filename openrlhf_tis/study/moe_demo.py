"""`python -m openrlhf_tis.study.moe_demo`: the MoE demo study (scripts/moe_demo_study.sh; docs/moe.md, the demo).

The main job's task and recipe (token TIS, its learning rate and batch, the CPU profile's trainer) on the upcycled
SmolLM2 (demo/upcycle.py: a 4-expert top-2 Mixtral with a fresh router), in four arms: routing replay off or r3 ×
bf16 or INT8 rollouts, seeds 1..3, seed-major so that a sitting stopped part-way leaves whole seeds of every arm.
Besides the sweep's comparison report it writes `moe_table.md`: per arm, the routing agreement between engine and
trainer (the trainer's own router's choice, logged with replay on too), the share of response tokens whose routing
differed in some layer, the k3 of those tokens and of the others, and the kept policy's held-out gain, each the mean
over seeds with a t interval. The sweep skips finished cells, so a study resumes where it stopped; `touch OUT/STOP`
ends a sitting after the cell in flight.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from openrlhf_tis.errors import UsageError
from openrlhf_tis.metric_names import MOE_AGREEMENT, MOE_K3_DIFFERED, MOE_K3_SAME, MOE_TOKENS_DIFFERED
from openrlhf_tis.model_files import read_model_config
from openrlhf_tis.moe.coverage import replay_refusal
from openrlhf_tis.params import ParameterError
from openrlhf_tis.pipeline.main_job import MODEL_HELP, check_model_option
from openrlhf_tis.pipeline.sweep import SweepResult, finish, recorded_cells, write_report
from openrlhf_tis.pipeline.train_params import TrainParams
from openrlhf_tis.runs.layout import atomic_write
from openrlhf_tis.runs.reader import load_metrics
from openrlhf_tis.study.dose_response import COSTS, dose_params, study_grid, write_grid
from openrlhf_tis.study.revision import run_sitting
from openrlhf_tis.viz.compare import run_facts
from openrlhf_tis.viz.gains import KEPT, run_gains
from openrlhf_tis.viz.stats import t_interval

REPLAY = ("off", "r3")
ROLLOUTS = ("bf16", "int8")
SEEDS = (1, 2, 3)
CORRECTION = "tis"  # the main job's: replay is the variable, the correction stays put
TABLE_FILE = "moe_table.md"
MOE_COLUMNS = {MOE_AGREEMENT: "routing agreement", MOE_TOKENS_DIFFERED: "tokens routed differently",
               MOE_K3_DIFFERED: "k3 (routing differed)", MOE_K3_SAME: "k3 (routing same)"}
GAIN = "kept gain"
# Not measured (the demo run did not get past Ray's start beside the project's study): a dense cell's measured parts
# (dose_response.COSTS) times 2, since every part that runs the model runs at most twice the dense compute per token
# (top-2 of expert copies; attention and head unchanged), and loading 2.8x the weights is a small part of a start.
DENSE_FACTOR = 2.0


def check_moe_model(model: str) -> None:
    """Refuse, naming --model, a model the study's r3 arms cannot replay: the dense named ones, or a directory whose
    config.json routing replay does not cover (moe/coverage.py), before any cell is written."""
    if model in ("tiny", "default"):
        raise ParameterError(f"--model {model}: a dense model; the study's arms replay an MoE's routing ('upcycled', "
                             "or the directory of an MoE that routing replay covers)")
    if model != "upcycled" and (refusal := replay_refusal(read_model_config("--model", model))):
        raise ParameterError(f"--model {model}: {refusal}")


def moe_grid(out: Path, model: str, seeds: list[int], steps: int | None) -> dict:
    """The sweep grid: the main job's parameters on `model`, one table per seed and rollout precision, replay off
    and r3 in each, seed-major."""
    spec = study_grid(out, model, cells={"none": (CORRECTION,)}, seeds=(seeds[0],), steps=steps)
    trainer = spec["base"]["train_dtype"]
    rollouts = {"bf16": {"rollout_precision": "bf16"}, "int8": dose_params("int8", trainer)}
    spec["grid"] = [{**{k: [v] for k, v in rollouts[rollout].items()}, "routing_replay": list(REPLAY),
                     "correction": [CORRECTION], "seed": [seed]} for seed in seeds for rollout in ROLLOUTS]
    return spec


def cell_count(grid: dict) -> int:
    return sum(len(table["routing_replay"]) * len(table["seed"]) for table in grid["grid"])


def estimate_seconds(grid: dict) -> float:
    """The study's expected compute time on this machine's profile, all cells run (DENSE_FACTOR's estimate)."""
    base = TrainParams(**grid["base"])
    return cell_count(grid) * DENSE_FACTOR * COSTS[base.train_dtype].seconds(base.steps)


def run_rows(result: SweepResult) -> pd.DataFrame:
    """One row per completed cell: its arm, seed, each moe/* metric's mean over the run's steps and the kept
    policy's held-out gain (NaN where the run was not evaluated)."""
    done = [r for r in result.results if r.status != "failed"]
    if not done:
        return pd.DataFrame()
    facts = run_facts([r.run_dir for r in done], labels=[r.cell.name for r in done])
    gains = run_gains(facts)
    kept = gains[gains["source"] == KEPT].set_index("run")["gain"]
    rows = []
    for r in done:
        params, metrics = TrainParams(**r.cell.params), load_metrics(r.run_dir)
        rows.append({"replay": params.routing_replay, "rollouts": params.rollout_precision, "seed": params.seed,
                     **{name: float(metrics[key].mean()) if key in metrics else np.nan
                        for key, name in MOE_COLUMNS.items()},
                     GAIN: float(kept.get(r.cell.name, np.nan))})
    return pd.DataFrame(rows)


def _with_interval(values: pd.Series) -> str:
    interval = t_interval(values.to_numpy())
    if interval.n == 0:
        return "–"
    if not interval.defined:
        return f"{interval.estimate:.3g}"
    return f"{interval.estimate:.3g} [{interval.low:.3g}, {interval.high:.3g}]"


def moe_table(rows: pd.DataFrame) -> str:
    """Per arm (replay × rollouts): the seeds and each column's mean over seeds [95% t interval], as markdown."""
    if rows.empty:
        return "(no cell completed)"
    columns = [*MOE_COLUMNS.values(), GAIN]
    lines = ["| replay | rollouts | seeds | " + " | ".join(columns) + " |", "|" + "---|" * (3 + len(columns))]
    for (replay, rollouts), arm in rows.groupby(["replay", "rollouts"], sort=False):
        lines.append(f"| {replay} | {rollouts} | {len(arm)} | "
                     + " | ".join(_with_interval(arm[c]) for c in columns) + " |")
    return "\n".join(lines)


def write_outputs(result: SweepResult, out: Path) -> None:
    """`moe_table.md` under `out` over every recorded cell, printed too; exit 1 while a recorded cell failed."""
    table = moe_table(run_rows(result))
    atomic_write(out / TABLE_FILE, (table + "\n").encode())
    print(table)
    finish(result)


def report_title(out: Path) -> str:
    return f"MoE demo study {out.name}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m openrlhf_tis.study.moe_demo", description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="the study's folder (task, grid, cells, report)")
    parser.add_argument("--model", default="upcycled", help=MODEL_HELP + "; an MoE that routing replay covers")
    parser.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS), help="training seeds (default 1 2 3)")
    parser.add_argument("--steps", type=int, default=None, help="steps per cell (default: the main job's on this "
                        "CPU's profile)")
    parser.add_argument("--dry_run", action="store_true", help="check every cell, print the grid's size and time, "
                        "run nothing")
    parser.add_argument("--report", action="store_true", help="rebuild the report and the table from the cells "
                        "under --out, run nothing (any machine)")
    args = parser.parse_args(argv)
    out = Path(args.out).expanduser().resolve()
    if args.report:
        result = recorded_cells(out)
        if not result.results:
            parser.error(f"--report: no finished cell under {out / 'cells'}")
        write_outputs(write_report(result, out, report_title(out)), out)
        return
    check_model_option(parser, args.model)
    if args.steps is not None and args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    if len(set(args.seeds)) < len(args.seeds):
        parser.error(f"--seeds: each seed once, got {args.seeds}")
    try:
        check_moe_model(args.model)
        out.mkdir(parents=True, exist_ok=True)
        grid = moe_grid(out, args.model, args.seeds, args.steps)
        grid_file = write_grid(out, grid)
    except (ParameterError, UsageError) as err:
        parser.error(str(err))
    steps = grid["base"]["steps"]
    print(f"[moe demo] {cell_count(grid)} cells of {steps} steps (replay {'/'.join(REPLAY)} x rollouts "
          f"{'/'.join(ROLLOUTS)}, seeds {args.seeds}); all cells ≈ {estimate_seconds(grid) / 3600:.1f} h, "
          f"estimated from the dense model's cells (finished cells skip); grid {grid_file}", file=sys.stderr)
    if args.dry_run:
        return
    write_outputs(run_sitting(parser, grid_file, out, report_title(out)), out)


if __name__ == "__main__":
    main()
