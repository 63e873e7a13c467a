"""What the train and compare notebooks show, as functions: a notebook cell is one call here.

Each function displays through IPython (the notebook's outputs are the report) and returns what it
showed, so tests assert on the values without a kernel.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from openrlhf_tis.params import ParamObject, param
from openrlhf_tis.rollout.precision import PRECISION_FLAG, rollout_option
from openrlhf_tis.runs.config import read_run_config
from openrlhf_tis.runs.reader import load_metrics
from openrlhf_tis.runs.summary import held_out_kept
from openrlhf_tis.viz.compare import (
    config_diff,
    final_table,
    load_runs,
    resolve_runs,
    run_facts,
    run_labels,
    setting_diff,
)
from openrlhf_tis.viz.curves import bucket_table, plot_buckets, plot_curves, plot_setting_curves, png
from openrlhf_tis.viz.gain_plots import plot_dose_response, plot_gains
from openrlhf_tis.viz.gains import (
    SOURCES,
    dose_response,
    headline_markdown,
    headline_source,
    reference_setting,
    run_gains,
    setting_gains,
)


def _runs_value(value: Any) -> str | None:
    if isinstance(value, str) or (isinstance(value, list) and value and all(isinstance(v, str) for v in value)):
        return None
    return "must be a path or glob, or a non-empty list of them"


def _failures_value(value: dict) -> str | None:
    return None if all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()) else \
        "must map cell names to error texts"


@dataclass(frozen=True)
class CompareParams(ParamObject):
    """compare.ipynb's parameters."""

    runs: str | list = param("runs/*", "run directories: a path or glob, or a list of them (roots holding runs work "
                             "too)", (str, list), check=_runs_value)
    title: str = param("Run comparison", "the report's title", (str,))
    failures: dict = param({}, "cells that failed (name -> error), listed at the top of the report (set by the "
                           "sweep)", (dict,), check=_failures_value)


def displayable(obj: Any) -> Any:
    """A matplotlib figure as a PNG image IPython shows; anything else unchanged."""
    if isinstance(obj, Figure):
        from IPython.display import Image

        return Image(png(obj))
    return obj


def ipython_display() -> Callable[..., Any]:
    """IPython's display, with matplotlib figures shown as PNG images."""
    from IPython.display import display

    return lambda obj, **kwargs: display(displayable(obj), **kwargs)


# Who produced a held-out score: the run's metrics hold the rollout engine's (vLLM at the run's rollout precision
# sampled the answers). Rows for other policies use the same scheme, e.g. KEPT_POLICY for the trainer's weights.
ROLLOUT_POLICY = "rollout engine ({precision})"
KEPT_POLICY = "kept policy (trainer weights)"


def held_out_label(policy: str, when: str) -> str:
    """A held-out row of the run table: `held-out · <policy> · <when>` (when: 'before training', 'last')."""
    return f"held-out · {policy} · {when}"


def rollout_policy(run_dir: Path) -> str:
    """ROLLOUT_POLICY for the run's `--vllm.rollout_precision` (bf16, upstream's default, when not recorded)."""
    config = (read_run_config(run_dir) or {}).get("config", {})
    return ROLLOUT_POLICY.format(precision=rollout_option(config, PRECISION_FLAG))


# final_table column -> its heading in a report: words with spaces, so that a browser can wrap a narrow column.
HEADINGS = {
    "steps": "steps", "reward_first": "reward · first tenth of steps", "reward_last": "reward · last tenth of steps",
    "held_out_first": "{before}", "held_out_last": "{last}", "k3_kl_mean": "k3 KL(μ‖π_old) · mean",
    "abs_dp_max": "max |Δp|", "masked_frac_mean": "masked fraction · mean",
    "truncated_frac_mean": "truncated fraction · mean", "entropy_last": "entropy · last tenth of steps",
    "step_seconds": "seconds per step · mean",
}


def headings(policy: str, first_step: Any = 0) -> dict[str, str]:
    """HEADINGS with the held-out ones naming `policy` (and the first evaluation's step when not 0)."""
    before = "before training" if first_step in (0, None) else f"first evaluation (step {first_step})"
    held = {"before": held_out_label(policy, before), "last": held_out_label(policy, "last evaluation")}
    return {key: label.format(**held) for key, label in HEADINGS.items()}


def run_table(row: pd.Series, policy: str, kept: Mapping[str, Any] | None = None) -> pd.DataFrame:
    """One run's final_table row as a two-column table (quantity, value) that fits any page width; with `kept`
    (runs.summary.held_out_kept: what the console's summary prints) the kept policy's held-out pass1 on the base
    model and on the saved final model follow the rollout engine's."""
    def fmt(value: Any) -> str:
        return "–" if value is None or (isinstance(value, float) and np.isnan(value)) else f"{value:.4g}"

    values = {}
    for key, label in headings(policy, row["held_out_first_step"]).items():
        values[label] = fmt(row[key])
        if key == "held_out_last" and kept:
            values[held_out_label(kept["label"], "base model")] = fmt(kept["pass1_before"])
            values[held_out_label(kept["label"], "saved final model")] = fmt(kept["pass1_after"])
    return pd.DataFrame({"value": values}).rename_axis(row.name)


def show_run(run_dir: str | Path, display: Callable[..., Any] | None = None) -> dict[str, Any]:
    """The final plots of one run (curves, mismatch by bucket) and its results, one quantity a row."""
    display = display or ipython_display()
    run_dir = Path(run_dir)
    metrics = load_metrics(run_dir)
    curves = plot_curves(metrics, title=run_dir.name)
    buckets = bucket_table(metrics)
    display(curves)
    display(plot_buckets(buckets))
    table = final_table({run_dir.name: metrics})
    shown = run_table(table.iloc[0], rollout_policy(run_dir), held_out_kept(run_dir))
    display(shown)
    return {"metrics": metrics, "buckets": buckets, "table": table, "shown": shown}


def _heading(text: str) -> Any:
    from IPython.display import Markdown

    return Markdown(text)


def _seed_means(table: pd.DataFrame, facts: pd.DataFrame) -> pd.DataFrame:
    """The per-run final table averaged over each setting's seeds (numbers only), with the seed count first."""
    numeric = table.select_dtypes("number").join(facts["setting"])
    grouped = numeric.groupby("setting", sort=False)
    means = grouped.mean()
    means.insert(0, "seeds", grouped.size())
    return means


def show_comparison(runs: Any, failures: Mapping[str, str] | None = None,
                    display: Callable[..., Any] | None = None) -> dict[str, Any]:
    """Failures first; then by setting (runs that differ only by seed are one setting): the flags that differ,
    curves as mean ± band, held-out gains with intervals, the headline (gain against k3 KL) and its table, the
    seed-averaged final table; then the per-run detail (flags, overlaid curves, final table, mismatch by bucket)."""
    display = display or ipython_display()
    failed = pd.DataFrame({"error": dict(failures or {})}).rename_axis("cell")
    if len(failed):
        display(failed)
    paths = resolve_runs(runs)
    labels = run_labels(paths)
    metrics = load_runs(paths)
    facts = run_facts(paths, labels, metrics)
    setting_of = facts["setting"].to_dict()
    display(_heading("### Settings (runs that differ only by seed are one setting)"))
    display(facts.groupby("setting", sort=False).agg(
        runs=("seed", "size"), seeds=("seed", lambda s: ", ".join(str(v) for v in s)), dose=("dose", "first"),
        correction=("correction", "first"), k3_mean=("k3_mean", "mean")))
    by_setting = setting_diff(paths, facts)
    display(by_setting if len(by_setting) else pd.DataFrame({"note": ["the settings share every flag"]}))
    display(plot_setting_curves(metrics, setting_of))
    gains = run_gains(facts)
    per_source = {source: setting_gains(gains, source) for source in SOURCES}
    display(_heading("### Held-out gain by setting: the kept policy (trainer weights, trainer dtype) first, "
                     "the rollout engine's score second; 95% intervals, `shown` only when every interval excludes 0"))
    display(plot_gains(per_source))
    for source, table in per_source.items():
        display(_heading(f"#### {source}"))
        display(table if len(table) else pd.DataFrame({"note": [f"no run has a {source} score before and after"]}))
    source = headline_source(gains)
    reference = reference_setting(facts)
    points = dose_response(facts, gains, source)
    display(_heading(f"### Headline: held-out gain ({source}) against measured mismatch"))
    display(plot_dose_response(points, source, reference))
    headline = headline_markdown(points, source)
    display(_heading(headline))
    table = final_table(metrics)
    display(_heading("### Final values, mean over each setting's seeds"))
    display(_seed_means(table, facts) if len(table) else table)
    display(_heading("### Per-run detail"))
    diff = config_diff(paths, labels)
    display(diff if len(diff) else pd.DataFrame({"note": ["the runs share every flag"]}))
    display(plot_curves(metrics))
    # one run a row, under headings that wrap, so the table fits the page
    policies = sorted({rollout_policy(p) for p in paths})
    policy = policies[0] if len(policies) == 1 else ROLLOUT_POLICY.format(precision="each run's rollout precision")
    display(table.drop(columns="held_out_first_step").rename(columns=headings(policy)))
    buckets = {name: bucket_table(frame) for name, frame in metrics.items()}
    display(plot_buckets(buckets))
    return {"failures": failed, "facts": facts, "setting_diff": by_setting, "config_diff": diff, "gains": gains,
            "setting_gains": per_source, "source": source, "dose_response": points, "headline": headline,
            "table": table, "buckets": buckets, "runs": paths}
