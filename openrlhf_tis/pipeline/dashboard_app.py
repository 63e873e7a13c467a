"""The dashboard's page (notebooks/dashboard.ipynb, served by `openrlhf-tis-dashboard`): the runs under a root,
the token explorer and the run comparison, in tabs.

Everything is read from the run store when the page opens and again on "reload" (the comparison, seconds of
matplotlib, when its tab is opened), so a run still in progress
shows what it has written so far (metrics.jsonl up to its last whole line, the token dumps already renamed into
place) and a reload picks up its new steps and dumps. A root that does not exist or holds no runs yet, a run
without token dumps, and runs that have logged no step are notices on the page, never an error: the server
keeps serving, and a reload finds what appeared since.

The page opens on the runs tab, and a reload keeps the tab that is open.

DOM contract (the browser test relies on it): the runs table is a `<table class="mm-runs">` with one row per
run, its first column the run's path relative to the root, each header aligned as its column's cells (numbers
right, text left); the reload button's label is "reload"; the notice is an element of class `mm-notice`; the
explorer keeps its own contract (viz/explorer.py).
"""

from __future__ import annotations

import html
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ipywidgets as widgets
import pandas as pd

from openrlhf_tis.params import ParamObject, param
from openrlhf_tis.pipeline.report import ipython_display, show_comparison
from openrlhf_tis.runs.health import health_label
from openrlhf_tis.runs.layout import METRICS_FILE
from openrlhf_tis.runs.reader import find_runs, read_metrics_records, run_info
from openrlhf_tis.viz.explorer import TokenExplorer


@dataclass(frozen=True)
class DashboardParams(ParamObject):
    """dashboard.ipynb's parameters."""

    root: str = param("runs", "directory of runs to show (one that does not exist yet is a notice, not an error)",
                      (str,))


TABS = ("runs", "tokens", "compare")
COMPARE_TAB = TABS.index("compare")


def root_notice(root: Path, runs: list[Path]) -> str:
    """Why there is nothing to show under `root` (HTML), or '' when it holds runs."""
    where = html.escape(os.fspath(root))
    if not root.exists():
        return f"<b>{where} does not exist (yet).</b> Start a run there (--logger.run_dir), then reload."
    if not root.is_dir():
        return f"<b>{where} is not a directory.</b> Point the dashboard at a directory of runs."
    if not runs:
        return (f"<b>No runs under {where} yet</b> (a run directory holds config.json, metrics.jsonl or tokens/). "
                f"Reload once a run has started.")
    return ""


def table_style(table: pd.DataFrame) -> str:
    """A `<style>` aligning each header of the runs table as its column's cells: numbers right, text left.

    pandas right-aligns the header row while the page's cells stay left-aligned, so a header sat off its column.
    """
    numeric = [i for i, column in enumerate(table.columns, 1) if pd.api.types.is_numeric_dtype(table[column])]
    right = ", ".join(f"table.mm-runs tr > :nth-child({i})" for i in numeric)
    return ("<style>table.mm-runs th, table.mm-runs td {text-align: left; padding: 2px 16px 2px 0}"
            + (f" {right} {{text-align: right}}" if right else "") + "</style>")


def run_table(root: Path, runs: list[Path]) -> pd.DataFrame:
    """One row per run: its path relative to `root`, steps logged, last step, dumped steps, when it started, when
    metrics.jsonl last changed (UTC; a run in progress keeps moving it) and its fall warning (runs/health.py)."""
    info = [run_info(path) for path in runs]

    def updated(path: Path) -> str | None:
        metrics = path / METRICS_FILE
        return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(metrics.stat().st_mtime)) if metrics.is_file() else None

    return pd.DataFrame({
        "run": [os.path.relpath(path, root) for path in runs], "steps": [i["steps"] for i in info],
        "last step": pd.array([i["last_step"] for i in info], dtype="Int64"),
        "dumped steps": [i["token_steps"] for i in info], "created": [i["created"] for i in info],
        "updated": [updated(path) for path in runs],
        "health": [health_label(read_metrics_records(path)) for path in runs],
    })


class Dashboard:
    """The page over the runs under `root`; display it (or its `.widget`) in a notebook."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self.run_paths: list[Path] = []
        self.table = pd.DataFrame()
        self.shown: dict[str, Any] = {}
        self.explorer: TokenExplorer | None = None
        self.notice = widgets.HTML()
        self.notice.add_class("mm-notice")
        self.reload_button = widgets.Button(description="reload", tooltip="re-read the run store")
        self.reload_button.on_click(lambda _: self.reload())
        self.runs = widgets.HTML()
        self.comparison = widgets.Output()
        self.compared = False  # whether `comparison` shows the run store as last read
        self.tabs = widgets.Tab()
        self.tabs.observe(lambda change: self._on_tab(change["new"]), names="selected_index")
        header = widgets.HTML(f"<b>Runs under {html.escape(os.fspath(self.root))}</b>")
        self.widget = widgets.VBox([widgets.HBox([header, self.reload_button]), self.notice, self.tabs])
        self.reload()

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        return self.widget._repr_mimebundle_(**kwargs)

    def reload(self) -> None:
        """Re-read the run store: the run list, the explorer (same run, step and sample where they still exist)
        and the comparison, which is drawn (seconds of matplotlib) only while its tab is open: now if it is, else
        when it is next opened."""
        self.run_paths = find_runs(self.root) if self.root.is_dir() else []
        self.notice.value = root_notice(self.root, self.run_paths)
        self.tabs.layout.display = None if self.run_paths else "none"
        self.compared, self.shown = False, {}
        self.comparison.clear_output()
        if not self.run_paths:
            self.table = pd.DataFrame()
            return
        self.table = run_table(self.root, self.run_paths)
        self.runs.value = table_style(self.table) + self.table.astype(object).fillna("–").to_html(
            index=False, classes="mm-runs", border=0)
        self.explorer = self._reopened_explorer()
        selected = self.tabs.selected_index
        self.tabs.children = [self.runs, self.explorer.widget, self.comparison]
        self.tabs.titles = TABS
        self.tabs.selected_index = 0 if selected is None else selected  # opens on the runs, never on no tab
        self._on_tab(self.tabs.selected_index)

    def _on_tab(self, index: int | None) -> None:
        if index == COMPARE_TAB and not self.compared and self.run_paths:
            self._draw_comparison()

    def _reopened_explorer(self) -> TokenExplorer:
        """A fresh explorer (it reads the run store when built) on the run shown before, else the newest run with
        token dumps, at the step and sample shown before where that run still has them."""
        old = self.explorer
        dumped = [path for path, steps in zip(self.run_paths, self.table["dumped steps"], strict=True) if steps]
        run = old.run_dir if old is not None and old.run_dir in self.run_paths else (dumped or self.run_paths)[-1]
        explorer = TokenExplorer(run, root=self.root)
        if old is not None and old.current_step in explorer.steps:
            explorer.select(step=old.current_step)
            if old.current_sample in explorer.samples:
                explorer.select(sample=old.current_sample)
        return explorer

    def _draw_comparison(self) -> None:
        """The comparison of the runs that have logged a step; the others are named in a note."""
        logged = self.table["last step"].notna().tolist()
        stepped = [path for path, ok in zip(self.run_paths, logged, strict=True) if ok]
        waiting = [run for run, ok in zip(self.table["run"], logged, strict=True) if not ok]
        display = ipython_display()
        self.compared = True
        with self.comparison:  # shown while matplotlib draws; replaced by the first figure or table
            display(widgets.HTML(f"<i>Drawing the comparison of {len(stepped)} run(s)…</i>"))
        self.comparison.clear_output(wait=True)
        with self.comparison:
            if waiting:
                display(widgets.HTML(f"<i>No step logged yet (not compared): {html.escape(', '.join(waiting))}</i>"))
            self.shown = show_comparison([os.fspath(p) for p in stepped], display=display) if stepped else {}


def open_dashboard(params: DashboardParams) -> Dashboard:
    """The dashboard a notebook's checked parameters ask for."""
    return Dashboard(params.root)
