"""Both axes of the mismatch on one figure: `python -m openrlhf_tis.study.axes NAME=FOLDER ... --out FIGURE.png`.

The precision study (rollout precision sets the dose) and the staleness study (the sync cadence sets it) each pair
every setting with its own reference, the uncorrected run whose engine held the trainer's weights in the trainer's
dtype at every step. Their references differ (the staleness study trains at a larger learning rate, so that a lag
moves the policy measurably), so the figure compares what each setting lost against its own reference, against the
mismatch it measured (mean k3 KL(μ‖π_old) over its steps, the same metric on both axes): the same k3 costing the same
on both axes says the mismatch, not its source, is what hurts. Each folder's comparisons keep their own Holm family.
Read from the committed cells alone (any machine); writes beside the figure one table of every setting with both of
its comparisons (against its reference; corrected, against uncorrected training at its dose), which the README's
study table is copied from.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from openrlhf_tis.pipeline.sweep import recorded_cells
from openrlhf_tis.runs.layout import atomic_write
from openrlhf_tis.viz.compare import run_facts
from openrlhf_tis.viz.curves import png
from openrlhf_tis.viz.gain_plots import plot_axes
from openrlhf_tis.viz.gains import difference_with_interval, dose_response, headline_source, run_gains


def axis_points(folder: Path) -> tuple[pd.DataFrame, str]:
    """A study folder's headline points (viz.gains.dose_response) over its completed cells, and the gain's source."""
    runs = [r.run_dir for r in recorded_cells(folder).results if r.status != "failed"]
    if not runs:
        raise ValueError(f"{folder}: no completed cell under {folder / 'cells'}")
    facts = run_facts(runs)
    gains = run_gains(facts)
    source = headline_source(gains)
    return dose_response(facts, gains, source), source


def _detectable(row: pd.Series) -> str:
    return " / ".join(f"{row[f'detectable_vs_{suffix}']:.3f}" if np.isfinite(row.get(f"detectable_vs_{suffix}", np.nan))
                      else "n/a" for suffix in ("ref", "off"))


def _survives(row: pd.Series) -> str:
    """Which of the row's comparisons stays shown after Holm's adjustment over its own study's family."""
    shown = [name for suffix, name in (("ref", "reference"), ("off", "uncorrected"))
             if pd.notna(row.get(f"shown_holm_vs_{suffix}")) and row.get(f"shown_holm_vs_{suffix}")]
    return " and ".join(f"vs {name}" for name in shown) or "no"


def axes_markdown(points: dict[str, pd.DataFrame]) -> str:
    """One row per setting and axis, sorted by k3: what it lost against its study's reference and, corrected, what the
    correction changed against uncorrected training at its dose (each with its paired 95% t-interval), what each
    comparison could have detected, and which stays shown after Holm's adjustment within its own study."""
    header = ["axis", "dose", "correction", "seeds", "mean k3 KL", "gain − reference [95% CI (t)]",
              "gain − uncorrected, same dose [95% CI (t)]", "detectable (80% power): vs reference / vs uncorrected",
              "shown after Holm (its study)"]
    rows = []
    for axis, table in points.items():
        for _, row in table.iterrows():
            reference = str(row["dose"]) == "none" and row["correction"] == "off"
            rows.append((row["k3_mean"], [
                axis, str(row["dose"]), str(row["correction"]), str(int(row["seeds"])), f"{row['k3_mean']:.3g}",
                "reference" if reference else difference_with_interval(row, "ref"),
                "" if reference else difference_with_interval(row, "off"),
                "" if reference else _detectable(row), "" if reference else _survives(row)]))
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(cells) + " |" for _, cells in sorted(rows, key=lambda r: r[0])])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m openrlhf_tis.study.axes", description=__doc__.split("\n")[0])
    parser.add_argument("axes", nargs="+", metavar="NAME=FOLDER",
                        help="an axis's name and its study folder (holding cells/), e.g. precision=results/study/X")
    parser.add_argument("--out", required=True, help="the figure (PNG); its table goes beside it as .md")
    args = parser.parse_args(argv)
    points, sources = {}, set()
    for given in args.axes:
        name, _, folder = given.partition("=")
        if not name or not folder:
            parser.error(f"{given!r}: give NAME=FOLDER, e.g. staleness=results/study/staleness-avx512")
        try:
            points[name], source = axis_points(Path(folder).expanduser().resolve())
        except ValueError as err:
            parser.error(str(err))
        sources.add(source)
    if len(sources) > 1:
        parser.error(f"the folders' gains come from different sources ({', '.join(sorted(sources))}): their cells "
                     "were scored differently, so one figure would compare unlike gains")
    out = Path(args.out).expanduser().resolve()
    source = sources.pop()
    atomic_write(out, png(plot_axes(points, source), dpi=120))
    table = axes_markdown(points)
    atomic_write(out.with_suffix(".md"), (table + "\n").encode())
    print(table)
    print(f"[axes] {out} and {out.with_suffix('.md')}", file=sys.stderr)


if __name__ == "__main__":
    main()
