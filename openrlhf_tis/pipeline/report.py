"""What the train and compare notebooks show, as functions: a notebook cell is one call here.

Each function displays through IPython (the notebook's outputs are the report) and returns what it
showed, so tests assert on the values without a kernel.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pandas as pd
from matplotlib.figure import Figure

from openrlhf_tis.pipeline.params import Param
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


def show_run(run_dir: str | Path, display: Callable[..., Any] | None = None) -> dict[str, Any]:
    """The final plots of one run (curves, mismatch by bucket) and its result row."""
    display = display or ipython_display()
    run_dir = Path(run_dir)
    metrics = load_metrics(run_dir)
    curves = plot_curves(metrics, title=run_dir.name)
    buckets = bucket_table(metrics)
    display(curves)
    display(plot_buckets(buckets))
    table = final_table({run_dir.name: metrics})
    display(table)
    return {"metrics": metrics, "buckets": buckets, "table": table}


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
    display(table)
    buckets = {name: bucket_table(frame) for name, frame in metrics.items()}
    display(plot_buckets(buckets))
    return {"failures": failed, "config_diff": diff, "table": table, "buckets": buckets, "runs": paths}
