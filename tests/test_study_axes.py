"""Both axes of the mismatch on one figure (study/axes.py, viz/gain_plots.py plot_axes), from hand-made tables."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from openrlhf_tis.study import axes
from openrlhf_tis.viz.gain_plots import plot_axes


def _points(rows: list[tuple]) -> pd.DataFrame:
    """A dose_response table: (setting, dose, correction, k3, difference vs reference, low, high, shown)."""
    frame = pd.DataFrame(rows, columns=["setting", "dose", "correction", "k3_mean", "difference_vs_ref",
                                        "t_low_vs_ref", "t_high_vs_ref", "shown_vs_ref"]).set_index("setting")
    frame["seeds"] = 3
    frame["detectable_vs_ref"] = 0.2
    frame["p_holm_vs_ref"] = np.where(frame["shown_vs_ref"].eq(True), 0.01, 0.9)
    frame["shown_holm_vs_ref"] = frame["shown_vs_ref"].eq(True) & (frame["p_holm_vs_ref"] < 0.05)
    return frame


PRECISION = _points([("none / off", "none", "off", 0.002, np.nan, np.nan, np.nan, np.nan),
                     ("w5a8 / off", "w5a8", "off", 0.39, -0.06, -0.13, 0.01, False),
                     ("int8 / off", "int8", "off", 0.04, 0.01, -0.1, 0.13, False),
                     ("w5a8 / tis", "w5a8", "tis", 0.37, -0.09, -0.3, 0.12, False)])
STALENESS = _points([("none / off", "none", "off", 0.0017, np.nan, np.nan, np.nan, np.nan),
                     ("none+s8 / off", "none+s8", "off", 0.15, -0.45, -0.6, -0.3, True),
                     ("none+s8 / tis", "none+s8", "tis", 0.16, -0.04, -0.2, 0.12, False)])
# TIS at K = 8 against uncorrected training at K = 8: +0.41, shown, surviving Holm
STALENESS.loc["none+s8 / tis", ["difference_vs_off", "t_low_vs_off", "t_high_vs_off", "detectable_vs_off"]] = [
    0.41, 0.2, 0.62, 0.15]
STALENESS["shown_vs_off"] = STALENESS["shown_holm_vs_off"] = STALENESS.index == "none+s8 / tis"


def test_each_axis_and_correction_is_one_line_through_its_doses_in_k3_order():
    fig = plot_axes({"precision": PRECISION, "staleness": STALENESS}, "kept policy")
    ax = fig.axes[0]
    handles, labels = ax.get_legend_handles_labels()
    lines = {label: handle.lines[0] for handle, label in zip(handles, labels, strict=True)}  # errorbar's data line
    assert set(lines) == {"precision: off", "precision: tis", "staleness: off", "staleness: tis"}
    x, y = lines["precision: off"].get_data()
    assert list(x) == [0.04, 0.39] and list(y) == [0.01, -0.06]  # the reference has no paired difference
    assert lines["precision: off"].get_marker() == "o" and lines["staleness: off"].get_marker() == "s"
    assert lines["precision: off"].get_color() == lines["staleness: off"].get_color()  # colour: the correction
    filled = [line for line in ax.get_lines() if line not in lines.values() and line.get_linestyle() == "None"
              and line.get_marker() in ("o", "s") and len(line.get_xdata())]
    assert [(list(f.get_xdata()), f.get_marker()) for f in filled] == [([0.15], "s")]  # only the shown one
    assert ax.get_xscale() == "log"
    bottom = fig.axes[1]  # each correction against uncorrected training at its dose: only staleness's TIS is paired
    paired = [(list(line.get_xdata()), list(line.get_ydata()), line.get_marker()) for line in bottom.get_lines()
              if line.get_marker() in ("o", "s") and line.get_linestyle() != "None"]
    assert paired == [([0.16], [0.41], "s")] and bottom.get_xscale() == "log"


def test_nothing_to_draw_is_said_on_the_figure():
    fig = plot_axes({"precision": PRECISION.iloc[:1]}, "kept policy")
    assert "no setting" in fig.axes[0].texts[0].get_text()


def test_the_table_is_sorted_by_k3_and_gives_both_comparisons_of_each_setting():
    table = axes.axes_markdown({"precision": PRECISION, "staleness": STALENESS}).splitlines()
    body = [row.split(" | ") for row in table[2:]]
    k3 = [float(row[4]) for row in body]
    assert k3 == sorted(k3) and len(body) == 7
    assert body[0][:2] == ["| staleness", "none"] and body[0][5] == "reference"
    s8 = {row[2]: row[5:] for row in body if row[1] == "none+s8"}
    assert s8["off"] == ["-0.450 [-0.600, -0.300]", "n/a", "0.200 / n/a", "vs reference |"]
    assert s8["tis"] == ["-0.040 [-0.200, +0.120]", "+0.410 [+0.200, +0.620]", "0.200 / 0.150", "vs uncorrected |"]
    w5a8 = next(row for row in body if row[1] == "w5a8" and row[2] == "off")
    assert w5a8[5:] == ["-0.060 [-0.130, +0.010]", "n/a", "0.200 / n/a", "no |"]


@pytest.mark.parametrize(("argv", "fault"), [
    (["precision", "--out", "x.png"], "give NAME=FOLDER"),
    (["staleness={empty}", "--out", "x.png"], "no completed cell under"),
])
def test_bad_axes_are_refused_naming_them(tmp_path, capsys, argv, fault):
    (tmp_path / "empty" / "cells").mkdir(parents=True)
    argv = [a.format(empty=tmp_path / "empty") for a in argv]
    with pytest.raises(SystemExit) as done:
        axes.main(argv)
    err = capsys.readouterr().err
    assert done.value.code == 2 and fault in err and argv[0].split("=")[-1] in err
