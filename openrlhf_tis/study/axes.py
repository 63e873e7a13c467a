"""Both axes of the mismatch on one figure: `python -m openrlhf_tis.study.axes NAME=FOLDER ... --out FIGURE.png`.

The precision study (rollout precision sets the dose) and the staleness study (the sync cadence sets it) each pair
every setting with its own reference, the uncorrected run whose engine held the trainer's weights in the trainer's
dtype at every step. Their references differ (the staleness study trains at a larger learning rate, so that a lag
moves the policy measurably), so the figure compares what each setting lost against its own reference, against the
mismatch it measured (mean k3 KL(μ‖π_old) over its steps, the same metric on both axes): the same k3 costing the same
on both axes says the mismatch, not its source, is what hurts. Each folder's comparisons keep their own Holm family.
Read from the committed cells alone (any machine); prints one table with every comparison against the references.
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
from openrlhf_tis.viz.gains import dose_response, headline_source, run_gains


def axis_points(folder: Path) -> tuple[pd.DataFrame, str]:
    """A study folder's headline points (viz.gains.dose_response) over its completed cells, and the gain's source."""
    runs = [r.run_dir for r in recorded_cells(folder).results if r.status != "failed"]
    if not runs:
        raise ValueError(f"{folder}: no completed cell under {folder / 'cells'}")
    facts = run_facts(runs)
    gains = run_gains(facts)
    source = headline_source(gains)
    return dose_response(facts, gains, source), source


def _true(flag: object) -> bool:
    """A table's boolean cell, False where missing (NaN in a column pandas keeps as objects)."""
    return bool(pd.notna(flag) and flag)


def _cell(value: float, spec: str) -> str:
    return "n/a" if value is None or not np.isfinite(value) else format(value, spec)


def axes_markdown(points: dict[str, pd.DataFrame]) -> str:
    """One row per setting and axis, sorted by k3: its loss against its study's reference, what that comparison could
    have detected, and its Holm-adjusted p within its own study."""
    header = ["axis", "dose", "correction", "seeds", "mean k3 KL", "gain − reference", "95% CI (t)", "shown",
              "detectable (80% power)", "p (Holm, its study)"]
    rows = []
    for axis, table in points.items():
        for _, row in table.iterrows():
            difference = row.get("difference_vs_ref", np.nan)
            reference = not np.isfinite(difference) and row["correction"] == "off" and str(row["dose"]) == "none"
            rows.append((row["k3_mean"], [
                axis, str(row["dose"]), str(row["correction"]), str(int(row["seeds"])), _cell(row["k3_mean"], ".3g"),
                "reference" if reference else _cell(difference, "+.3f"),
                "" if reference else f"[{_cell(row.get('t_low_vs_ref'), '+.3f')}, "
                f"{_cell(row.get('t_high_vs_ref'), '+.3f')}]",
                "" if reference else ("yes" if _true(row.get("shown_vs_ref")) else "no"),
                "" if reference else _cell(row.get("detectable_vs_ref", np.nan), ".3f"),
                "" if reference else _cell(row.get("p_holm_vs_ref", np.nan), ".3f")]))
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
