"""The study's two gain figures: held-out gain per setting (bars with intervals) and the headline, gain against
measured mismatch (mean k3 KL, log scale) with one line per correction.

Error bars are the 95% t-interval over seeds (viz/stats.py); a setting whose interval excludes 0 is drawn
solid, one that does not is hatched ("not shown"), so a reader cannot mistake noise for a result.
"""

from __future__ import annotations

import matplotlib
import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import FormatStrFormatter, LogLocator, NullFormatter


def _yerr(table: pd.DataFrame, low: str = "t_low", high: str = "t_high", value: str = "gain") -> np.ndarray:
    """Asymmetric error bars around `value` from interval columns (0 where undefined: one seed)."""
    below = (table[value] - table[low]).to_numpy(dtype=float)
    above = (table[high] - table[value]).to_numpy(dtype=float)
    return np.nan_to_num(np.vstack([below, above]), nan=0.0)


def plot_gains(tables: dict[str, pd.DataFrame], title: str = "held-out gain (after − before), mean over seeds"
               ) -> Figure:
    """One bar per setting and source (viz.gains.setting_gains tables keyed by source, the kept policy first),
    error bar = 95% t-interval over seeds; hatched where the interval includes 0."""
    tables = {source: t for source, t in tables.items() if len(t)}
    settings = list(dict.fromkeys(s for t in tables.values() for s in t.index))
    fig = Figure(figsize=(max(6.0, 0.9 * len(settings) * max(1, len(tables)) + 2), 4.2))
    ax = fig.subplots()
    if not settings:
        ax.text(0.5, 0.5, "no run has a held-out score before and after training", ha="center", va="center",
                transform=ax.transAxes)
        return fig
    width = 0.8 / len(tables)
    colours = ("tab:blue", "tab:grey")
    for i, (source, table) in enumerate(tables.items()):
        table = table.reindex(settings)
        x = np.arange(len(settings)) + (i - (len(tables) - 1) / 2) * width
        bars = ax.bar(x, table["gain"].to_numpy(dtype=float), width, yerr=_yerr(table), capsize=3,
                      color=colours[i % len(colours)], alpha=0.85 if i == 0 else 0.5, label=source)
        for bar, is_shown in zip(bars, table["shown"].eq(True), strict=True):  # NaN (no score): not shown
            if not is_shown:
                bar.set_hatch("//")
    ax.axhline(0.0, color="black", linewidth=0.8)
    ax.set_xticks(np.arange(len(settings)), settings, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("held-out pass@1 gain")
    ax.set_title(title + "\nbars: 95% t-interval over seeds; hatched: interval includes 0 (not shown)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_dose_response(points: pd.DataFrame, source: str, reference: str | None = None) -> Figure:
    """The headline: held-out gain (y, 95% t-interval over seeds) against mean k3 KL(μ‖π_old) (x, log), one line
    per correction through its doses; the reference setting's gain as a dashed line with its interval shaded.
    Open markers: the interval includes 0. `points` is viz.gains.dose_response's table."""
    fig = Figure(figsize=(9.0, 4.8))
    ax = fig.subplots()
    usable = points[np.isfinite(points["k3_mean"]) & (points["k3_mean"] > 0) & np.isfinite(points["gain"])] \
        if len(points) else points
    if not len(usable):
        ax.text(0.5, 0.5, "no setting with both a k3 KL and a held-out gain", ha="center", va="center",
                transform=ax.transAxes)
        return fig
    palette = matplotlib.colormaps["tab10"]
    for i, (correction, group) in enumerate(usable.sort_values("k3_mean").groupby("correction", sort=False)):
        colour = palette(i % palette.N)
        ax.errorbar(group["k3_mean"], group["gain"], yerr=_yerr(group), color=colour, capsize=3, marker="o",
                    markerfacecolor="none", label=correction)
        solid = group[group["shown"].astype(bool)]
        ax.plot(solid["k3_mean"], solid["gain"], "o", color=colour)
    for dose, group in usable.groupby("dose", sort=False):  # once a dose, above its points: corrections share it
        ax.annotate(str(dose), (float(np.exp(np.log(group["k3_mean"]).mean())), 1.0),
                    xycoords=("data", "axes fraction"), xytext=(0, -10), textcoords="offset points", ha="center",
                    fontsize=8, color="dimgrey")
    if reference is not None and reference in points.index:
        ref = points.loc[reference]
        ax.axhline(ref["gain"], color="black", linestyle="--", linewidth=0.8, label=f"reference ({reference})")
        if np.isfinite(ref["t_low"]):
            ax.axhspan(ref["t_low"], ref["t_high"], color="black", alpha=0.07)
    ax.axhline(0.0, color="grey", linewidth=0.6)
    return _against_k3(fig, f"held-out gain ({source})", "When does correction pay? Gain against mismatch, 95% "
                       "t-intervals over seeds\nfilled marker: interval excludes 0")


def _against_k3(fig: Figure, ylabel: str, title: str) -> Figure:
    """A gain figure's shared frame: measured k3 on a log x axis, the legend outside on the right."""
    ax = fig.axes[0]
    ax.set_xscale("log")
    ax.set_xlabel("measured mismatch: mean k3 KL(μ ‖ π_old) over the run's steps")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    return fig


AXIS_MARKERS = ("o", "s", "^", "D")


def plot_axes(points: dict[str, pd.DataFrame], source: str) -> Figure:
    """Both axes of mismatch on one figure, against each setting's measured mean k3 KL(μ‖π_old) (x, log), one marker
    shape per axis (the key of `points`: e.g. precision, staleness), one colour per correction, a line through each
    axis's doses of one correction, 95% paired t-intervals over seeds, filled where the interval excludes 0. Top: each
    setting's gain relative to its own study's reference (the studies train at their own learning rates: the question
    is whether the same k3 costs the same share of what on-policy training learns, whatever its source). Bottom: each
    corrected setting's gain relative to uncorrected training at its dose (does the correction pay there).
    `points`: viz.gains.dose_response tables."""
    fig = Figure(figsize=(9.5, 8.0))
    top, bottom = fig.subplots(2, 1, sharex=True)
    corrections = list(dict.fromkeys(c for t in points.values() if "correction" in t for c in t["correction"]))
    if not _draw_versus(top, points, "ref", corrections):
        top.text(0.5, 0.5, "no setting with a k3 KL and a gain paired to its reference", ha="center", va="center",
                 transform=top.transAxes)
        return fig
    if not _draw_versus(bottom, points, "off", corrections):
        bottom.text(0.5, 0.5, "no corrected setting paired with uncorrected training at its dose", ha="center",
                    va="center", transform=bottom.transAxes)
    top.set_xscale("log")
    top.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))  # 0.01, 0.02, 0.05, 0.1, ...: no crowded minors
    top.xaxis.set_major_formatter(FormatStrFormatter("%g"))
    top.xaxis.set_minor_formatter(NullFormatter())
    top.set_ylabel(f"gain − its study's reference\n({source})")
    bottom.set_ylabel(f"gain − uncorrected, same dose\n({source})")
    bottom.set_xlabel("measured mismatch: mean k3 KL(μ ‖ π_old) over the run's steps")
    top.set_title("Does the same k3 cost the same from precision and from staleness (top), and does correction pay "
                  "(bottom)?\n95% paired t-intervals over seeds; filled marker: interval excludes 0", fontsize=10)
    top.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    return fig


def _draw_versus(ax: Axes, points: dict[str, pd.DataFrame], suffix: str, corrections: list[str]) -> bool:
    """Each axis's settings paired against `suffix` (ref: the study's reference; off: uncorrected at the dose) on
    `ax`; False when none is."""
    needed = ("k3_mean", f"difference_vs_{suffix}", f"t_low_vs_{suffix}", f"t_high_vs_{suffix}", f"shown_vs_{suffix}")
    usable = {axis: t[np.isfinite(t["k3_mean"]) & (t["k3_mean"] > 0) & np.isfinite(t[f"difference_vs_{suffix}"])]
              for axis, t in points.items() if len(t) and all(c in t for c in needed)}
    usable = {axis: t for axis, t in usable.items() if len(t)}
    palette = matplotlib.colormaps["tab10"]
    for a, axis in enumerate(points):
        if axis not in usable:
            continue
        marker = AXIS_MARKERS[a % len(AXIS_MARKERS)]
        for correction, group in usable[axis].sort_values("k3_mean").groupby("correction", sort=False):
            colour = palette(corrections.index(correction) % palette.N)
            difference = f"difference_vs_{suffix}"
            ax.errorbar(group["k3_mean"], group[difference],
                        yerr=_yerr(group, f"t_low_vs_{suffix}", f"t_high_vs_{suffix}", difference),
                        color=colour, capsize=3, marker=marker, markerfacecolor="none",
                        linestyle="-" if a == 0 else "--", label=f"{axis}: {correction}")
            solid = group[group[f"shown_vs_{suffix}"].eq(True)]
            ax.plot(solid["k3_mean"], solid[difference], marker, color=colour)
    ax.axhline(0.0, color="black", linewidth=0.8)
    return bool(usable)
