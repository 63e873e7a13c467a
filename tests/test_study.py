"""The dose-response study: its grid is the main job's recipe over dose x correction x seed, a bad dose is
refused before anything runs, --quick fits its hour, and the tables and compute time come from the cells."""

from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path

import pytest

from openrlhf_tis.params import ParameterError
from openrlhf_tis.pipeline import main_job
from openrlhf_tis.pipeline.main_job import job_params
from openrlhf_tis.pipeline.sweep import Cell, CellResult, SweepResult, load_grid
from openrlhf_tis.pipeline.train_params import TrainParams
from openrlhf_tis.runs.store import RunWriter
from openrlhf_tis.study import dose_response as study

ALL_BITS = ("auto", "8", "7", "6", "5", "4")


def test_the_grid_is_the_main_jobs_recipe_over_dose_correction_and_seed(tmp_path):
    cells = {"none": ("off", "tis"), "int8": ("off",), "w4a8": ("off", "seq_mis")}
    grid = study.study_grid(tmp_path, "tiny", cells=cells, seeds=(1, 2), steps=None)
    main = job_params(tmp_path / "task", "tiny")
    assert grid["base"] == main  # the int8 + tis cells are the main job under other seeds
    trainer = main["train_dtype"]
    assert grid["grid"] == [table for seed in (1, 2) for table in (  # seed-major: a sitting stopped part-way
        {"rollout_precision": [trainer], "correction": ["off", "tis"], "seed": [seed]},  # leaves whole seeds
        {"rollout_precision": ["int8"], "correction": ["off"], "seed": [seed]},
        {"rollout_precision": ["int8"], "int8_weight_bits": ["4"], "correction": ["off", "seq_mis"], "seed": [seed]},
    )]
    assert study.cell_count(grid) == 10
    assert study.study_grid(tmp_path, "tiny", cells=cells, seeds=(3,), steps=5)["base"]["steps"] == 5
    stale = study.study_grid(tmp_path, "tiny", cells={"int8": ("off",)}, seeds=(1, 2), steps=None, queues=(0, 1, 2))
    assert stale["grid"] == [{"rollout_precision": ["int8"], "async_queue": [0, 1, 2], "correction": ["off"],
                              "seed": [seed]} for seed in (1, 2)]
    assert study.cell_count(stale) == 6
    (tmp_path / "stale.json").write_text(json.dumps(stale))
    assert [(c.params["seed"], c.params["async_queue"]) for c in load_grid(tmp_path / "stale.json")] == [
        (1, 0), (1, 1), (1, 2), (2, 0), (2, 1), (2, 2)]


def test_the_grid_file_is_one_the_sweep_reads_and_each_cell_asks_for_its_weight_grid(tmp_path):
    grid = tmp_path / "g.json"
    cells = {"none": ("off",), "w6a8": ("tis",)}
    grid.write_text(json.dumps(study.study_grid(tmp_path, "tiny", cells=cells, seeds=(1, 2), steps=3)))
    loaded = load_grid(grid)
    trainer = job_params(tmp_path / "task", "tiny")["train_dtype"]
    assert [(c.params["rollout_precision"], c.params.get("int8_weight_bits"), c.params["correction"], c.params["seed"])
            for c in loaded] == [(trainer, None, "off", 1), ("int8", "6", "tis", 1), (trainer, None, "off", 2),
                                 ("int8", "6", "tis", 2)]  # seed-major
    # the earlier int8 study's cells keep their names, so a re-run reuses them
    assert loaded[0].name == f"rollout_precision={trainer},correction=off,seed=1"
    def argv(params):
        return TrainParams.checked({**params, "run_dir": "r"}).argv(Path("m"), Path("p"), Path("r"))

    w6a8 = argv(loaded[1].params)
    assert w6a8[w6a8.index("--vllm.int8_weight_bits") + 1] == "6"
    assert "--vllm.int8_weight_bits" not in argv(loaded[0].params)  # auto: the CLI's own default


def test_doses_are_checked_against_the_build_and_the_machine():
    study.check_doses(list(study.DOSES), ALL_BITS, fp8_runs=True)
    with pytest.raises(ParameterError, match=r"--doses: unknown dose level\(s\) \['w3a8'\]"):
        study.check_doses(["none", "w3a8"], ALL_BITS, fp8_runs=True)
    with pytest.raises(ParameterError, match=r"--doses w5a8: this build's --vllm.int8_weight_bits takes only"):
        study.check_doses(["w5a8"], ("auto", "8", "7"), fp8_runs=True)
    with pytest.raises(ParameterError, match="--doses fp8: no FP8 kernel"):
        study.check_doses(["fp8"], ALL_BITS, fp8_runs=False)


def test_the_default_axis_has_fp8_only_where_bf16_is_native_and_a_kernel_runs(monkeypatch):
    monkeypatch.setattr("openrlhf_tis.rollout.quantize.WEIGHT_BITS_CHOICES", ALL_BITS)
    args = argparse.Namespace(doses=None, quick=False, corrections=None, baselines=False)
    mild_to_harsh = ["none", "int8", "w6a8", "w5a8", "w4a8"]
    for native, kernel, doses in ((False, True, mild_to_harsh), (True, False, mild_to_harsh),
                                  (True, True, ["none", "fp8", *mild_to_harsh[1:]])):
        monkeypatch.setattr(study, "native_bf16", lambda native=native: native)
        monkeypatch.setattr(study, "_fp8_runs", lambda kernel=kernel: kernel)
        cells = study.choose_cells(args)
        assert list(cells) == doses and set(cells.values()) == {study.CORRECTIONS}
    monkeypatch.setattr(study, "_fp8_runs", lambda: False)
    with pytest.raises(ParameterError, match="--doses fp8"):  # asked for by name where no kernel runs
        study.choose_cells(argparse.Namespace(doses=["fp8"], quick=False, corrections=None, baselines=False))
    quick = study.choose_cells(argparse.Namespace(doses=None, quick=True, corrections=None, baselines=True))
    assert quick == {"none": ("off", *study.BASELINES), "w4a8": ("off", "tis", *study.BASELINES)}


def test_an_unknown_dose_or_bad_step_count_is_refused_before_anything_runs(tmp_path, capsys):
    for argv, flag in ((["--doses", "none", "w3a8"], "--doses"), (["--steps", "0"], "--steps"),
                       (["--async_queues", "0", "-1"], "--async_queues"),
                       (["--corrections", "nope"], "--corrections"),
                       # regression: the dry run printed an estimate for a model that does not exist
                       (["--model", str(tmp_path / "nonexistent"), "--dry_run"],
                        f"--model {tmp_path / 'nonexistent'}: must be 'tiny', 'default', 'upcycled' or a model "
                        "directory")):
        with pytest.raises(SystemExit) as err:
            study.main(["--out", str(tmp_path / "s"), *argv])
        assert err.value.code == 2 and flag in capsys.readouterr().err
    assert not (tmp_path / "s").exists()
    with pytest.raises(SystemExit) as err:  # the main job names its --model the same way
        main_job.main(["--out", str(tmp_path / "m"), "--model", str(tmp_path / "nonexistent")])
    assert err.value.code == 2 and f"--model {tmp_path / 'nonexistent'}: must be" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()


def test_the_dry_run_checks_every_cell_as_the_sweep_would(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(study, "job_params", lambda out, model: {**job_params(out, model), "extra_args": [
        "--train.async_max_lag", "1"]})  # a flag the training CLI refuses without async training
    with pytest.raises(SystemExit) as err:
        study.main(["--out", str(tmp_path / "d"), "--model", "tiny", "--dry_run", "--doses", "none"])
    assert err.value.code == 2 and "--train.async_max_lag: applies to async training only" in capsys.readouterr().err


def test_quick_fits_an_hour_on_the_avx2_profile_and_the_dry_run_says_so(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("openrlhf_tis.rollout.quantize.WEIGHT_BITS_CHOICES", ALL_BITS)  # the W6A8..W4A8 build
    monkeypatch.setattr(study, "job_params", lambda out, model: {**job_params(out, model), "train_dtype": "fp32",
                                                                 "steps": 6})
    study.main(["--out", str(tmp_path / "q"), "--model", "tiny", "--quick", "--dry_run"])
    grid = json.loads((tmp_path / "q" / "study_grid.json").read_text())
    assert grid["base"]["steps"] == study.QUICK_STEPS and study.cell_count(grid) == 6
    assert study.estimate_seconds(grid) <= study.QUICK_BUDGET_S
    # by hand: 6 cells x (110 + 4 x 40 + 50 + 4 x 30) s
    assert study.estimate_seconds(grid) == 6 * (110 + 160 + 50 + 120)
    assert "6 cells of 4 steps, trainer fp32, seeds [1, 2]" in capsys.readouterr().err
    assert not (tmp_path / "q" / "cells").exists()  # a dry run runs nothing
    study.main(["--out", str(tmp_path / "f"), "--model", "tiny", "--dry_run", "--doses", "none", "int8", "w4a8"])
    full = json.loads((tmp_path / "f" / "study_grid.json").read_text())
    assert study.cell_count(full) == 3 * len(study.CORRECTIONS) * len(study.SEEDS)


def _run(path: Path, config: dict, held: tuple[float, float], k3: float) -> Path:
    writer = RunWriter(path, config=config, origin={})
    for step in range(1, 4):
        line = {"reward": 0.1, "mismatch/k3_kl": k3, "mismatch/abs_dp_max": 10 * k3}
        if step == 1:
            line["eval_start/default_pass1"] = held[0]
        if step == 3:
            line["eval/default_pass1"] = held[1]
        writer.append_metrics(step, line)
    return path


def _results(tmp_path):
    results = []
    for precision, bits, seed, held, k3, seconds in (("int8", "4", 1, (0.2, 0.4), 1.0, 500.0),
                                                     ("int8", "4", 2, (0.3, 0.6), 1.2, None),
                                                     ("fp32", None, 1, (0.25, 0.45), 1e-9, 400.0)):
        params = {"rollout_precision": precision, "correction": "tis", "seed": seed,
                  **({"int8_weight_bits": bits} if bits else {})}
        config = {"vllm.rollout_precision": precision, "ds.param_dtype": "fp32", "algo.correction.preset": "tis",
                  "vllm.int8_weight_bits": bits or "auto", "train.seed": seed}
        run = _run(tmp_path / f"{precision}{seed}" / "run", config, held, k3)
        results.append(CellResult(Cell(f"{precision},{seed}", params), "complete" if seconds else "skipped", run,
                                  run / "x.ipynb", seconds=seconds))
    failed = {"rollout_precision": "int8", "correction": "off", "seed": 1}
    results.append(CellResult(Cell("failed", failed), "failed", tmp_path / "none", tmp_path / "n.ipynb", "boom", 30.0))
    return SweepResult(results)


def test_the_table_averages_seeds_and_leaves_failed_cells_out(tmp_path):
    result = _results(tmp_path)
    table = study.seed_table(result)
    assert list(table.index) == [("int8", "4", "tis"), ("fp32", "auto", "tis")]
    int8 = table.loc[("int8", "4", "tis")]
    assert int8["seeds"] == 2
    assert int8["held-out before"] == pytest.approx(0.25) and int8["held-out after"] == pytest.approx(0.5)
    assert int8["k3 KL(μ‖π_old)"] == pytest.approx(1.1)
    assert int8["max |Δp|"] == pytest.approx(11.0)  # the mean of each run's largest
    text = study.markdown(table)
    assert text.splitlines()[0].count(" | ") == len(table.columns) + 2  # "max |Δp|" is escaped, not a column
    assert text.splitlines()[2].startswith("| int8 | 4 | tis | 2 | ") and not math.isnan(int8["held-out after"])
    assert study.markdown(study.seed_table(SweepResult([]))) == "(no cell completed)"
    # the headline over completed cells: no kept-policy file in these runs, so the engine's score, labelled
    headline = study.headline(result, tmp_path / "dose.png")
    assert (tmp_path / "dose.png").read_bytes().startswith(b"\x89PNG")
    assert "held-out gain (rollout engine)" in headline.splitlines()[0]
    assert "| w4a8 | tis | 2 | 1.1 | +0.250 |" in headline and "| none | tis | 1 | 1e-09 | +0.200 |" in headline
    assert study.headline(SweepResult([])) == "(no cell completed)"


def test_each_cell_keeps_every_attempts_time_so_a_later_sitting_still_counts_it(tmp_path, monkeypatch):
    from openrlhf_tis.pipeline import sweep

    clock = iter([100.0, 160.5, 200.0, 230.0, 300.0, 312.5])
    monkeypatch.setattr(sweep.time, "monotonic", lambda: next(clock))
    calls = []

    def fake_execute(name, notebook, params, cwd):
        calls.append(params["seed"])
        Path(params["run_dir"]).mkdir(parents=True, exist_ok=True)
        if params["seed"] == 2 and calls.count(2) == 1:
            raise RuntimeError("boom")

    monkeypatch.setattr(sweep, "execute_stoppable", fake_execute)
    cells = [Cell(f"seed={s}", {"seed": s}) for s in (1, 2)]
    first = [sweep.run_cell(c, tmp_path) for c in cells]
    assert [(r.status, r.seconds) for r in first] == [("complete", 60.5), ("failed", 30.0)]
    again = sweep.run_cell(cells[0], tmp_path)  # a later sitting: skipped, its time read back from status.json
    assert (again.status, again.seconds, calls) == ("skipped", 60.5, [1, 2])
    failed = tmp_path / "cells" / cells[1].slug / "status.json"
    status = json.loads(failed.read_text())
    assert status["seconds"] == 30.0 and status["error"] == "RuntimeError: boom" and status["earlier"] == []
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", status["started"])
    retried = sweep.run_cell(cells[1], tmp_path)  # the failed cell again: its first attempt's record is kept
    after = json.loads(failed.read_text())
    assert (retried.status, retried.seconds, after["status"], after["error"]) == ("complete", 12.5, "complete", None)
    assert after["earlier"] == [{"status": "failed", "error": "RuntimeError: boom", "seconds": 30.0,
                                 "started": status["started"]}]


def _status(root: Path, name: str, state: str, seconds: float, started: str | None, earlier=(), run_time=None):
    cell_dir = root / "cells" / Cell(name, {}).slug
    cell_dir.mkdir(parents=True)
    record = {"cell": name, "status": state, "params": {}, "error": None, "seconds": seconds, "earlier": list(earlier)}
    if started:
        record["started"] = started
    (cell_dir / "status.json").write_text(json.dumps(record))
    if run_time:  # a status.json from before starts were recorded: the run's config.json says when it began
        RunWriter(cell_dir / "run", config={"x": 1}, origin={"time": run_time})


def test_the_cost_counts_every_attempt_and_splits_sittings_where_the_machine_stood_idle(tmp_path):
    from openrlhf_tis.study import cost

    failed = {"status": "failed", "error": "boom", "seconds": 600.0, "started": "2026-11-26T22:00:00Z"}
    _status(tmp_path, "a", "complete", 700.0, "2026-11-27T10:00:00Z", earlier=[failed])
    _status(tmp_path, "b", "complete", 900.0, None, run_time="2026-11-26T22:10:30Z")  # 30 s after a's failure
    _status(tmp_path, "c", "failed", 300.0, "2026-11-27T10:41:39Z")  # 29 min 59 s after a ended at 10:11:40
    _status(tmp_path, "d", "complete", 60.0, None)  # no start anywhere: counted, in no sitting
    found = cost.attempts(tmp_path)
    assert [(a.cell, a.status, a.seconds) for a in found] == [
        ("a", "failed", 600.0), ("b", "complete", 900.0), ("a", "complete", 700.0), ("c", "failed", 300.0),
        ("d", "complete", 60.0)]
    groups = cost.sittings([a for a in found if a.started])
    assert [[a.cell for a in g] for g in groups] == [["a", "b"], ["a", "c"]]
    assert [[a.cell for a in g] for g in cost.sittings([a for a in found if a.started], gap_s=1798)] == [
        ["a", "b"], ["a"], ["c"]]
    # by hand: 600 + 900 + 700 + 300 + 60 = 2560 s; failed 900 s; finished cells 900, 700, 60: mean 553.3 s
    assert cost.cost_summary(found) == ("43 min of cell time: 5 attempts at 4 cells (2 failed, 15 min) in 2 sittings; "
                                        "9.2 min a finished cell")
    table = cost.cost_markdown(found)
    assert "| 1 | 2026-11-26 22:00 | 2026-11-26 22:25 | 2 | 1 | 1 | 25 min | 15.0 |" in table
    assert "| 2 | 2026-11-27 10:00 | 2026-11-27 10:46 | 2 | 1 | 1 | 17 min | 11.7 |" in table
    assert "| (no start recorded) | | | 1 | 1 | 0 | 1 min | 1.0 |" in table
    assert "| a | 2 | complete | 21.7 | 2026-11-27 10:00 |" in table and "| d | 1 | complete | 1.0 | – |" in table
    assert cost.cost_markdown([]) == "(no timed attempt)"


def test_a_finished_cell_skips_wherever_the_checkout_lies(tmp_path, monkeypatch):
    """status.json records paths relative to the study root, so a study committed under results/study/ resumes
    from any clone; a status from before (absolute paths) still skips under the root it was written in."""
    import shutil

    from openrlhf_tis.pipeline import sweep

    calls = []
    monkeypatch.setattr(sweep, "execute_stoppable",
                        lambda name, notebook, params, cwd: calls.append(params["run_dir"]))

    def cell(checkout: Path, seed: int = 1) -> tuple[Cell, Path]:  # as study_grid gives it: task under the root,
        root = checkout / "results" / "study" / "x"                  # the reward inside the package
        params = {"seed": seed, "prompts": str(root / "task" / "train.jsonl"), "correction": "tis",
                  "reward": str(checkout / "openrlhf_tis" / "demo" / "task_reward.py"),
                  "extra_args": ["--vllm.int8_calibration", str(root / "cal.safetensors"), "--x", "1"]}
        return Cell(f"seed={seed}", params), root

    first, root_a = cell(tmp_path / "a")
    assert sweep.run_cell(first, root_a).status == "complete"
    status = json.loads((root_a / "cells" / first.slug / "status.json").read_text())
    assert status["params"] == {"seed": 1, "prompts": "task/train.jsonl", "correction": "tis",
                                "reward": "../../../openrlhf_tis/demo/task_reward.py",
                                "extra_args": ["--vllm.int8_calibration", "cal.safetensors", "--x", "1"]}

    shutil.move(tmp_path / "a", tmp_path / "b")  # a fresh clone elsewhere: the same cell, other absolute paths
    moved, root_b = cell(tmp_path / "b")
    assert moved.params != first.params
    assert sweep.run_cell(moved, root_b).status == "skipped" and len(calls) == 1
    assert sweep.run_cell(cell(tmp_path / "b", seed=2)[0], root_b).status == "complete" and len(calls) == 2

    legacy = root_b / "cells" / moved.slug / "status.json"  # written by an older sweep: absolute paths
    legacy.write_text(json.dumps({**status, "params": moved.params}))
    assert sweep.run_cell(moved, root_b).status == "skipped" and len(calls) == 2
    changed = Cell(moved.name, {**moved.params, "prompts": str(tmp_path / "elsewhere.jsonl")})
    assert sweep.run_cell(changed, root_b).status == "complete" and len(calls) == 3


def _recorded_study(root: Path) -> None:
    """Two cells as a sitting leaves them (status.json beside each run), one failed; no grid, no notebook."""
    for name, seed, held, state in (("seed=1", 1, (0.2, 0.5), "complete"), ("seed=2", 2, (0.3, 0.4), "complete"),
                                    ("seed=3", 3, (0.0, 0.0), "failed")):
        cell = Cell(name, {"rollout_precision": "int8", "int8_weight_bits": "4", "correction": "tis", "seed": seed,
                           "train_dtype": "fp32", "prompts": "task/train.jsonl"})
        cell_dir = root / "cells" / cell.slug
        config = {"vllm.rollout_precision": "int8", "ds.param_dtype": "fp32", "algo.correction.preset": "tis",
                  "vllm.int8_weight_bits": "4", "train.seed": seed}
        if state == "complete":
            _run(cell_dir / "run", config, held, 0.5)
        cell_dir.mkdir(parents=True, exist_ok=True)
        (cell_dir / "status.json").write_text(json.dumps({"cell": name, "status": state, "params": cell.params,
                                                          "error": "boom" if state == "failed" else None,
                                                          "seconds": 100.0 * seed}))


def test_report_rebuilds_the_tables_from_the_recorded_cells_and_runs_nothing(tmp_path, monkeypatch, capsys):
    from openrlhf_tis.pipeline import sweep

    _recorded_study(tmp_path)
    executed = []
    monkeypatch.setattr(sweep, "execute_stoppable",
                        lambda name, notebook, params, cwd: executed.append((name, params)))
    monkeypatch.setattr(sweep, "export_html", lambda notebook, html: html)
    monkeypatch.setattr(study, "choose_cells", lambda args: pytest.fail("--report chose a grid"))
    with pytest.raises(SystemExit) as err:  # a failed cell is reported, as after a sitting
        study.main(["--out", str(tmp_path), "--report"])
    assert err.value.code == 1
    [(name, params)] = executed  # only the comparison notebook, over the two finished runs
    assert name == "compare"
    assert [Path(r).parent.name for r in params["runs"]] == [Cell("seed=1", {}).slug, Cell("seed=2", {}).slug]
    assert params["failures"] == {"seed=3": "boom"}
    # by hand: gains 0.3 and 0.1 (engine-scored: these runs have no kept-policy file), mean 0.2
    assert "| w4a8 | tis | 2 | 0.5 | +0.200 |" in (tmp_path / "dose_response.md").read_text()
    assert "| int8 | 4 | tis | 2 | " in (tmp_path / "study_table.md").read_text()
    assert "10 min of cell time: 3 attempts at 3 cells (1 failed, 5 min) in 0 sittings" in capsys.readouterr().out
    assert "| seed=3 | 1 | failed | 5.0 | – |" in (tmp_path / "study_cost.md").read_text()
    assert not (tmp_path / "study_grid.json").exists()
    with pytest.raises(SystemExit) as err:
        study.main(["--out", str(tmp_path / "empty"), "--report"])
    assert err.value.code == 2 and "--report: no finished cell under" in capsys.readouterr().err


def test_cells_of_another_cpu_profile_are_not_mixed_into_a_study(tmp_path, monkeypatch, capsys):
    _recorded_study(tmp_path)  # fp32 cells: made where bf16 is emulated
    monkeypatch.setattr("openrlhf_tis.rollout.quantize.WEIGHT_BITS_CHOICES", ALL_BITS)
    for dtype, refused in (("bf16", True), ("fp32", False)):
        monkeypatch.setattr(study, "job_params", lambda out, model, dtype=dtype: {**job_params(out, model),
                                                                                  "train_dtype": dtype})
        if refused:
            with pytest.raises(SystemExit) as err:
                study.main(["--out", str(tmp_path), "--model", "tiny", "--doses", "w4a8", "--dry_run"])
            message = capsys.readouterr().err
            assert err.value.code == 2 and "its cells trained in fp32 (another CPU profile)" in message
            assert "this CPU trains in bf16" in message and "--report" in message
        else:
            with pytest.raises(SystemExit):  # the recorded cells trained for 2 steps, the main job's are more
                study.main(["--out", str(tmp_path), "--model", "tiny", "--doses", "w4a8", "--dry_run"])
            assert f"--steps {job_params(tmp_path / 'task', 'tiny')['steps']}: the cells under --out {tmp_path} " \
                   "trained for 2 steps: give this horizon its own --out" in capsys.readouterr().err
            study.main(["--out", str(tmp_path), "--model", "tiny", "--doses", "w4a8", "--steps", "2", "--dry_run"])
            assert "trainer fp32" in capsys.readouterr().err


def test_a_study_run_a_part_at_a_time_reports_every_recorded_cell(tmp_path, monkeypatch):
    """A sitting that runs one cell still reports, and tabulates, the whole study; a plain sweep only its grid."""
    from openrlhf_tis.pipeline import sweep

    _recorded_study(tmp_path)  # seed=1 and seed=2 complete, seed=3 failed
    new = Cell("seed=4", {"seed": 4})
    compared = []

    def fake_execute(name, notebook, params, cwd):
        if name == "compare":
            compared.append(sorted(Path(r).parent.name for r in params["runs"]))

    monkeypatch.setattr(sweep, "load_grid", lambda grid: [new])
    monkeypatch.setattr(sweep, "execute_stoppable", fake_execute)
    monkeypatch.setattr(sweep, "export_html", lambda notebook, html: html)
    whole = sweep.run_sweep("grid", tmp_path, "t", whole_folder=True)
    assert [(r.cell.name, r.status) for r in whole.results] == [
        ("seed=1", "skipped"), ("seed=2", "skipped"), ("seed=3", "failed"), ("seed=4", "complete")]
    assert compared == [sorted(Cell(f"seed={s}", {}).slug for s in (1, 2, 4))]
    assert [(r.cell.name, r.status) for r in sweep.run_sweep("grid", tmp_path, "t").results] == [("seed=4", "skipped")]


def test_a_stop_file_ends_the_sweep_after_the_cell_in_flight_and_the_same_command_goes_on(tmp_path, monkeypatch,
                                                                                          capsys):
    from openrlhf_tis.pipeline import sweep

    cells = [Cell(f"seed={s}", {"seed": s}) for s in (1, 2, 3)]
    trained = []

    def fake_execute(name, notebook, params, cwd):
        if name == "train":
            trained.append(params["seed"])
            if params["seed"] == 1:
                (tmp_path / sweep.STOP_FILE).touch()  # asked while the first cell trains

    monkeypatch.setattr(sweep, "load_grid", lambda grid: cells)
    monkeypatch.setattr(sweep, "execute_stoppable", fake_execute)
    monkeypatch.setattr(sweep, "export_html", lambda notebook, html: html)
    (tmp_path / sweep.STOP_FILE).touch()  # left from before: asks nothing of the next sweep
    first = sweep.run_sweep("grid", tmp_path, "t")
    assert trained == [1] and [(r.cell.name, r.status) for r in first.results] == [("seed=1", "complete")]
    assert not (tmp_path / sweep.STOP_FILE).exists()  # honoured once
    err = capsys.readouterr().err
    assert "left from before this sweep" in err and "stopped before cell seed=2 (2 of 3), as" in err
    second = sweep.run_sweep("grid", tmp_path, "t")
    assert trained == [1, 2, 3] and [r.status for r in second.results] == ["skipped", "complete", "complete"]
