"""The per-token mismatch explorer (ipywidgets 8): which tokens of which responses the trainer and vLLM disagree on.

Pick a run (a dropdown when given a root of runs), a dumped step and a sample; the response is drawn
with each token coloured by log π_θ − log μ (token_html.py), and in a routing-replay run the tokens whose MoE
routing differed between engine and trainer underlined (their layers in the hover); filters restrict the view to
masked, truncated, one mask reason's or routing-differed tokens and to a rollout-probability range; the step
figure shows p_rollout vs p_train and the log-ratio per probability bucket (token_plots.py); the worst-token list
(largest |log π_θ − log μ| of the step) jumps to a token's sample when a row is chosen.

Every interaction queries the run store: one step file, the step and sample pushed into the scan and
the filters into its WHERE (`query_tokens`), never a whole dump; benchmarks/bench_explorer.py times
each interaction on 5 M token rows.

DOM contract (a browser test relies on it):
- every token of the response is a `<span class="tok">` in the `response` HTML widget, and nothing else
  there has a class starting with "tok" (counting `class="tok` counts the sample's tokens);
- the step picker is an ipywidgets.Dropdown with description "step", the sample picker a Dropdown with
  description "sample"; their option labels are the plain step / sample numbers.

For tests and notebooks: `select(step=, sample=, position=)` changes the view as a user would, the
widgets are attributes (run, step, sample, show, prob, response, plots, worst, notice, info), and
`step_tokens`, `sample_tokens`, `worst_tokens` hold what is shown.
"""

from __future__ import annotations

import base64
import contextlib
import html
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ipywidgets as widgets
import numpy as np
import pandas as pd

from openrlhf_tis.params import ParameterError, ParamObject, param, positive
from openrlhf_tis.runs import query_tokens, token_steps
from openrlhf_tis.runs.reader import find_runs
from openrlhf_tis.runs.schema import MASK_REASONS
from openrlhf_tis.viz.token_html import DEFAULT_CLAMP, render_response
from openrlhf_tis.viz.token_plots import MAX_POINTS, figure_png, log_ratio, step_figure

WORST_ROWS = 20
"""Rows of the worst-token list."""
PROB_SLIDER_MIN = -8.0
"""Lowest log10 μ of the probability slider; at an end the range is open (and non-finite μ included)."""

# Value of the `show` dropdown -> its label. "truncated" = kept but down-weighted (is_weight < is_weight_raw):
# a masked token's weight is 0 and would otherwise count as truncated too.
FILTERS = {
    "all": "all tokens",
    "masked": "masked (any reason)",
    "truncated": "truncated (kept, weight < raw)",
    **{name: f"masked: {name}" for name in MASK_REASONS.values() if name != "kept"},
    "routing": "MoE routing differed (routing replay runs)",
}
TOKEN_COLUMNS = ["sample_id", "position", "token_id", "token_text", "rollout_logprob", "old_logprob",
                 "train_logprob", "is_weight_raw", "is_weight", "mask_reason"]
LAG_FILTERS = [("any", None), ("0 (on-policy)", (0, 0)), ("≥ 1 (stale)", (1, None))]  # query_tokens' lags
SAMPLE_COLUMNS = [*TOKEN_COLUMNS, "prompt_id", "prompt_text", "reward", "advantage", "routing_mismatch_layers"]


def _directory(value: str) -> str | None:
    return None if not value or Path(value).is_dir() else "no such directory"


@dataclass(frozen=True)
class ExplorerParams(ParamObject):
    """token_explorer.ipynb's parameters."""

    run_dir: str = param("", "run directory to open ('' with root: the newest run under root)", (str,),
                         check=_directory)
    root: str = param("", "a directory of runs: adds a run dropdown ('': none)", (str,), check=_directory)
    step: int | None = param(None, "dumped step to open (None: the last)", (int, type(None)))
    sample: int | None = param(None, "sample id to open (None: the first of the step)", (int, type(None)))
    clamp: float = param(DEFAULT_CLAMP, "|log π_θ − log μ| at which token colours saturate", (float, int),
                         check=positive)


def worst_tokens(frame: pd.DataFrame, n: int = WORST_ROWS) -> pd.DataFrame:
    """The `n` rows with the largest finite |log π_θ − log μ|, largest first (ties: first in (sample, position)),
    with a `log_ratio` column added."""
    ratio = log_ratio(frame)
    scored = frame.assign(log_ratio=ratio, abs_log_ratio=np.abs(ratio))[np.isfinite(ratio)]
    return scored.nlargest(n, "abs_log_ratio", keep="first").drop(columns="abs_log_ratio").reset_index(drop=True)


def worst_table(worst: pd.DataFrame) -> pd.DataFrame:
    """The worst-token list as a table for static views: probabilities rather than log-probs, text as repr."""
    if not len(worst):
        return pd.DataFrame(columns=["log π_θ − log μ", "sample", "position", "μ", "π_θ", "mask", "token"])
    return pd.DataFrame({
        "log π_θ − log μ": worst["log_ratio"].map("{:+.3f}".format),
        "sample": worst["sample_id"].astype(int), "position": worst["position"].astype(int),
        "μ": np.exp(worst["rollout_logprob"].astype(float)).map("{:.3g}".format),
        "π_θ": np.exp(worst["train_logprob"].astype(float)).map("{:.3g}".format),
        "mask": worst["mask_reason"].astype(str),
        "token": [_short_text(t, i, width=24) for t, i in zip(worst["token_text"], worst["token_id"], strict=True)],
    })


def _short_text(text: Any, token_id: int, width: int = 14) -> str:
    shown = f"⟨{int(token_id)}⟩" if not isinstance(text, str) else repr(text)
    return shown if len(shown) <= width else shown[: width - 1] + "…"


def worst_label(token: Any) -> str:
    """One row of the worst-token list: log-ratio, where it is, μ and π_θ, mask reason, text.

    Spaces are no-break spaces: a browser collapses runs of plain spaces in a <select>, and the columns
    line up only in the monospace font if every space is kept.
    """
    row = (f"{token.log_ratio:+8.3f}  sample {int(token.sample_id):<4} pos {int(token.position):<5} "
           f"μ={math.exp(token.rollout_logprob):<9.3g} π_θ={math.exp(token.train_logprob):<9.3g} "
           f"{token.mask_reason!s:<9} {_short_text(token.token_text, token.token_id)}")
    return row.replace(" ", "\u00a0")


def no_dumps_notice(run_dir: str | os.PathLike | None) -> str:
    """Why there is nothing to explore, and what to do about it (HTML)."""
    if run_dir is None:
        return ("<b>No run selected.</b> Pass <code>run_dir</code> (a run directory) or <code>root</code> "
                "(a directory of runs).")
    where = html.escape(os.fspath(run_dir))
    if not Path(run_dir).is_dir():
        return f"<b>{where} does not exist.</b>"
    return (f"<b>No token dumps in {where}</b> (no <code>tokens/step_*.parquet</code>). Per-token data is "
            f"written when training runs with <code>--logger.token_dump_steps N</code> (N &gt; 0: step 1 and "
            f"every N-th step; <code>--logger.token_dump_samples K</code> responses each). This run's curves "
            f"(metrics.jsonl) are in train.ipynb and compare.ipynb.")


class TokenExplorer:
    """The explorer over one run (or the runs under `root`); display it, or its `.widget`, in a notebook."""

    def __init__(
        self,
        run_dir: str | os.PathLike | None = None,
        *,
        root: str | os.PathLike | None = None,
        clamp: float = DEFAULT_CLAMP,
        worst_rows: int = WORST_ROWS,
        max_points: int = MAX_POINTS,
    ):
        self.clamp, self.worst_rows, self.max_points = clamp, worst_rows, max_points
        self._quiet_depth = 0
        self.run_dir: Path | None = None
        self.steps: list[int] = []
        self.samples: list[int] = []
        self.current_step: int | None = None
        self.current_sample: int | None = None
        self.focus: int | None = None
        self.step_tokens = self.sample_tokens = self.worst_tokens = pd.DataFrame()

        self.run = widgets.Dropdown(description="run", layout=widgets.Layout(width="50%"))
        self.step = widgets.Dropdown(description="step", layout=widgets.Layout(width="180px"))
        self.sample = widgets.Dropdown(description="sample", layout=widgets.Layout(width="180px"))
        self.show = widgets.Dropdown(description="show", options=[(label, key) for key, label in FILTERS.items()])
        # Staleness of the sample (policy versions behind π_old; async training); a synchronous run is all lag 0.
        self.lag = widgets.Dropdown(description="lag", options=LAG_FILTERS, layout=widgets.Layout(width="200px"))
        self.prob = widgets.FloatRangeSlider(description="log10 μ", min=PROB_SLIDER_MIN, max=0.0, step=0.1,
                                             value=(PROB_SLIDER_MIN, 0.0), readout_format=".1f",
                                             continuous_update=False, layout=widgets.Layout(width="360px"))
        self.notice = widgets.HTML()
        self.info = widgets.HTML()
        self.response = widgets.HTML(layout=widgets.Layout(width="auto"))
        self.plots = widgets.Image(format="png", layout=widgets.Layout(width="960px"))
        self.worst = widgets.Select(description="worst", rows=min(worst_rows, 12), layout=widgets.Layout(width="100%"))
        self.worst.add_class("mm-worst")
        worst_style = widgets.HTML("<style>.mm-worst select {font-family: monospace; font-size: 12px}</style>")
        self.body = widgets.VBox([
            widgets.HBox([self.step, self.sample, self.show, self.lag, self.prob]), self.info, self.response,
            self.plots, widgets.HTML("<b>Worst tokens of the step</b> (largest |log π_θ − log μ|; choose one to "
                                     "jump to it)"), worst_style, self.worst,
        ])
        self.widget = widgets.VBox([self.notice, self.run, self.body])

        self.step.observe(self._on(lambda value: self.select(step=value)), "value")
        self.sample.observe(self._on(self._pick_sample), "value")
        self.worst.observe(self._on(self._jump), "value")
        for control in (self.show, self.lag, self.prob):
            control.observe(self._on(lambda _: self._refilter()), "value")
        self.run.observe(self._on(self.open), "value")

        runs = find_runs(root) if root is not None else []
        self._run_paths = [os.fspath(path) for path in runs]
        with self._quiet():
            self.run.options = [(os.path.relpath(path, root), os.fspath(path)) for path in runs]
        self.run.layout.display = None if root is not None else "none"
        if run_dir is None and runs:
            run_dir = runs[-1]
        self.open(run_dir)

    # --- display ---------------------------------------------------------------------------------------
    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        """The widget for a live kernel, and beside it `static_html()`: what a saved notebook, its HTML
        export or any viewer without the kernel shows (pipeline.execute.export_html keeps only that one)."""
        return {**self.widget._repr_mimebundle_(**kwargs), "text/html": self.static_html()}

    def static_html(self) -> str:
        """The opened sample as plain HTML: the info line, the coloured response, the step figure as an embedded
        PNG and the worst-token table; the notice alone when there is nothing to explore."""
        if not self.steps:
            return self.notice.value
        figure = base64.b64encode(bytes(self.plots.value)).decode()
        worst = worst_table(self.worst_tokens).to_html(index=False, escape=True, border=0)
        return (f"<div>{self.info.value}</div>{self.response.value}"
                f'<img alt="step figure" style="max-width:100%" src="data:image/png;base64,{figure}">'
                "<div><b>Worst tokens of the step</b> (largest |log π_θ − log μ|)</div>" + worst)

    @contextlib.contextmanager
    def _quiet(self) -> Iterator[None]:
        """Widget changes made by the explorer itself, which its observers must not act on again."""
        self._quiet_depth += 1
        try:
            yield
        finally:
            self._quiet_depth -= 1

    def _on(self, handler: Callable[[Any], Any]) -> Callable[[dict], None]:
        def observer(change: dict) -> None:
            if not self._quiet_depth:
                handler(change["new"])
        return observer

    # --- what the user can do --------------------------------------------------------------------------
    def open(self, run_dir: str | os.PathLike | None) -> None:
        """Show run `run_dir` at its last dumped step, or a notice when it has no token dumps."""
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.steps = token_steps(self.run_dir) if self.run_dir is not None else []
        self.current_step = self.current_sample = self.focus = None
        with self._quiet():
            path = os.fspath(self.run_dir) if self.run_dir is not None else None
            self.run.value = path if path in self._run_paths else None  # a run outside root: none picked
            self.step.options = [(str(s), s) for s in self.steps]
        if not self.steps:
            self.notice.value = no_dumps_notice(run_dir)
            self.body.layout.display = "none"
            self.step_tokens = self.sample_tokens = self.worst_tokens = pd.DataFrame()
            return
        self.notice.value = ""
        self.body.layout.display = None
        self.select(step=self.steps[-1])

    def select(self, step: int | None = None, sample: int | None = None, position: int | None = None) -> None:
        """Go to `step` (keeping the sample id when the step has it), `sample`, and outline token `position`."""
        if not self.steps:
            if step is not None or sample is not None:
                raise ValueError(f"{self.run_dir} has no token dumps")
            return
        if step is not None and step != self.current_step:
            if step not in self.steps:
                raise ValueError(f"step {step} has no token dump in {self.run_dir}; dumped steps: {self.steps}")
            self.current_step = step
            self.samples = self._sample_ids(step)
            with self._quiet():
                self.step.value = step
                self.sample.options = [(str(s), s) for s in self.samples]
            self._load_step()
            if sample is None:  # keep the sample id when this step dumped it too
                sample = self.current_sample if self.current_sample in self.samples else self.samples[0]
            self.current_sample = None  # the sample's rows are those of the new step: reload them
        if sample is not None and sample != self.current_sample:
            if sample not in self.samples:
                raise ValueError(f"sample {sample} is not dumped at step {self.current_step}; "
                                 f"dumped samples: {self.samples}")
            self.current_sample = sample
            with self._quiet():
                self.sample.value = sample
            self.focus = position
            self.sample_tokens = query_tokens(self.run_dir, steps=(self.current_step, self.current_step),
                                              samples=[sample], columns=SAMPLE_COLUMNS)
        else:
            self.focus = position
        self._draw_response()

    def _pick_sample(self, sample: int) -> None:
        with self._quiet():
            self.worst.index = None  # so that any row, the last one chosen included, can be chosen again
        self.select(sample=sample)

    def _jump(self, target: tuple[int, int] | None) -> None:
        if target is not None:
            self.select(sample=target[0], position=target[1])

    def _refilter(self) -> None:
        self._load_step()
        self._draw_response()

    # --- queries and drawing ---------------------------------------------------------------------------
    def filter_args(self) -> dict[str, Any]:
        """The `query_tokens` filters the controls stand for (truncation is applied after the query)."""
        args: dict[str, Any] = {}
        show = self.show.value
        if show == "masked":
            args["masked_only"] = True
        elif show == "truncated":
            args["reasons"] = ["kept"]
        elif show == "routing":
            args["routing_mismatched"] = True
        elif show != "all":
            args["reasons"] = [show]
        if self.lag.value is not None:
            args["lags"] = self.lag.value
        lo, hi = self.prob.value
        bounds = (None if lo <= self.prob.min else 10.0 ** lo, None if hi >= self.prob.max else 10.0 ** hi)
        if bounds != (None, None):
            args["prob_range"] = bounds
        return args

    def _sample_ids(self, step: int) -> list[int]:
        ids = query_tokens(self.run_dir, steps=(step, step), columns=["sample_id"], reason_names=False)["sample_id"]
        return sorted(int(s) for s in ids.unique())

    def _load_step(self) -> None:
        """Query the current step with the filters; redraw the step figure, the worst list and the info line."""
        step = self.current_step
        frame = query_tokens(self.run_dir, steps=(step, step), columns=TOKEN_COLUMNS, **self.filter_args())
        if self.show.value == "truncated":
            frame = frame[frame["is_weight"] < frame["is_weight_raw"]].reset_index(drop=True)
        self.step_tokens = frame
        self.plots.value = figure_png(step_figure(frame, f"step {step}: ", self.max_points))
        self.worst_tokens = worst_tokens(frame, self.worst_rows)
        with self._quiet():
            self.worst.options = [(worst_label(t), (int(t.sample_id), int(t.position)))
                                  for t in self.worst_tokens.itertuples(index=False)]
            self.worst.index = None
        filtered = bool(self.filter_args())
        self.info.value = (f"{html.escape(self.run_dir.name)} · step {step} · {len(self.samples)} samples dumped"
                           + (f" · {len(frame):,} tokens match the filter in {frame['sample_id'].nunique()} samples"
                              if filtered else f" · {len(frame):,} tokens"))

    def active_positions(self) -> set[int] | None:
        """Positions of the current sample that pass the filters (None: no filter, all of them)."""
        if not self.filter_args():
            return None
        frame = self.step_tokens
        return set(frame.loc[frame["sample_id"] == self.current_sample, "position"].tolist())

    def _draw_response(self) -> None:
        tokens = self.sample_tokens
        header = f"step {self.current_step} · sample {self.current_sample} · {len(tokens)} tokens"
        prompt = None
        if len(tokens):
            first = tokens.iloc[0]
            masked = int((tokens["mask_reason"].astype(str) != "kept").sum())
            header += (f" · prompt {int(first['prompt_id'])} · reward {float(first['reward']):.4g}"
                       f" · advantage {float(first['advantage']):.4g} · {masked} masked")
            layers = tokens["routing_mismatch_layers"].dropna()
            if len(layers):  # a routing-replay run: how many of the compared tokens the routers split on
                header += f" · MoE routing differed on {sum(len(v) > 0 for v in layers)} of {len(layers)} tokens"
            text = first["prompt_text"]
            prompt = text if isinstance(text, str) else "(this dump does not hold the prompt's text)"
        self.response.value = render_response(tokens, self.clamp, self.active_positions(), self.focus, header,
                                              prompt)


def open_explorer(params: ExplorerParams) -> TokenExplorer:
    """The explorer a notebook's checked parameters ask for; a step or sample the run did not dump is a
    ParameterError listing the ones it did."""
    explorer = TokenExplorer(params.run_dir or None, root=params.root or None, clamp=params.clamp)
    try:
        explorer.select(step=params.step, sample=params.sample)
    except ValueError as err:
        raise ParameterError(f"token_explorer.ipynb parameters: {err}") from None
    return explorer
