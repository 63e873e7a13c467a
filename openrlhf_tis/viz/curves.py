"""Training and mismatch curves from `metrics.jsonl`: one run, or several overlaid on the same panels.

Figures are built with `matplotlib.figure.Figure`, not pyplot: nothing is registered globally, so a
notebook shows a figure exactly once (where it calls `display`) and a live loop never leaks figures.

Panels name candidate metric keys rather than one key, because upstream and the fork log the same
quantity under different names and older runs lack newer keys (the same rule as runs.summary): a
panel shows what the run has and says so when it has nothing, instead of failing the notebook.
"""

from __future__ import annotations

import io
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import matplotlib
import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from openrlhf_tis.metric_names import (
    ABS_DP_MAX,
    ADAPTIVE_BOUND,
    ADAPTIVE_ESS,
    BUCKET_FRAC_KEYS,
    BUCKET_GAP_KEYS,
    BUCKET_NAMES,
    ENTROPY_KEYS,
    EVAL_PREFIX,
    EVAL_START_PREFIX,
    LAG_STALE,
    MASKED_KEYS,
    MISMATCH_KEYS,
    REJECTED_FRAC,
    RESPONSE_LENGTH_KEYS,
    REWARD_KEYS,
    STALENESS_MAX,
    STALENESS_MEAN,
    TRUNCATED_FRAC,
    VETOED_FRAC,
    WEIGHT_MAX,
    WEIGHT_RAW_MAX,
    WEIGHT_RAW_MEAN,
    WEIGHT_RAW_MIN,
    mismatch_lag_key,
)
from openrlhf_tis.viz.stats import t_band


@dataclass(frozen=True)
class Panel:
    title: str
    series: tuple[tuple[str, ...], ...]  # each series: candidate keys, the first one the run logs is drawn
    log: bool = False
    pattern: str | None = None  # every key matching it is a series too (held-out rewards named by dataset)


def _one(*keys: str) -> tuple[tuple[str, ...], ...]:
    return tuple((k,) for k in keys)


PANELS: tuple[Panel, ...] = (
    Panel("reward", (REWARD_KEYS,)),
    Panel("held-out reward", (), pattern=rf"^{EVAL_PREFIX}.*(reward|score|pass|correct)"),
    Panel("response length", (RESPONSE_LENGTH_KEYS,)),
    Panel("entropy", (ENTROPY_KEYS,)),
    Panel("k3 KL(μ ‖ π_old)", (MISMATCH_KEYS,), log=True),
    Panel("max |Δp|", _one(ABS_DP_MAX)),
    Panel("IS weight", _one(WEIGHT_RAW_MAX, WEIGHT_MAX, WEIGHT_RAW_MEAN, WEIGHT_RAW_MIN), log=True),
    Panel("masked / truncated", (MASKED_KEYS, *_one(TRUNCATED_FRAC, VETOED_FRAC, REJECTED_FRAC))),
    # Policy versions between a batch's rollout policy and π_old: 0 throughout a synchronous run.
    Panel("staleness (lag)", _one(STALENESS_MEAN, STALENESS_MAX)),
    # The k3 panel's gap by its source: lag-0 samples (precision) and stale ones (trainer/mismatch_by_lag.py).
    Panel("k3 by source: lag 0 | stale", _one(mismatch_lag_key("k3", 0), mismatch_lag_key("k3", LAG_STALE)),
          log=True),
    # What the adaptive bound chose each step (correction/adaptive.py): its cap C_t and the ESS of its weights.
    Panel("adaptive cap | ESS", _one(ADAPTIVE_BOUND, ADAPTIVE_ESS)),
)


def as_frame(metrics: pd.DataFrame | list[dict]) -> pd.DataFrame:
    """A metrics DataFrame sorted by step from a DataFrame or a list of records (as run_training passes)."""
    frame = metrics if isinstance(metrics, pd.DataFrame) else pd.DataFrame.from_records(metrics)
    if "step" not in frame:
        return pd.DataFrame({"step": pd.Series([], dtype="int64")})
    return frame.sort_values("step", kind="stable").reset_index(drop=True)


def _finite(frame: pd.DataFrame, key: str) -> bool:
    return key in frame and np.isfinite(pd.to_numeric(frame[key], errors="coerce")).any()


def panel_keys(frame: pd.DataFrame, panel: Panel) -> list[str]:
    """The key drawn for each series of `panel` that this run logs (a finite value at least), in panel order."""
    keys = [next(k for k in series if _finite(frame, k)) for series in panel.series
            if any(_finite(frame, k) for k in series)]
    if panel.pattern:
        keys += sorted(k for k in frame.columns if re.search(panel.pattern, k) and k not in keys and _finite(frame, k))
    return keys


def held_out(frame: pd.DataFrame, key: str) -> tuple[np.ndarray, np.ndarray]:
    """The finite (steps, values) of held-out metric `eval/<name>`, led by the untrained policy's score at
    step 0 when the run logged it (`eval_start/<name>`, on the first line)."""
    values = pd.to_numeric(frame[key], errors="coerce").to_numpy(dtype=float)
    steps = frame["step"].to_numpy()
    ok = np.isfinite(values)
    steps, values = steps[ok], values[ok]
    start = EVAL_START_PREFIX + key.removeprefix(EVAL_PREFIX)
    if start in frame:
        first = pd.to_numeric(frame[start], errors="coerce").dropna()
        if len(first):
            steps, values = np.r_[0, steps], np.r_[float(first.iloc[0]), values]
    return steps, values


SEED_IN_NAME = re.compile(r"(?:^|[_,/ ])seed=\d+")  # a sweep cell's seed axis in a run label
_LINESTYLES = ("-", "--", ":", "-.")


def run_styles(names: Sequence[str]) -> dict[str, dict[str, Any]]:
    """A colour and line style per run name. Runs whose names differ only by `seed=N` share a colour and
    differ by line style, so a study's settings read at a glance however many seeds it has."""
    settings = list(dict.fromkeys(SEED_IN_NAME.sub("", name) for name in names))
    palette = matplotlib.colormaps["tab10" if len(settings) <= 10 else "tab20"]
    styles: dict[str, dict[str, Any]] = {}
    seen: dict[str, int] = {}
    for name in names:
        setting = SEED_IN_NAME.sub("", name)
        styles[name] = {"color": palette(settings.index(setting) % palette.N),
                        "linestyle": _LINESTYLES[seen.get(setting, 0) % len(_LINESTYLES)]}
        seen[setting] = seen.get(setting, 0) + 1
    return styles


def _draw(ax, steps: np.ndarray, values: np.ndarray, label: str, log: bool, **style: Any) -> None:
    values = pd.to_numeric(pd.Series(values), errors="coerce").to_numpy(dtype=float)
    ok = np.isfinite(values) & ((values > 0) if log else True)
    ax.plot(steps[ok], values[ok], marker="o" if ok.sum() < 30 else None, markersize=3, label=label, **style)


def _runs_legend(fig: Figure, styles: Mapping[str, Mapping[str, Any]]) -> None:
    """One legend for the whole figure, below it: per-panel legends of many runs hide the curves."""
    handles = [Line2D([], [], marker="o", markersize=3, **style) for style in styles.values()]
    fig.legend(handles, list(styles), loc="upper center", bbox_to_anchor=(0.5, 0.0), fontsize=8,
               ncol=min(len(styles), 3), frameon=False)


def _panel_grid(panels: int, ncols: int) -> tuple[Figure, np.ndarray]:
    """A figure with a grid of axes for `panels` panels, the cells past the last panel blank."""
    nrows = -(-panels // ncols)
    fig = Figure(figsize=(4.2 * ncols, 3.0 * nrows))
    axes = fig.subplots(nrows, ncols, squeeze=False)
    for ax in list(axes.flat)[panels:]:
        ax.axis("off")
    return fig, axes


def _finish_panel(ax, panel: Panel, drawn: int) -> None:
    """Title, axis and scale of a drawn panel; a panel none of the runs logged says so instead of staying empty."""
    ax.set_title(panel.title, fontsize=10)
    ax.set_xlabel("step", fontsize=8)
    ax.tick_params(labelsize=8)
    if panel.log and drawn:
        ax.set_yscale("log")
    if not drawn:
        ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="grey")


def plot_curves(runs: pd.DataFrame | list[dict] | Mapping[str, pd.DataFrame | list[dict]],
                panels: tuple[Panel, ...] = PANELS, ncols: int = 4, title: str | None = None) -> Figure:
    """A grid of panels: one run (every present key of a panel) or several runs overlaid (one line each)."""
    many = isinstance(runs, Mapping)
    frames = {name: as_frame(m) for name, m in runs.items()} if many else {"": as_frame(runs)}
    styles = run_styles(list(frames)) if many else {"": {}}
    fig, axes = _panel_grid(len(panels), ncols)
    for ax, panel in zip(axes.flat, panels, strict=False):
        drawn = 0
        for name, frame in frames.items():
            keys = panel_keys(frame, panel)
            for key in keys[:1] if many else keys:
                steps, values = held_out(frame, key) if key.startswith(EVAL_PREFIX) else \
                    (frame["step"].to_numpy(), frame[key].to_numpy())
                _draw(ax, steps, values, name if many else key, panel.log, **styles[name])
                drawn += 1
        _finish_panel(ax, panel, drawn)
        if drawn and not many:
            ax.legend(fontsize=7)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    if many:
        _runs_legend(fig, styles)
    return fig


def _run_series(frame: pd.DataFrame, panel: Panel) -> pd.Series | None:
    """The run's curve for `panel` (its first logged key) indexed by step; held-out scores from step 0."""
    keys = panel_keys(frame, panel)
    if not keys:
        return None
    steps, values = held_out(frame, keys[0]) if keys[0].startswith(EVAL_PREFIX) else \
        (frame["step"].to_numpy(), pd.to_numeric(frame[keys[0]], errors="coerce").to_numpy(dtype=float))
    return pd.Series(values, index=steps).groupby(level=0).last()


def plot_setting_curves(runs: Mapping[str, pd.DataFrame | list[dict]], setting_of: Mapping[str, str],
                        panels: tuple[Panel, ...] = PANELS, ncols: int = 4, title: str | None = None) -> Figure:
    """One line per setting: the mean over its seeds at each step with a band (the 95% t-interval over the
    seeds that logged the step), instead of one line per run. The legend gives each setting's seed count."""
    frames = {name: as_frame(m) for name, m in runs.items()}
    settings = list(dict.fromkeys(setting_of[name] for name in frames))
    palette = matplotlib.colormaps["tab10" if len(settings) <= 10 else "tab20"]
    colours = {s: palette(i % palette.N) for i, s in enumerate(settings)}
    seeds = {s: sum(setting_of[name] == s for name in frames) for s in settings}
    fig, axes = _panel_grid(len(panels), ncols)
    for ax, panel in zip(axes.flat, panels, strict=False):
        drawn = 0
        for setting in settings:
            series = [s for name, f in frames.items() if setting_of[name] == setting
                      if (s := _run_series(f, panel)) is not None]
            if not series:
                continue
            table = pd.concat(series, axis=1).sort_index()
            mean, low, high = t_band(table.to_numpy())
            steps = table.index.to_numpy()
            ok = np.isfinite(mean) & ((mean > 0) if panel.log else True)
            ax.plot(steps[ok], mean[ok], marker="o" if ok.sum() < 30 else None, markersize=3, color=colours[setting])
            band = ok & np.isfinite(low)
            if band.any():
                floor = np.nanmin(mean[ok]) / 10 if panel.log else -np.inf  # a log axis cannot show a band below 0
                ax.fill_between(steps[band], np.maximum(low[band], floor), high[band], color=colours[setting],
                                alpha=0.18, linewidth=0)
            drawn += 1
        _finish_panel(ax, panel, drawn)
    fig.suptitle(title or "mean over seeds, band: 95% t-interval over seeds")
    fig.tight_layout()
    _runs_legend(fig, {f"{s} ({seeds[s]} seed{'s' if seeds[s] > 1 else ''})": {"color": colours[s]}
                       for s in settings})
    return fig


def bucket_table(metrics: pd.DataFrame | list[dict]) -> pd.DataFrame:
    """Mismatch by rollout-probability bucket over the whole run: mean |Δlog p| and token share per bucket.

    Each step logs `mismatch/abs_dlogp_<bucket>` (mean over that step's tokens in the bucket) and
    `mismatch/frac_<bucket>` (their share); the run's value weights each step by its share, so it is
    the mean over all the run's tokens in the bucket.
    """
    frame = as_frame(metrics)
    rows = []
    for bucket, gap_key, frac_key in zip(BUCKET_NAMES, BUCKET_GAP_KEYS, BUCKET_FRAC_KEYS, strict=True):
        if gap_key not in frame or frac_key not in frame:
            continue
        gap = pd.to_numeric(frame[gap_key], errors="coerce").to_numpy(dtype=float)
        frac = pd.to_numeric(frame[frac_key], errors="coerce").to_numpy(dtype=float)
        ok = np.isfinite(gap) & np.isfinite(frac) & (frac > 0)
        weight = frac[ok].sum()
        rows.append({"bucket": bucket, "mean_abs_dlogp": float((gap[ok] * frac[ok]).sum() / weight) if weight else
                     np.nan, "token_share": float(frac[ok].mean()) if ok.any() else 0.0})
    return pd.DataFrame(rows, columns=["bucket", "mean_abs_dlogp", "token_share"])


def plot_buckets(tables: pd.DataFrame | Mapping[str, pd.DataFrame], title: str = "mismatch by rollout probability"
                 ) -> Figure:
    """Mean |Δlog p| per rollout-probability bucket (log scale), one line per run: does the gap grow as p → 0?"""
    tables = tables if isinstance(tables, Mapping) else {"": tables}
    styles = run_styles(list(tables))
    fig = Figure(figsize=(7, 3.6))
    ax = fig.subplots()
    drawn = 0
    for name, table in tables.items():
        gap = pd.to_numeric(table["mean_abs_dlogp"], errors="coerce")
        ok = table[np.isfinite(gap) & (gap > 0)]
        if len(ok):
            ax.plot(ok["bucket"], ok["mean_abs_dlogp"], marker="o", label=name or "mean |Δlog p|", **styles[name])
            drawn += 1
    if drawn:
        ax.set_yscale("log")
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    else:
        ax.text(0.5, 0.5, "no bucket metrics logged", ha="center", va="center", transform=ax.transAxes)
    ax.tick_params(axis="x", labelsize=8, labelrotation=20)  # bucket names overlap when level
    ax.set_xlabel("rollout probability μ(token)")
    ax.set_ylabel("mean |log π − log μ|")
    ax.set_title(title)
    fig.tight_layout()
    return fig


def png(fig: Figure, dpi: int = 90) -> bytes:
    """The figure as PNG bytes: what notebooks display (a bare Figure shows as text unless pyplot's inline
    backend was loaded) and what an HTML export embeds."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi, bbox_inches="tight")
    return buffer.getvalue()
