"""The notebooks executed by papermill for real: a 2-cell sweep (one cell made to fail) runs train.ipynb
through the real training CLI (Ray + DeepSpeed + vLLM, tiny model, 2 steps), then compare.ipynb into a
self-contained HTML report; the sweep notebook re-runs it and skips the finished cell."""

from __future__ import annotations

import json
import re

import nbformat
import pytest

from openrlhf_tis.pipeline.execute import execute
from openrlhf_tis.pipeline.sweep import run_sweep
from openrlhf_tis.runs import load_metrics

pytestmark = pytest.mark.e2e
# Refused by the training CLI when it reads its files, which the sweep's grid check (flag values only) cannot: the
# cell fails inside the notebook.
FAILING = ["--eval.dataset", "no_such_eval.jsonl"]


@pytest.fixture(scope="module")
def sweep(tiny_model_dir, tmp_path_factory):
    work = tmp_path_factory.mktemp("sweep")
    grid = work / "grid.toml"
    grid.write_text(f'[base]\nmodel = "{tiny_model_dir}"\nsteps = 2\nrefresh_seconds = 0.5\n'
                    f'[grid]\nextra_args = [[], {json.dumps(FAILING)}]\n')
    return grid, work / "out", run_sweep(grid, work / "out", title="two cells")


def _outputs(notebook):
    nb = nbformat.read(notebook, as_version=4)
    return [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]


def test_the_good_cell_trained_and_its_notebook_shows_the_curves(sweep):
    _, _, result = sweep
    good = result.results[0]
    assert good.status == "complete" and good.error is None
    assert list(load_metrics(good.run_dir)["step"]) == [1, 2]
    assert "train_ppo_ray" in (good.run_dir / "train.log").read_text()
    images = [o for o in _outputs(good.notebook) if "image/png" in o.get("data", {})]
    assert len(images) == 2  # the final curves and the bucket plot: the live curves gave way to them
    assert any("steps trained; the curves are drawn below" in o.get("data", {}).get("text/html", "")
               for o in _outputs(good.notebook))


def test_the_failed_cell_is_recorded_with_its_papermill_error_and_the_cause(sweep):
    _, out, result = sweep
    bad = result.results[1]
    assert bad.status == "failed"
    assert re.match(r"cell \d+: TrainingFailed: training exited with code 2: .*--eval\.dataset", bad.error)
    status = json.loads((bad.notebook.parent / "status.json").read_text())
    assert status["status"] == "failed" and status["params"]["extra_args"] == FAILING


def test_the_report_is_self_contained_and_names_the_failure(sweep):
    _, out, result = sweep
    html = result.html.read_text()
    assert result.html == out / "report.html"
    assert "--eval.dataset" in html and "TrainingFailed" in html
    assert html.count("data:image/png;base64,") >= 2  # overlaid curves and mismatch by bucket, embedded
    assert not re.search(r"src=\"https?://|import\(\s*\"https?://", html), "the report would need the network"


def test_rerunning_the_sweep_from_its_notebook_skips_the_finished_cell(sweep, tmp_path):
    grid, out, first = sweep
    executed = execute("sweep", tmp_path / "sweep.ipynb", {"grid": str(grid), "out_dir": str(out)})
    text = json.dumps([o.get("data", {}).get("text/plain", "") for o in _outputs(executed)])
    assert "skipped" in text and "failed" in text and "complete" not in text
    assert list(load_metrics(first.results[0].run_dir)["step"]) == [1, 2]  # the finished run is untouched


def test_an_unknown_parameter_fails_in_the_check_cell_listing_what_is_accepted(tmp_path):
    import papermill

    with pytest.raises(papermill.PapermillExecutionError) as err:
        execute("train", tmp_path / "bad.ipynb", {"stpes": 3, "run_dir": str(tmp_path / "run")})
    assert err.value.ename == "ParameterError" and "unknown parameter 'stpes'" in err.value.evalue
    assert "steps = 2" in err.value.evalue
    nb = nbformat.read(tmp_path / "bad.ipynb", as_version=4)
    failed = [c for c in nb.cells if any(o.output_type == "error" for o in c.get("outputs", []))]
    assert len(failed) == 1 and "TrainParams.from_notebook" in failed[0].source  # the cell after the parameters
    assert not (tmp_path / "run").exists()  # nothing started


def test_the_token_explorer_opens_the_trained_run(sweep, tmp_path):
    """The explorer notebook runs on a real run's dumps, and the explorer shows that run's tokens."""
    from openrlhf_tis.runs import query_tokens
    from openrlhf_tis.viz.explorer import TokenExplorer

    run_dir = sweep[2].results[0].run_dir
    executed = execute("token_explorer", tmp_path / "explorer.ipynb", {"run_dir": str(run_dir)})
    assert not [o for o in _outputs(executed) if o.output_type == "error"]
    explorer = TokenExplorer(run_dir)
    step, sample = explorer.step.value, explorer.sample.value
    rows = query_tokens(run_dir, steps=(step, step), samples=[sample])
    assert step == 2 and len(rows) and explorer.response.value.count('class="tok') == len(rows)
