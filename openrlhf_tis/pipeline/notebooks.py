"""`python -m openrlhf_tis.pipeline.notebooks`: (re)write the project's notebooks from code.

The parameters cell of each notebook is generated from its parameters class (params.py ParamObject), so the
notebook, the checks and the sweep can never disagree on a name or a default; a test fails when a committed
notebook differs from what this writes. A class sits beside the code the notebook drives, reached here by a real
import, and the notebook's check cell imports that same class. Notebooks hold no logic beyond one call per cell.
"""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from openrlhf_tis.params import ParamObject
from openrlhf_tis.pipeline.dashboard_app import DashboardParams
from openrlhf_tis.pipeline.execute import NOTEBOOKS
from openrlhf_tis.pipeline.report import CompareParams
from openrlhf_tis.pipeline.sweep import SweepParams
from openrlhf_tis.pipeline.train_params import TrainParams
from openrlhf_tis.viz.explorer import ExplorerParams

# A class in the kernel's globals is never taken for a parameter.
_CHECK = "from {module} import {cls}\n\nparams = {cls}.from_notebook(globals(), {name!r})"


def parameters_cell(params: type[ParamObject]):
    """The papermill `parameters` cell: one assignment per parameter with its help as a comment."""
    defaults = params().values()
    lines = [f"{name} = {defaults[name]!r}  # {p.help}" for name, p in params.spec().items()]
    return new_code_cell("\n".join(lines), metadata={"tags": ["parameters"]})


def _notebook(name: str, params: type[ParamObject], intro: str, body: list[str]) -> nbformat.NotebookNode:
    """Notebook `name` whose parameters are `params`."""
    check = _CHECK.format(module=params.__module__, cls=params.__name__, name=name)
    cells = [new_markdown_cell(intro), parameters_cell(params), new_code_cell(check)]
    cells += [new_code_cell(src) for src in body]
    nb = new_notebook(cells=cells, metadata={
        "kernelspec": {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"},
        "language_info": {"name": "python"},
    })
    for i, cell in enumerate(nb.cells):  # stable ids: regenerating gives byte-identical files
        cell["id"] = f"{name}-{i}"
    return nb


NOTEBOOK_SOURCES = {
    "train": lambda: _notebook(
        "train", TrainParams,
        "# Train one run\n"
        "Runs `python -m openrlhf_tis.cli.train_ppo_ray` in a subprocess (Ray and vLLM never live in this kernel;\n"
        "`RAY_ADDRESS` in the environment sends the job to a cluster), shows the curves as steps land in\n"
        "`metrics.jsonl`, then the final plots. Set parameters below or with `papermill -p NAME VALUE`.\n"
        "The full training log is `<run_dir>/train.log`.",
        [
            "from openrlhf_tis.pipeline.live import LiveCurves\n"
            "from openrlhf_tis.pipeline.train import run_training\n\n"
            "title = f\"{params.correction} / {params.rollout_precision}\"\n"
            "with LiveCurves(params.steps, title=title) as live:\n"
            "    run_dir = run_training(params, on_progress=live)",
            "from openrlhf_tis.pipeline.report import show_run\n\n"
            "shown = show_run(run_dir)",
        ],
    ),
    "compare": lambda: _notebook(
        "compare", CompareParams,
        "# Compare runs\n"
        "Runs that differ only by seed are one setting: the flags that differ between settings, one curve per\n"
        "setting (mean over seeds, band: 95% t-interval), held-out gains with 95% intervals (the kept policy\n"
        "first, the rollout engine's score second), the headline (gain against measured k3 KL, one line per\n"
        "correction) and its markdown table, the seed-averaged final table; then the per-run detail: flags,\n"
        "overlaid curves, final table, mismatch by rollout probability (does the gap grow as p → 0?).",
        [
            "from IPython.display import Markdown, display\n"
            "from openrlhf_tis.pipeline.report import show_comparison\n\n"
            "display(Markdown(f\"## {params.title}\"))\n"
            "shown = show_comparison(params.runs, params.failures)",
        ],
    ),
    "sweep": lambda: _notebook(
        "sweep", SweepParams,
        "# Sweep\n"
        "Executes train.ipynb once per grid cell with papermill (cells already complete are skipped, a failed\n"
        "cell is recorded and the others go on), then compare.ipynb over all cells, exported to HTML.\n"
        "The same as `openrlhf-tis-sweep GRID OUT_DIR`.",
        [
            "from openrlhf_tis.pipeline.sweep import results_table, run_sweep\n\n"
            "result = run_sweep(params.grid, params.out_dir)\n"
            "print('report:', result.html)\n"
            "results_table(result)",
        ],
    ),
    "token_explorer": lambda: _notebook(
        "token_explorer", ExplorerParams,
        "# Token explorer\n"
        "Which tokens the trainer (π_θ) and vLLM (μ) disagree on: pick a run, a dumped step and a sample; each token\n"
        "is coloured by log π_θ − log μ (hover for μ, π_old, π_θ, the IS weights and the mask reason). Filter by\n"
        "masked / truncated / vetoed tokens and rollout probability; choose a worst token to jump to its sample.\n"
        "Runs need per-token dumps (`--logger.token_dump_steps N`). Set parameters below or with "
        "`papermill -p NAME VALUE`.",
        ["from openrlhf_tis.viz.explorer import open_explorer\n\nexplorer = open_explorer(params)\nexplorer"],
    ),
    "dashboard": lambda: _notebook(
        "dashboard", DashboardParams,
        "# Dashboard\n"
        "The runs in the folder named below, the token explorer and the run comparison; **reload** re-reads the run\n"
        "store (runs in progress included). Served as a web app by `openrlhf-tis-dashboard RUNS_ROOT`.",
        ["from openrlhf_tis.pipeline.dashboard_app import open_dashboard\n\ndashboard = open_dashboard(params)\n"
         "dashboard"],
    ),
}


def write_notebooks(directory: Path = NOTEBOOKS) -> list[Path]:
    """Write every generated notebook into `directory`; returns the paths."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, build in NOTEBOOK_SOURCES.items():
        path = directory / f"{name}.ipynb"
        nbformat.write(build(), path)
        paths.append(path)
    return paths


if __name__ == "__main__":
    for written in write_notebooks(Path(sys.argv[1]) if len(sys.argv) > 1 else NOTEBOOKS):
        print(written)
