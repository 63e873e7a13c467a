"""The mismatch study: its grid is the main job's recipe over precision x correction x seed, and its table
averages each (precision, correction) over seeds."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from openrlhf_tis.pipeline import study
from openrlhf_tis.pipeline.main_job import job_params
from openrlhf_tis.pipeline.sweep import Cell, CellResult, SweepResult, load_grid
from openrlhf_tis.runs.store import RunWriter


def test_the_grid_is_the_main_jobs_recipe_over_the_studys_axes(tmp_path):
    grid = study.study_grid(tmp_path, "tiny", baselines=False, seeds=(1, 2), steps=None)
    main = job_params(tmp_path / "task", "tiny")
    assert grid["base"] == main  # the int8 + tis cells are the main job under other seeds
    reference, int8 = grid["grid"]
    assert reference == {"rollout_precision": [main["train_dtype"]], "correction": ["off"], "seed": [1, 2]}
    assert int8 == {"rollout_precision": ["int8"], "correction": ["off", "tis", "token_mis"], "seed": [1, 2]}
    wider = study.study_grid(tmp_path, "tiny", baselines=True, seeds=(3,), steps=5,
                             reference_corrections=("off", "tis"))
    assert wider["grid"][1]["correction"][-2:] == ["ppo_is", "vanilla_is"] and wider["base"]["steps"] == 5
    assert wider["grid"][0]["correction"] == ["off", "tis"]


def test_the_grid_file_the_study_writes_is_one_the_sweep_reads(tmp_path):
    grid = tmp_path / "g.json"
    grid.write_text(json.dumps(study.study_grid(tmp_path, "tiny", baselines=False, seeds=(1, 2), steps=3)))
    cells = [(c.params["rollout_precision"], c.params["correction"], c.params["seed"]) for c in load_grid(grid)]
    reference = job_params(tmp_path / "task", "tiny")["train_dtype"]
    assert cells == [(reference, "off", 1), (reference, "off", 2), *[("int8", c, s) for c in
                     ("off", "tis", "token_mis") for s in (1, 2)]]


def _run(path: Path, rewards: list[float], held: tuple[float, float], k3: float) -> Path:
    writer = RunWriter(path)
    for step, reward in enumerate(rewards, start=1):
        line = {"reward": reward, "mismatch/k3_kl": k3, "mismatch/abs_dp_max": 10 * k3}
        if step == 1:
            line["eval_start/default_pass1"] = held[0]
        if step == len(rewards):
            line["eval/default_pass1"] = held[1]
        writer.append_metrics(step, line)
    return path


def test_the_table_averages_seeds_and_leaves_failed_cells_out(tmp_path):
    results = []
    for precision, seed, held, k3 in (("int8", 1, (0.2, 0.4), 0.04), ("int8", 2, (0.3, 0.6), 0.06),
                                      ("fp32", 1, (0.25, 0.45), 1e-6)):
        params = {"rollout_precision": precision, "correction": "tis", "seed": seed}
        run = _run(tmp_path / f"{precision}{seed}", [0.1] * 10, held, k3)
        results.append(CellResult(Cell(f"{precision},{seed}", params), "complete", run, run / "x.ipynb"))
    failed = {"rollout_precision": "int8", "correction": "off", "seed": 1}
    results.append(CellResult(Cell("failed", failed), "failed", tmp_path / "none", tmp_path / "none.ipynb", "boom"))
    table = study.seed_table(SweepResult(results))
    assert list(table.index) == [("int8", "tis"), ("fp32", "tis")]
    int8 = table.loc[("int8", "tis")]
    assert int8["seeds"] == 2
    assert int8["held-out before"] == pytest.approx(0.25) and int8["held-out after"] == pytest.approx(0.5)
    assert int8["k3 KL(μ‖π_old)"] == pytest.approx(0.05) and int8["max |Δp|"] == pytest.approx(0.5)
    assert table.loc[("fp32", "tis"), "seeds"] == 1
    text = study.markdown(table)
    assert text.splitlines()[0].count(" | ") == len(table.columns) + 1  # "max |Δp|" is escaped, not a column
    assert text.splitlines()[2].startswith("| int8 | tis | 2 | ")
    assert "0.5" in text.splitlines()[2] and not math.isnan(int8["held-out after"])
    assert study.markdown(study.seed_table(SweepResult([]))) == "(no cell completed)"


def test_a_bad_step_count_is_refused_before_anything_runs(tmp_path, capsys):
    with pytest.raises(SystemExit) as err:
        study.main(["--out", str(tmp_path / "s"), "--steps", "0"])
    assert err.value.code == 2 and "--steps" in capsys.readouterr().err
    assert not (tmp_path / "s").exists()
