"""`python -m openrlhf_tis.study.contrast`: one correction against others, paired by seed, in any study's folder.

A study's report compares each setting with its uncorrected baseline. Whether a new correction costs more than an
established one is a different question: adaptive against TIS where fixed corrections cost (docs/study.md, "Adaptive
against the fixed corrections"). This answers it from the cells recorded under a folder, nothing run, for every
setting that ran the correction and its comparator (cells alike but for `correction` and `seed`):

- the kept-policy gain difference (heldout_kept.json: pass@1 after − before) over the seeds both ran, with its 95%
  t interval, the paired t-test's p and its Holm adjustment over the table's rows (one family);
- the verdict of a non-inferiority reading with margin m: *costs more: shown* when the interval lies below 0;
  *costs no more: claimed* when its lower end lies above −m (a one-sided test at 2.5%, the usual non-inferiority
  test); *better: shown* when it lies above 0; otherwise *not shown either way*. Only the first comparator's row is
  the primary; the rest are secondary;
- the SD of the differences and the seeds a paired t-test needs to detect ±m with 80% power at that spread;
- the machines the runs trained on (a seed's runs repeat bit for bit, so pair, only on one CPU).

The table is printed and written to OUT/contrast_<correction>.md.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from openrlhf_tis.pipeline.sweep import SweepResult, recorded_cells
from openrlhf_tis.runs.layout import atomic_write
from openrlhf_tis.study.collapse import finished_gains, machine_lines
from openrlhf_tis.viz.stats import Interval, holm, pairs_for_power, t_interval, t_test_p

MARGIN = 0.1  # one held-out question in ten: what the adaptive study fixed before its first cell
SETTING_FREE = ("correction=", "seed=")  # the parts of a cell's name that vary within one setting

Gains = dict[str, dict[str, dict[int, float]]]  # setting -> correction -> seed -> kept gain


def setting_of(cell_name: str) -> str:
    """The cell's setting: its name without the correction and the seed ('rollout_precision=fp32,sync_every=4')."""
    return ",".join(part for part in cell_name.split(",") if not part.startswith(SETTING_FREE))


def kept_gains(result: SweepResult) -> tuple[Gains, dict[tuple[str, str, int], Path]]:
    """Each finished run's kept-policy gain by setting, correction and seed, and the run folders behind them (runs
    without a kept score are left out)."""
    gains: Gains = {}
    runs: dict[tuple[str, str, int], Path] = {}
    for cell, params, gain in finished_gains(result):
        setting = setting_of(cell.cell.name)
        gains.setdefault(setting, {}).setdefault(params.correction, {})[params.seed] = gain
        runs[(setting, params.correction, params.seed)] = cell.run_dir
    return gains, runs


def verdict(gap: Interval, margin: float) -> str:
    """The non-inferiority reading of a paired difference's interval (module docstring)."""
    if not gap.defined:
        return "no interval (fewer than 2 seeds)"
    if gap.high < 0.0:
        return "costs more: shown"
    if gap.low > 0.0:
        return "better: shown"
    if gap.low > -margin:
        return "costs no more: claimed"
    return "not shown either way"


@dataclass(frozen=True)
class Row:
    setting: str
    against: str
    seeds: list[int]
    gap: Interval
    p: float
    sd: float


def contrast_rows(gains: Gains, arm: str, against: list[str]) -> list[Row]:
    """`arm` − each comparator over the seeds both ran, per setting that ran both (settings in name order)."""
    rows = []
    for setting in sorted(gains):
        by_correction = gains[setting]
        if arm not in by_correction:
            continue
        for other in against:
            seeds = sorted(set(by_correction[arm]) & set(by_correction.get(other, {})))
            if not seeds:
                continue
            diff = np.array([by_correction[arm][s] - by_correction[other][s] for s in seeds])
            sd = float(diff.std(ddof=1)) if len(diff) > 1 else float("nan")
            rows.append(Row(setting, other, seeds, t_interval(diff), t_test_p(diff), sd))
    return rows


def contrast_markdown(rows: list[Row], arm: str, primary: str, margin: float) -> str:
    """The table of `contrast_rows` with the verdicts (the `primary` comparator's as such, the rest marked
    secondary), Holm's p over the rows and the seeds for power."""
    if not rows:
        return f"(no setting ran {arm} and a comparator on a common seed)"
    lines = [f"Kept gain (held-out pass@1 after − before), {arm} − comparator, paired over the seeds both ran; "
             f"margin {margin:g}; primary: {arm} − {primary}.", "",
             "| setting | comparison | seeds | gain difference [95% t] | p | Holm p | SD of differences | "
             f"seeds for 80% power at ±{margin:g} | verdict |", "|---|---|---|---|---|---|---|---|---|"]
    for row, adjusted in zip(rows, holm([row.p for row in rows]), strict=True):
        gap, role = row.gap, "" if row.against == primary else "secondary: "
        spread = f"[{gap.low:+.3f}, {gap.high:+.3f}]" if gap.defined else "(one seed)"
        needed = pairs_for_power(row.sd, margin)
        lines.append(f"| {row.setting} | {arm} − {row.against} | {len(row.seeds)} | {gap.estimate:+.3f} {spread} | "
                     f"{row.p:.3f} | {adjusted:.3f} | {row.sd:.3f} | {needed if needed else 'not within 200'} | "
                     f"{role}{verdict(gap, margin)} |")
    return "\n".join(lines)


def write_contrast(out: Path, arm: str, against: list[str], margin: float = MARGIN) -> str:
    """OUT/contrast_<arm>.md from the cells recorded under `out`, with the machines of the runs it read; returned
    too. Raises ValueError naming the flag when the folder never ran `arm` or a comparator."""
    gains, runs = kept_gains(recorded_cells(out))
    ran = {correction for by_correction in gains.values() for correction in by_correction}
    for flag, names in (("--arm", [arm]), ("--against", against)):
        missing = [name for name in names if name not in ran]
        if missing:
            raise ValueError(f"{flag} {' '.join(missing)}: no finished run under {out / 'cells'} used it (it ran "
                             f"{' '.join(sorted(ran)) or 'none'})")
    rows = contrast_rows(gains, arm, against)
    used = sorted({(row.setting, name, seed) for row in rows for name in (arm, row.against) for seed in row.seeds})
    text = contrast_markdown(rows, arm, against[0], margin) + "\n\n" + "\n".join(machine_lines([(key[2], runs[key])
                                                                                   for key in used]))
    atomic_write(out / f"contrast_{arm}.md", (text + "\n").encode())
    return text


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m openrlhf_tis.study.contrast", description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="a study's folder (its cells/ are read, nothing runs)")
    parser.add_argument("--arm", required=True, help="the correction under test (e.g. adaptive)")
    parser.add_argument("--against", nargs="+", required=True, metavar="C",
                        help="comparators; the first is the primary (e.g. tis off)")
    parser.add_argument("--margin", type=float, default=MARGIN,
                        help=f"the non-inferiority margin in kept gain (default {MARGIN:g})")
    args = parser.parse_args(argv)
    if not 0.0 < args.margin < 1.0:
        parser.error(f"--margin must lie in (0, 1) (a gain difference), got {args.margin:g}")
    if args.arm in args.against or len(set(args.against)) < len(args.against):
        parser.error(f"--against: each comparator once, and not --arm itself ({args.arm}), got {args.against}")
    out = Path(args.out).expanduser().resolve()
    if not (out / "cells").is_dir():
        parser.error(f"--out {out}: no cells/ folder there (is it a study's folder?)")
    try:
        print(write_contrast(out, args.arm, args.against, args.margin))
    except ValueError as err:
        parser.error(str(err))


if __name__ == "__main__":
    main()
