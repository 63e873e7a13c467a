"""The token explorer's step figure: p_rollout vs p_train, and the log-ratio per rollout-probability bucket.

Drawn on a bare `matplotlib.figure.Figure` (no pyplot: no global figure registry, no backend choice
forced on the caller's kernel) and returned as PNG bytes for an ipywidgets.Image, which re-renders
faster than an Output widget replaying a figure. Buckets are those of the logged metrics
(`mismatch/abs_dlogp_pA-B`, edges from metric_names.py), so the figure and the curves agree.

Nothing here imports torch: torch more than doubles a kernel's live objects, and with them the pause of every
full garbage collection, enough to push an interaction past 300 ms (docs/measurements.md, the token explorer).
"""

from __future__ import annotations

import io

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from openrlhf_tis.metric_names import PROB_BUCKET_EDGES

MAX_POINTS = 5000
"""Scatter points drawn at most (a uniform subsample beyond): enough to see the shape, cheap to render."""
_LOG10 = np.log(10.0)


def log_ratio(frame: pd.DataFrame) -> np.ndarray:
    """log π_θ − log μ per row, float64 (NaN/inf where a log-prob is not finite)."""
    return frame["train_logprob"].to_numpy(np.float64) - frame["rollout_logprob"].to_numpy(np.float64)


def prob_buckets(rollout_logprob: np.ndarray) -> np.ndarray:
    """Index of each token's rollout-probability bucket: i where edge[i-1] <= μ < edge[i] (PROB_BUCKET_EDGES)."""
    return np.searchsorted(np.asarray(PROB_BUCKET_EDGES), np.exp(rollout_logprob), side="right")


def subsample(n: int, k: int, seed: int = 0) -> np.ndarray:
    """Sorted indices of at most `k` of `n` rows, the same for the same (n, k) so a redraw does not flicker."""
    if n <= k:
        return np.arange(n)
    return np.sort(np.random.default_rng(seed).choice(n, size=k, replace=False))


def step_figure(frame: pd.DataFrame, title: str = "", max_points: int = MAX_POINTS) -> Figure:
    """Left: log10 π_θ against log10 μ (masked tokens in red); right: log-ratio histograms per μ bucket.

    `frame` holds the step's tokens after the explorer's filters (rollout_logprob, train_logprob,
    mask_reason). Tokens without finite log-probs on both sides are left out and counted in the title.
    """
    fig = Figure(figsize=(12, 3.4), dpi=80)
    # Fixed margins: a constrained layout measures every label again and doubles the ~100 ms draw.
    fig.subplots_adjust(left=0.05, right=0.81, bottom=0.14, top=0.86, wspace=0.18)
    scatter_ax, hist_ax = fig.subplots(1, 2)
    rollout = frame["rollout_logprob"].to_numpy(np.float64)
    ratio = log_ratio(frame)
    finite = np.isfinite(ratio)
    dropped = int((~finite).sum())
    fig.suptitle(f"{title}{len(frame):,} tokens" + (f" ({dropped} without finite log-probs)" if dropped else ""),
                 fontsize=10)
    if not finite.any():
        for ax in (scatter_ax, hist_ax):
            ax.text(0.5, 0.5, "no token matches", ha="center", va="center", transform=ax.transAxes)
            ax.set_axis_off()
        return fig
    rollout, ratio = rollout[finite], ratio[finite]
    masked = (frame["mask_reason"].astype(str).to_numpy() != "kept")[finite]

    keep = subsample(len(rollout), max_points)
    x, y = rollout[keep] / _LOG10, (rollout[keep] + ratio[keep]) / _LOG10
    low = min(x.min(), y.min()) - 0.1
    scatter_ax.plot([low, 0], [low, 0], color="#888", lw=0.8, ls="--")
    for selected, colour, label in ((~masked[keep], "#4c72b0", "kept"), (masked[keep], "#d62728", "masked")):
        if selected.any():
            scatter_ax.scatter(x[selected], y[selected], s=4, alpha=0.5, color=colour, label=label,
                               rasterized=True, linewidths=0)
    scatter_ax.set(xlabel="log10 μ (rollout)", ylabel="log10 π_θ (train)",
                   title=f"p_rollout vs p_train{f' ({len(keep):,} shown)' if len(keep) < len(rollout) else ''}")
    scatter_ax.legend(loc="upper left", fontsize=8, markerscale=3)

    extent = max(float(np.quantile(np.abs(ratio), 0.995)), 1e-3)
    bins = np.linspace(-extent, extent, 41)
    bucket = prob_buckets(rollout)
    bounds = (0.0, *PROB_BUCKET_EDGES, 1.0)
    for index, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        values = ratio[bucket == index]
        if len(values):
            hist_ax.hist(np.clip(values, -extent, extent), bins=bins, histtype="step", lw=1.2,
                         label=f"[{lo:g}, {hi:g}): {len(values):,}, {np.abs(values).mean():.3g}")
    hist_ax.set_yscale("log")
    hist_ax.set(xlabel="log π_θ − log μ (clipped at the 99.5% quantile)", ylabel="tokens",
                title="log-ratio by rollout-probability bucket")
    hist_ax.xaxis.set_major_locator(MaxNLocator(5))
    hist_ax.legend(title="μ bucket: tokens, mean |Δ|", title_fontsize=8, fontsize=8, loc="upper left",
                   bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    return fig


def figure_png(fig: Figure) -> bytes:
    """The figure as PNG bytes (what an ipywidgets.Image shows)."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()
