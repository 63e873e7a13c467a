"""Executing the project's notebooks with papermill and exporting them to self-contained HTML.

Parameters are checked against the notebook's spec before papermill starts a kernel, so a typo costs
nothing; the notebook checks them again itself for people who call papermill directly.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any

# Package data (setup.py), so an installed package finds them wherever it runs; the repository's top-level
# `notebooks` is a link to this directory for people who open them with Jupyter.
NOTEBOOKS = Path(str(resources.files("openrlhf_tis") / "notebooks"))
KERNEL = "python3"  # ipykernel's own spec: the interpreter that runs papermill, i.e. the project's venv
# The kernel listens on loopback TCP and warns about it at every start, on the console of whoever runs a notebook
# (the main job's, among others); errors still show.
KERNEL_ARGS = ["--IPKernelApp.log_level=ERROR"]
# How long a kernel may take to answer after its start. papermill's 60 s default is a readiness wait that a loaded
# 2-core machine (a test suite, a run beside it) can miss: the kernel imports numpy, torch's helpers and ipywidgets
# before it answers. Like the longer agent window Ray gets (cli/ray_cluster.RAY_START_ENV), a generous bound, not
# a hang: a kernel that never starts still fails, naming the notebook.
KERNEL_START_S = 300
# How long a cell's outputs may trail its reply: past nbclient's 4 s it stops waiting for them and goes on without a
# word, which its own help warns is too short on slow CI systems (a suspect, not a proven cause, for a dashboard page
# once rendered without its output under load: docs/measurements.md, 2026-12-06, third sitting).
IOPUB_S = 60


def notebook_path(name: str) -> Path:
    """A notebook shipped with the package, by name ('train', 'compare', ...)."""
    path = NOTEBOOKS / f"{name}.ipynb"
    if not path.is_file():
        raise FileNotFoundError(f"no notebook {path}")
    return path


def execute(name: str, output: str | os.PathLike, parameters: Mapping[str, Any], cwd: str | os.PathLike | None = None,
            progress: bool = False) -> Path:
    """Run notebook `name` with `parameters` into `output` (the executed copy, outputs kept even on failure).

    Raises papermill's PapermillExecutionError (cell index, exception name and value) when a cell fails. Replies
    are awaited through the repolling client (pipeline/kernel_client.py), which no consumed wake-up can hang.
    """
    import papermill

    from openrlhf_tis.pipeline.kernel_client import RepollingKernelManager

    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    papermill.execute_notebook(os.fspath(notebook_path(name)), os.fspath(output), parameters=dict(parameters),
                               kernel_name=KERNEL, cwd=os.fspath(cwd or output.parent), progress_bar=progress,
                               log_output=False, extra_arguments=KERNEL_ARGS, start_timeout=KERNEL_START_S,
                               iopub_timeout=IOPUB_S, kernel_manager_class=RepollingKernelManager)
    return output


# nbconvert's templates link scripts from CDNs (the widget manager, RequireJS, MathJax) and import
# mermaid from one on demand; a report must open with no network, and shows nothing that needs them.
_REMOTE_SCRIPT = re.compile(r"<script[^>]*\bsrc=\"https?://[^\"]*\"[^>]*>\s*</script>\s*", re.IGNORECASE)
_REMOTE_IMPORT = re.compile(r"<script[^>]*>(?:(?!</script>).)*?import\(\s*\"https?://.*?</script>\s*",
                            re.IGNORECASE | re.DOTALL)


WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def without_widget_views(nb: Any) -> Any:
    """`nb` without widget views: an output holding one keeps only its rich twin (text/html, an image), if any.

    A widget view outranks every other representation in nbconvert, but the export has no widget manager
    (a CDN script): what shows is the static twin (the token explorer's HTML rendering). A widget whose twin
    is its text/plain repr alone is dropped: that text is the widget at display time (tqdm's bar at 0%). The
    saved widget state goes too: it would make the page fetch the widget manager.
    """
    nb.metadata.pop("widgets", None)
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        for output in cell.outputs:
            data = output.get("data", {})
            if WIDGET_VIEW in data:
                del data[WIDGET_VIEW]
                if set(data) <= {"text/plain"}:
                    data.clear()
        cell.outputs = [o for o in cell.outputs if "data" not in o or o["data"]]
    return nb


def export_html(notebook: str | os.PathLike, html: str | os.PathLike | None = None, hide_code: bool = True) -> Path:
    """Write `notebook` as one HTML file: images embedded, no remote script, code cells hidden by default."""
    import nbformat
    from nbconvert import HTMLExporter

    notebook = Path(notebook)
    html = Path(html) if html is not None else notebook.with_suffix(".html")
    exporter = HTMLExporter(template_name="lab", embed_images=True, exclude_input=hide_code,
                            exclude_input_prompt=True, exclude_output_prompt=True)
    body, _ = exporter.from_notebook_node(without_widget_views(nbformat.read(notebook, as_version=4)))
    body = _REMOTE_IMPORT.sub("", _REMOTE_SCRIPT.sub("", body))
    from openrlhf_tis.runs.layout import atomic_write

    atomic_write(html, body.encode())
    return html
