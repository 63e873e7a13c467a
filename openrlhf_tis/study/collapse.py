"""`python -m openrlhf_tis.study.collapse`: the collapse-regime study (scripts/collapse_pilot.sh; docs/study.md).

Where must correction pay? Not at the staleness study's learning rate, where no run fails, so no endpoint about
failure has anything to count. This study trains where stale, uncorrected runs can fall: the staleness study's
recipe (the main job's task and model, bf16 rollouts, weights synced every K-th step) at a larger learning rate.
Per seed and learning rate three arms: the reference (synced every step, uncorrected: what the learning rate does
by itself), K uncorrected, and K with each correction asked for (TIS by default).

**The endpoint is fixed before any cell runs.** A run *fell* when its kept policy's held-out gain (pass@1 after −
before, heldout_kept.json) is below `--fall_below` (default 0.1: every reference run at the staleness study's
learning rate gained 0.2 or more, the untrained policy scores ≈ 0.3, so a gain under 0.1 is a run that did not learn
the task). It is written to `endpoint.json` with the primary test (Fisher's exact test of K uncorrected against each
correction, two-sided, α = 0.05) and the runs per arm the study plans; a later sitting that asks for another
endpoint, or a folder holding cells but no endpoint, is refused naming the flag. The code revision is recorded in
`revision.json` the same way: cells of another revision are refused (start a new `--out`).

The report (`collapse.md`, beside the sweep's report) gives per arm the runs, the falls with an exact 95% interval,
the mean gain with its t interval; the primary comparisons with Fisher's p; and the runs per arm that 80% power
needs at the rates seen (an arm with fewer runs than the plan asks for is flagged). Then the same comparisons paired
by seed, which repeatable runs make worth reading (a seed's arms share data order and first samples): the gain
difference with its t interval, the falls as pairs with McNemar's exact p, and the seeds a paired design needs;
`--primary paired` makes that t-test the primary one of a new study. Each table's p-values also come Holm-adjusted
over its comparisons: a study of several corrections against one uncorrected arm is one family, so a difference
read as shown must survive that.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from openrlhf_tis.correction.config import PRESETS
from openrlhf_tis.params import ParameterError
from openrlhf_tis.pipeline.main_job import MODEL_HELP, check_model_option
from openrlhf_tis.pipeline.sweep import CellResult, SweepResult, recorded_cells, run_command
from openrlhf_tis.pipeline.train_params import TrainParams
from openrlhf_tis.runs.config import read_run_config
from openrlhf_tis.runs.kept_score import read_kept_heldout
from openrlhf_tis.runs.layout import atomic_write
from openrlhf_tis.study.dose_response import cell_count, estimate_seconds, rebuild_report, write_grid, write_outputs
from openrlhf_tis.study.revision import check_revision, code_revision
from openrlhf_tis.study.staleness import staleness_grid
from openrlhf_tis.viz.stats import (
    fisher_p,
    holm,
    pairs_for_power,
    rate_interval,
    runs_for_power,
    t_interval,
    t_test_p,
)

LRS = (1e-4,)
EVERY = 8
SEEDS = tuple(range(1, 7))
STEPS = 24
CORRECTIONS = ("tis",)  # beside K uncorrected, always run
FALL_BELOW = 0.1
PLANNED_RUNS = 6  # the pilot's runs per arm; the powered study sets its own from the pilot's rates
ENDPOINT_FILE = "endpoint.json"
REPORT_FILE = "collapse.md"
PRIMARY_TESTS = {
    "fisher": "Fisher's exact test, two-sided, alpha 0.05: K uncorrected against each correction",
    "paired": "paired t-test of the kept gain (correction - K uncorrected) over the seeds both ran, two-sided, "
              "alpha 0.05",
}
PAIRED_EFFECT = 0.1  # the gain difference a paired design is sized to detect: a fall's size (the endpoint's margin)


@dataclass(frozen=True)
class Endpoint:
    """The primary endpoint and test, fixed in writing before the study's first cell."""

    fall_below: float
    runs_per_arm: int
    metric: str = "kept policy's held-out gain (pass@1 after - before, heldout_kept.json)"
    test: str = PRIMARY_TESTS["fisher"]
    primary: str = "fisher"  # a study folder written before this field existed fixed Fisher's test

    @classmethod
    def of(cls, fall_below: float, runs_per_arm: int, primary: str) -> Endpoint:
        return cls(fall_below, runs_per_arm, test=PRIMARY_TESTS[primary], primary=primary)


def check_endpoint(out: Path, endpoint: Endpoint, cells: int) -> None:
    """Write the endpoint on a new study; refuse, naming the flag, one that differs from what is written or a folder
    whose cells ran before any endpoint was fixed."""
    path = out / ENDPOINT_FILE
    if not path.is_file():
        if cells:
            raise ParameterError(f"--out {out}: {cells} cells ran before an endpoint was fixed ({path} is missing): "
                                 "an endpoint given after cells exist is not one; start a new --out")
        atomic_write(path, (json.dumps(asdict(endpoint), indent=1) + "\n").encode())
        return
    fixed = json.loads(path.read_text())
    fixed.setdefault("primary", "fisher")
    for field, flag in (("fall_below", "--fall_below"), ("runs_per_arm", "--runs_per_arm"), ("primary", "--primary")):
        if fixed.get(field) != getattr(endpoint, field):
            raise ParameterError(f"{flag} {getattr(endpoint, field)}: the study under {out} fixed {field} = "
                                 f"{fixed.get(field)} before its cells ran ({path}); keep it, or start a new --out")


def collapse_grid(out: Path, model: str, lrs: list[float], every: int, seeds: list[int],
                  corrections: tuple[str, ...], steps: int) -> dict:
    """Seed-major, then learning rate: the reference, K uncorrected and K with each correction, per (seed, lr)."""
    arms = ("off", *corrections)
    specs = [staleness_grid(out, model, [every], [seed], arms, combined=False, steps=steps, lr=lr)
             for seed in seeds for lr in lrs]
    return {"base": specs[0]["base"], "grid": [table for spec in specs for table in spec["grid"]]}


Arm = tuple[float, int, str]  # (lr, K, correction)


def finished_gains(result: SweepResult) -> Iterator[tuple[CellResult, TrainParams, float]]:
    """Each finished run's cell, parameters and kept-policy gain (pass@1 after − before); runs without a kept score
    left out."""
    for cell in result.results:
        if cell.status == "failed":
            continue
        kept = read_kept_heldout(cell.run_dir)
        if kept is not None:
            yield cell, TrainParams(**cell.cell.params), kept.after.pass1 - kept.before.pass1


def arm_outcomes(result: SweepResult) -> dict[Arm, dict[int, float]]:
    """(lr, K, correction) -> seed -> the kept-policy gain of each finished run (runs without a kept score left
    out)."""
    arms: dict[Arm, dict[int, float]] = {}
    for _, params, gain in finished_gains(result):
        arms.setdefault((params.lr, params.sync_every, params.correction), {})[params.seed] = gain
    return arms


def _order(arm: Arm) -> tuple:
    return arm[0], arm[1] != 1, arm[2] != "off", arm[2]


def _name(arm: Arm) -> str:
    lr, every, correction = arm
    return f"lr {lr:g}, " + ("reference (K = 1)" if every == 1 else f"K = {every}, {correction}")


def collapse_markdown(by_seed: dict[Arm, dict[int, float]], endpoint: Endpoint) -> str:
    """The arms' fall rates and gains, the primary comparisons, the runs 80% power needs (module docstring), and
    every run's gain by seed (runs of one seed share their data order and, on the untrained policy, their first
    samples: the pairs a paired comparison reads)."""
    if not by_seed:
        return "(no run finished with a kept-policy score)"
    arms = {arm: list(gains.values()) for arm, gains in by_seed.items()}
    lines = [f"Endpoint (fixed before the first cell): a run fell when its {endpoint.metric} < {endpoint.fall_below}."
             f" Primary test: {endpoint.test}. Planned runs per arm: {endpoint.runs_per_arm}.", "",
             "| arm | runs | fell | fall rate [95% exact] | mean gain [95% t] |", "|---|---|---|---|---|"]
    for arm in sorted(arms, key=_order):
        gains = np.asarray(arms[arm])
        falls = int((gains < endpoint.fall_below).sum())
        rate, gain = rate_interval(falls, len(gains)), t_interval(gains)
        short = " (fewer than planned)" if len(gains) < endpoint.runs_per_arm else ""
        spread = f"[{gain.low:+.3f}, {gain.high:+.3f}]" if gain.defined else "(one run: no interval)"
        lines.append(f"| {_name(arm)} | {len(gains)}{short} | {falls} | {rate.estimate:.2f} "
                     f"[{rate.low:.2f}, {rate.high:.2f}] | {gain.estimate:+.3f} {spread} |")
    lines += ["", "| comparison | falls | Fisher p | Holm p | runs per arm for 80% power at these rates |",
              "|---|---|---|---|---|"]
    rows, p_values = [], []
    for (lr, every, correction), gains in sorted(arms.items()):
        if correction == "off":
            continue
        base = arms.get((lr, every, "off"))
        if base is None:
            continue
        a, b = (int((np.asarray(g) < endpoint.fall_below).sum()) for g in (base, gains))
        needed = runs_for_power(a / len(base), b / len(gains))
        p_values.append(fisher_p(a, len(base), b, len(gains)))
        rows.append((f"| {_name((lr, every, 'off'))} vs {correction} | {a}/{len(base)} vs {b}/{len(gains)} | "
                     f"{p_values[-1]:.3f} |", f" {needed if needed else 'not within 200'} |"))
    lines += _with_holm(rows, p_values)
    lines += ["", *paired_lines(by_seed, endpoint)]
    columns = sorted(by_seed, key=_order)
    lines += ["", "| seed | " + " | ".join(_name(arm) for arm in columns) + " |", "|---|" + "---|" * len(columns)]
    for seed in sorted({seed for gains in by_seed.values() for seed in gains}):
        cells = [f"{by_seed[arm][seed]:+.3f}" if seed in by_seed[arm] else "" for arm in columns]
        lines.append(f"| {seed} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _with_holm(rows: list[tuple[str, str]], p_values: list[float]) -> list[str]:
    """Each row's two halves joined by its Holm-adjusted p: the family is every comparison of the table (each
    correction against K uncorrected), so a difference read as shown survives testing several corrections."""
    return [f"{head} {adjusted:.3f} |{tail}" for (head, tail), adjusted in zip(rows, holm(p_values), strict=True)]


def paired_lines(by_seed: dict[Arm, dict[int, float]], endpoint: Endpoint) -> list[str]:
    """Each correction against K uncorrected over the seeds both ran: the gain difference with its t interval and
    p, the falls as pairs (both, uncorrected only, corrected only, neither) with the exact McNemar p of the discordant
    ones, and the seeds a paired design needs (80% power for a PAIRED_EFFECT difference at the spread seen)."""
    from scipy.stats import binomtest

    lines = ["| paired over seeds | seeds | gain difference [95% t] | p | Holm p | SD of differences | falls: both / "
             f"off only / correction only / neither | McNemar p | seeds for 80% power at ±{PAIRED_EFFECT:g} |",
             "|---|---|---|---|---|---|---|---|---|"]
    rows, p_values = [], []
    for (lr, every, correction), gains in sorted(by_seed.items()):
        base = by_seed.get((lr, every, "off"))
        if correction == "off" or base is None:
            continue
        seeds = sorted(set(base) & set(gains))
        if not seeds:
            continue
        diff = np.array([gains[s] - base[s] for s in seeds])
        fell_off = np.array([base[s] < endpoint.fall_below for s in seeds])
        fell_cor = np.array([gains[s] < endpoint.fall_below for s in seeds])
        off_only, cor_only = int((fell_off & ~fell_cor).sum()), int((fell_cor & ~fell_off).sum())
        discordant = off_only + cor_only
        mcnemar = float(binomtest(off_only, discordant).pvalue) if discordant else 1.0
        gap, sd = t_interval(diff), float(diff.std(ddof=1)) if len(diff) > 1 else float("nan")
        spread = f"[{gap.low:+.3f}, {gap.high:+.3f}]" if gap.defined else "(one seed: no interval)"
        needed = pairs_for_power(sd, PAIRED_EFFECT)
        p_values.append(t_test_p(diff))
        rows.append((f"| {_name((lr, every, 'off'))} vs {correction} | {len(seeds)} | {gap.estimate:+.3f} {spread} | "
                     f"{p_values[-1]:.3f} |", f" {sd:.3f} | {int((fell_off & fell_cor).sum())} / {off_only} / "
                     f"{cor_only} / {int((~fell_off & ~fell_cor).sum())} | {mcnemar:.3f} | "
                     f"{needed if needed else 'not within 200'} |"))
    return lines + _with_holm(rows, p_values)


def run_machines(run_dir: Path) -> set[str]:
    """The machines a run trained on (its start and every resume; runs/config.py provenance) as short labels such as
    'AVX512+amx_bf16 x 2'; empty for a run recorded before the machine was."""
    record = read_run_config(run_dir) or {}
    return {f"{m['capability']}{''.join('+' + k for k in m['kernels'])} x {m['cpus']}"
            for m in (record.get("machine"), *(r.get("machine") for r in record.get("resumes", []))) if m}


def machine_lines(runs: list[tuple[int, Path]]) -> list[str]:
    """Which machines the (seed, run folder) pairs trained on, and the seeds whose runs did not share one: a seed's
    runs repeat bit for bit, so pair, only on one machine (another CPU's kernels round otherwise)."""
    seeds: dict[str, set[int]] = {}
    by_seed: dict[int, set[str]] = {}
    unrecorded: set[int] = set()
    for seed, run_dir in runs:
        labels = run_machines(run_dir)
        if not labels:
            unrecorded.add(seed)
        for label in labels:
            seeds.setdefault(label, set()).add(seed)
        by_seed.setdefault(seed, set()).update(labels)
    lines = [f"Machine {label}: {_seeds(found)}." for label, found in sorted(seeds.items())]
    if unrecorded:
        lines.append(f"Runs recorded before machines were (revisions before the record): {_seeds(unrecorded)}.")
    split = {seed: labels for seed, labels in sorted(by_seed.items()) if len(labels) > 1}
    lines += [f"**Seed {seed}'s runs trained on different machines ({', '.join(sorted(labels))}): its pairs mix "
              "two CPUs' roundings.**" for seed, labels in split.items()]
    return lines


def _seeds(seeds: set[int]) -> str:
    return ("seed " if len(seeds) == 1 else "seeds ") + ", ".join(str(seed) for seed in sorted(seeds))


def write_collapse_report(out: Path) -> str:
    """collapse.md from every cell recorded under `out`, by the endpoint written there, with the machines its runs
    trained on; returned too."""
    endpoint = Endpoint(**json.loads((out / ENDPOINT_FILE).read_text()))
    result = recorded_cells(out)
    runs = [(TrainParams(**cell.cell.params).seed, cell.run_dir) for cell in result.results if cell.status != "failed"]
    text = collapse_markdown(arm_outcomes(result), endpoint) + "\n\n" + "\n".join(machine_lines(runs))
    atomic_write(out / REPORT_FILE, (text + "\n").encode())
    return text


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m openrlhf_tis.study.collapse", description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="the study's folder (task, grid, cells, endpoint, report)")
    parser.add_argument("--model", default="default", help=MODEL_HELP)
    parser.add_argument("--lrs", type=float, nargs="+", default=list(LRS), help="learning rates (default 1e-4)")
    parser.add_argument("--every", type=int, default=EVERY, help=f"the sync cadence K >= 2 (default {EVERY})")
    parser.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS), help="training seeds (default 1..6)")
    parser.add_argument("--corrections", nargs="+", default=list(CORRECTIONS), choices=[p for p in PRESETS
                        if p != "off"], help="corrections beside K uncorrected (default tis)")
    parser.add_argument("--steps", type=int, default=STEPS, help=f"steps per cell (default {STEPS})")
    parser.add_argument("--fall_below", type=float, default=FALL_BELOW,
                        help=f"the endpoint: a run fell when its kept gain is below this (default {FALL_BELOW}); "
                        "fixed in endpoint.json by the first sitting")
    parser.add_argument("--runs_per_arm", type=int, default=PLANNED_RUNS,
                        help=f"runs per arm the study plans (default {PLANNED_RUNS}); fixed like the endpoint")
    parser.add_argument("--primary", choices=sorted(PRIMARY_TESTS), default="fisher",
                        help="the primary test (default fisher: fall rates, unpaired; paired: the seeds' gain "
                        "differences, which a study of repeatable runs can afford); fixed like the endpoint")
    parser.add_argument("--dry_run", action="store_true", help="check every cell, print the grid, run nothing")
    parser.add_argument("--report", action="store_true", help="rebuild the reports from the cells, run nothing")
    args = parser.parse_args(argv)
    out = Path(args.out).expanduser().resolve()
    if args.report:
        rebuild_report(parser, out, report_title(out))
        print(write_collapse_report(out))
        return
    check_model_option(parser, args.model)
    if args.every < 2:
        parser.error(f"--every must be 2 or more (1 is the reference, always run), got {args.every}")
    if args.steps < 1 or args.runs_per_arm < 2 or not 0 < args.fall_below < 1:
        parser.error("--steps must be >= 1, --runs_per_arm >= 2 and --fall_below in (0, 1)")
    if len(set(args.seeds)) < len(args.seeds) or len(set(args.lrs)) < len(args.lrs) or min(args.lrs) <= 0:
        parser.error("--seeds and --lrs: each once, learning rates > 0")
    try:
        out.mkdir(parents=True, exist_ok=True)
        grid = collapse_grid(out, args.model, args.lrs, args.every, args.seeds, tuple(args.corrections), args.steps)
        grid_file = write_grid(out, grid)
        if not args.dry_run:
            cells = len(recorded_cells(out).results)
            check_endpoint(out, Endpoint.of(args.fall_below, args.runs_per_arm, args.primary), cells)
            check_revision(out, code_revision(), cells=cells)
    except ParameterError as err:
        parser.error(str(err))
    print(f"[collapse] {cell_count(grid)} cells of {args.steps} steps at lr {args.lrs}, K = {args.every}, seeds "
          f"{args.seeds}; all cells ≈ {estimate_seconds(grid) / 60:.0f} min (finished cells skip); grid {grid_file}",
          file=sys.stderr)
    if args.dry_run:
        return
    result = run_command(parser.prog, grid_file, out, report_title(out), whole_folder=True)
    print(write_collapse_report(out))
    write_outputs(result, out)


def report_title(out: Path) -> str:
    return f"Collapse-regime study {out.name}"


if __name__ == "__main__":
    main()
