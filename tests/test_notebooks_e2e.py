"""The notebooks executed by papermill for real: a 2-cell sweep (one cell made to fail) runs train.ipynb
through the real training CLI (Ray + DeepSpeed + vLLM, tiny model, 8 steps), then compare.ipynb into a
self-contained HTML report; the sweep notebook re-runs it and skips the finished cell.

The sweep's first run is stopped by Ctrl-C in its first cell: it stops the training before it exits,
says so in one line, and the next run finishes the cell afresh, keeping the interrupted attempt."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time

import nbformat
import pytest
from _support import processes_naming, read_steps, sigint_as_in_a_shell, wait_for

from openrlhf_tis.cli.run_dir import lock_owner
from openrlhf_tis.pipeline.execute import execute
from openrlhf_tis.pipeline.sweep import STATUS_FILE, load_grid, run_sweep
from openrlhf_tis.runs import load_metrics

pytestmark = pytest.mark.e2e
# Refused by the training CLI when it reads its files, which the sweep's grid check (flag values only) cannot: the
# cell fails inside the notebook.
FAILING = ["--eval.dataset", "no_such_eval.jsonl"]
TITLE = "two cells"
# A tiny-model step takes ~0.7 s on an idle machine: enough steps that the Ctrl-C, sent once step 1 is logged, lands
# before the last one even when the test's own polling is starved by a loaded machine (8 steps were not: seen once,
# the cell finished before the signal under a load of 16 on 2 cores).
STEPS = 20


def _ctrl_c_in_first_cell(grid, out) -> dict:
    """Run the sweep's command, send SIGINT to its process group (what Ctrl-C does) once its first cell logged a
    step, and record what it left: its exit code and console, the cell's steps and who still names the cell."""
    cell_dir = out / "cells" / load_grid(grid)[0].slug
    command = [sys.executable, "-m", "openrlhf_tis.pipeline.sweep", str(grid), str(out), "--title", TITLE]
    log_path = out.parent / "interrupted.log"
    with open(log_path, "w") as log:
        sweep = subprocess.Popen(command, cwd=out.parent, stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True, preexec_fn=sigint_as_in_a_shell)
        assert wait_for(lambda: len(read_steps(cell_dir / "run")) >= 1, sweep), log_path.read_text()[-6000:]
        os.killpg(sweep.pid, signal.SIGINT)
        start = time.monotonic()
        code = sweep.wait(timeout=180)
    seen = {"code": code, "stop_seconds": time.monotonic() - start, "console": log_path.read_text(),
            "cell_dir": cell_dir, "steps": len(read_steps(cell_dir / "run")),
            "status_written": (cell_dir / STATUS_FILE).exists(), "lock": lock_owner(cell_dir / "run"),
            "naming": processes_naming(cell_dir)}
    time.sleep(5)  # several of the tiny model's steps
    seen["steps_later"] = len(read_steps(cell_dir / "run"))
    return seen


@pytest.fixture(scope="module")
def sweep(tiny_model_dir, tmp_path_factory):
    """The sweep stopped by Ctrl-C in its first cell, then run again (in process) to the end."""
    work = tmp_path_factory.mktemp("sweep")
    grid = work / "grid.toml"
    grid.write_text(f'[base]\nmodel = "{tiny_model_dir}"\nsteps = {STEPS}\nrefresh_seconds = 0.5\n'
                    f'[grid]\nextra_args = [[], {json.dumps(FAILING)}]\n')
    (out := work / "out").mkdir()
    interrupted = _ctrl_c_in_first_cell(grid, out)
    return grid, out, run_sweep(grid, out, title=TITLE), interrupted


def _outputs(notebook):
    nb = nbformat.read(notebook, as_version=4)
    return [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]


def test_the_good_cell_trained_and_its_notebook_shows_the_curves(sweep):
    _, _, result, _ = sweep
    good = result.results[0]
    assert good.status == "complete" and good.error is None
    assert list(load_metrics(good.run_dir)["step"]) == list(range(1, STEPS + 1))
    assert "train_ppo_ray" in (good.run_dir / "train.log").read_text()
    images = [o for o in _outputs(good.notebook) if "image/png" in o.get("data", {})]
    assert len(images) == 2  # the final curves and the bucket plot: the live curves gave way to them
    assert any("steps trained; the curves are drawn below" in o.get("data", {}).get("text/html", "")
               for o in _outputs(good.notebook))


def test_ctrl_c_stops_the_cells_training_before_the_sweep_exits_and_says_so_in_one_line(sweep):
    grid, out, _, seen = sweep
    cell_dir, interrupted_at = seen["cell_dir"], seen["steps"]
    assert 1 <= interrupted_at < STEPS and not seen["status_written"]
    # The training stopped with the sweep, not after it: its directory is free, no process names it, no step follows.
    assert seen["lock"] is None and seen["naming"] == {} and seen["steps_later"] == interrupted_at
    console = seen["console"]
    assert seen["code"] == 130 and "Traceback" not in console and "Task exception" not in console, console[-6000:]
    line = console.strip().splitlines()[-1]
    cell = load_grid(grid)[0].name
    assert line.startswith(f"openrlhf-tis-sweep: interrupted in cell {cell} (1 of 2; 0 done before it): stopped "
                           "openrlhf_tis.cli.train_ppo_ray (pid "), line
    again = shlex.join(["openrlhf-tis-sweep", str(grid), str(out), "--title", TITLE])
    logged = "step 1" if interrupted_at == 1 else f"steps 1-{interrupted_at}"
    assert (f"; kept: {logged} of {STEPS} in {cell_dir / 'run' / 'metrics.jsonl'}, no checkpoint; {again} goes on "
            "(done cells are skipped, this one starts afresh, this attempt kept as run.attempt1)") in line, line
    print(f"Ctrl-C to exit: {seen['stop_seconds']:.1f} s")


def test_the_next_run_finishes_the_interrupted_cell_afresh_and_keeps_the_attempt(sweep):
    _, out, result, seen = sweep
    good = result.results[0]
    assert good.run_dir == seen["cell_dir"] / "run"
    assert len(read_steps(seen["cell_dir"] / "run.attempt1")) == seen["steps"]  # the interrupted attempt is kept
    assert good.status == "complete" and (out / "report.html").is_file()


def test_the_failed_cell_is_recorded_with_its_papermill_error_and_the_cause(sweep):
    _, out, result, _ = sweep
    bad = result.results[1]
    assert bad.status == "failed"
    assert re.match(r"cell \d+: TrainingFailed: training exited with code 2: .*--eval\.dataset", bad.error)
    status = json.loads((bad.notebook.parent / "status.json").read_text())
    assert status["status"] == "failed" and status["params"]["extra_args"] == FAILING


def test_the_report_is_self_contained_and_names_the_failure(sweep):
    _, out, result, _ = sweep
    html = result.html.read_text()
    assert result.html == out / "report.html"
    assert "--eval.dataset" in html and "TrainingFailed" in html
    assert html.count("data:image/png;base64,") >= 2  # overlaid curves and mismatch by bucket, embedded
    assert not re.search(r"src=\"https?://|import\(\s*\"https?://", html), "the report would need the network"


def test_rerunning_the_sweep_from_its_notebook_skips_the_finished_cell(sweep, tmp_path):
    grid, out, first, _ = sweep
    executed = execute("sweep", tmp_path / "sweep.ipynb", {"grid": str(grid), "out_dir": str(out)})
    text = json.dumps([o.get("data", {}).get("text/plain", "") for o in _outputs(executed)])
    assert "skipped" in text and "failed" in text and "complete" not in text
    assert list(load_metrics(first.results[0].run_dir)["step"]) == list(range(1, STEPS + 1))  # untouched


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

    run_dir = sweep[2].results[0].run_dir  # the interrupted cell's second attempt
    executed = execute("token_explorer", tmp_path / "explorer.ipynb", {"run_dir": str(run_dir)})
    assert not [o for o in _outputs(executed) if o.output_type == "error"]
    explorer = TokenExplorer(run_dir)
    step, sample = explorer.step.value, explorer.sample.value
    rows = query_tokens(run_dir, steps=(step, step), samples=[sample])
    assert step == STEPS and len(rows) and explorer.response.value.count('class="tok') == len(rows)
