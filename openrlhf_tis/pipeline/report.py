"""What the train and compare notebooks show, as functions: a notebook cell is one call here.

Each function displays through IPython (the notebook's outputs are the report) and returns what it
showed, so tests assert on the values without a kernel.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from openrlhf_tis.pipeline.params import Param
from openrlhf_tis.runs.config import read_run_config
from openrlhf_tis.runs.reader import load_metrics
from openrlhf_tis.viz.compare import config_diff, final_table, load_runs, resolve_runs, run_labels
from openrlhf_tis.viz.curves import bucket_table, plot_buckets, plot_curves, png


def _runs_value(value: Any) -> str | None:
    if isinstance(value, str) or (isinstance(value, list) and value and all(isinstance(v, str) for v in value)):
        return None
    return "must be a path or glob, or a non-empty list of them"


def _failures_value(value: dict) -> str | None:
    return None if all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()) else \
        "must map cell names to error texts"


COMPARE_PARAMS: dict[str, Param] = {
    "runs": Param("runs/*", "run directories: a path or glob, or a list of them (roots holding runs work too)",
                  (str, list), check=_runs_value),
    "title": Param("Run comparison", "the report's title", (str,)),
    "failures": Param({}, "cells that failed (name -> error), listed at the top of the report (set by the sweep)",
                      (dict,), check=_failures_value),
}


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
    return ROLLOUT_POLICY.format(precision=config.get("vllm.rollout_precision", "bf16"))


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


def run_table(row: pd.Series, policy: str) -> pd.DataFrame:
    """One run's final_table row as a two-column table (quantity, value) that fits any page width."""
    def fmt(value: Any) -> str:
        return "–" if value is None or (isinstance(value, float) and np.isnan(value)) else f"{value:.4g}"

    labels = headings(policy, row["held_out_first_step"])
    return pd.DataFrame({"value": {label: fmt(row[key]) for key, label in labels.items()}}).rename_axis(row.name)


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
    shown = run_table(table.iloc[0], rollout_policy(run_dir))
    display(shown)
    return {"metrics": metrics, "buckets": buckets, "table": table, "shown": shown}


def show_comparison(runs: Any, failures: Mapping[str, str] | None = None,
                    display: Callable[..., Any] | None = None) -> dict[str, Any]:
    """Failures first, then the configuration differences, overlaid curves, the final table, mismatch by bucket."""
    display = display or ipython_display()
    failed = pd.DataFrame({"error": dict(failures or {})}).rename_axis("cell")
    if len(failed):
        display(failed)
    paths = resolve_runs(runs)
    labels = run_labels(paths)
    metrics = load_runs(paths)
    diff = config_diff(paths, labels)
    display(diff if len(diff) else pd.DataFrame({"note": ["the runs share every flag"]}))
    display(plot_curves(metrics))
    table = final_table(metrics)
    # one run a row, under headings that wrap, so the table fits the page
    policies = sorted({rollout_policy(p) for p in paths})
    policy = policies[0] if len(policies) == 1 else ROLLOUT_POLICY.format(precision="each run's rollout precision")
    display(table.drop(columns="held_out_first_step").rename(columns=headings(policy)))
    buckets = {name: bucket_table(frame) for name, frame in metrics.items()}
    display(plot_buckets(buckets))
    return {"failures": failed, "config_diff": diff, "table": table, "buckets": buckets, "runs": paths}
