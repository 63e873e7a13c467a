"""The live view of a training job in a notebook: a progress bar over steps and curves redrawn as steps land."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tqdm.auto import tqdm

from openrlhf_tis.metric_names import (
    ABS_DP_MAX,
    ADAPTIVE_BOUND,
    ADAPTIVE_ESS,
    HEALTH_ESS_WORST,
    HEALTH_FALL_WARNING,
    K3_KL,
    LAG_STALE,
    MASKED_FRAC,
    MOE_AGREEMENT,
    MOE_K3_DIFFERED,
    MOE_K3_SAME,
    REWARD_MEAN,
    STALENESS_MAX,
    STALENESS_MEAN,
    STEP_SECONDS,
    mismatch_lag_key,
)
from openrlhf_tis.pipeline.report import displayable, ipython_display
from openrlhf_tis.viz.curves import plot_curves


def step_line(record: dict[str, Any], total: int) -> str:
    """One short line for a step: what a person scans for (reward, mismatch, masking, time)."""
    def fmt(key: str, spec: str) -> str:
        value = record.get(key)
        return format(value, spec) if isinstance(value, (int, float)) else "-"

    # Lag only where there is any (async training, a sync cadence): a synchronous run's line stays as short as
    # before. Then the mismatch is split by its source: lag-0 samples (precision) and stale ones.
    lag = ""
    if record.get(STALENESS_MAX):
        split = (f" (k3 lag 0 {fmt(mismatch_lag_key('k3', 0), '.2e')}, "
                 f"stale {fmt(mismatch_lag_key('k3', LAG_STALE), '.2e')})")
        lag = f"  lag {fmt(STALENESS_MEAN, '.2f')}{split}"
    # The adaptive bound's choice only where it runs: the cap this step's micro-batches took, and their ESS.
    cap = f"  cap {fmt(ADAPTIVE_BOUND, '.2f')} (ess {fmt(ADAPTIVE_ESS, '.3f')})" if ADAPTIVE_BOUND in record else ""
    # A routing-replay run's routing mismatch (docs/moe.md): the engine-vs-trainer agreement and the k3 by cause.
    routing = (f"  routing {fmt(MOE_AGREEMENT, '.3f')} (k3 differed {fmt(MOE_K3_DIFFERED, '.2e')}, "
               f"same {fmt(MOE_K3_SAME, '.2e')})") if MOE_AGREEMENT in record else ""
    # The fall warning (runs/health.py) once it has fired: the regime where the studies' runs fell.
    risk = f"  FALL RISK (ESS {fmt(HEALTH_ESS_WORST, '.2f')})" if record.get(HEALTH_FALL_WARNING) else ""
    return (f"step {record['step']}/{total}  reward {fmt(REWARD_MEAN, '.3f')}  "
            f"k3 {fmt(K3_KL, '.2e')}  max|Δp| {fmt(ABS_DP_MAX, '.3f')}  "
            f"masked {fmt(MASKED_FRAC, '.3f')}{cap}{lag}{routing}  {fmt(STEP_SECONDS, '.1f')} s{risk}")


class LiveCurves:
    """Call with every metrics record so far (run_training's on_progress); redraws only when steps were added.

    `display` defaults to IPython's (returning a handle with `.update`); tests pass their own.
    """

    def __init__(self, total_steps: int, display: Callable[..., Any] | None = None, title: str | None = None):
        display = display or ipython_display()
        self.total, self.title, self._display = total_steps, title, display
        self._bar = tqdm(total=total_steps, desc="training steps", unit="step")
        self._handle = None
        self.drawn = 0

    def __call__(self, records: list[dict[str, Any]]) -> None:
        if len(records) == self.drawn:
            return
        for record in records[self.drawn:]:
            self._bar.set_postfix_str(step_line(record, self.total).split("  ", 1)[1], refresh=False)
        self._bar.update(len(records) - self.drawn)
        self.drawn = len(records)
        fig = plot_curves(records, title=self.title)
        if self._handle is None:
            self._handle = self._display(fig, display_id=True)
        elif hasattr(self._handle, "update"):
            self._handle.update(displayable(fig))

    def close(self, keep_figure: bool = True) -> None:
        """Stop the progress bar; unless `keep_figure`, replace the live figure by a one-line note."""
        self._bar.close()
        if not keep_figure and self._handle is not None and hasattr(self._handle, "update"):
            from IPython.display import HTML

            self._handle.update(HTML(f"<i>{self.drawn} steps trained; the curves are drawn below.</i>"))

    def __enter__(self) -> LiveCurves:
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        # A finished run gets its final curves from the next cell: the live figure, their last redraw, would
        # show every curve twice in the report. A failed run keeps it: nothing else draws its curves.
        self.close(keep_figure=exc_type is not None)
