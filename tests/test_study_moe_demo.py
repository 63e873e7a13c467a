"""The MoE demo study's command (study/moe_demo.py): its grid, what it refuses before any cell runs, and its table."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import pytest

from openrlhf_tis.demo.tiny_model import build_tiny_model, build_tiny_moe
from openrlhf_tis.pipeline.sweep import load_grid
from openrlhf_tis.study import moe_demo


def _dry_run(out: Path, *extra: str) -> list:
    moe_demo.main(["--out", str(out), "--dry_run", *extra])
    return load_grid(out / "study_grid.json")


def test_the_grid_is_seed_major_replay_off_and_r3_at_each_rollout_precision(tmp_path, capsys):
    cells = _dry_run(tmp_path / "s", "--seeds", "5", "7", "--steps", "3")
    arms = [(c.params["rollout_precision"], c.params["routing_replay"]) for c in cells]
    assert arms == [("bf16", "off"), ("bf16", "r3"), ("int8", "off"), ("int8", "r3")] * 2
    assert [c.params["seed"] for c in cells] == [5] * 4 + [7] * 4
    assert {(c.params["model"], c.params["correction"], c.params["steps"]) for c in cells} == {("upcycled", "tis", 3)}
    assert "8 cells of 3 steps" in capsys.readouterr().err


def test_the_default_grid_is_twelve_cells_at_the_main_jobs_horizon(tmp_path):
    from openrlhf_tis.pipeline.main_job import job_params

    cells = _dry_run(tmp_path / "s")
    assert len(cells) == 12 and {c.params["seed"] for c in cells} == {1, 2, 3}
    assert {c.params["steps"] for c in cells} == {job_params(tmp_path / "task", "upcycled")["steps"]}


def test_an_moe_directory_replay_covers_is_taken(tmp_path):
    moe = build_tiny_moe(tmp_path / "moe")
    assert {c.params["model"] for c in _dry_run(tmp_path / "s", "--model", str(moe), "--seeds", "1")} == {str(moe)}


@pytest.mark.parametrize(("model", "fault"), [
    ("tiny", "--model tiny: a dense model"),
    ("default", "--model default: a dense model"),
    ("DENSE_DIR", "is a dense model (no routed experts"),
])
def test_a_model_replay_cannot_serve_is_refused_before_any_cell(tmp_path, capsys, model, fault):
    if model == "DENSE_DIR":
        model = str(build_tiny_model(tmp_path / "dense"))
    with pytest.raises(SystemExit) as done:
        _dry_run(tmp_path / "s", "--model", model)
    assert done.value.code == 2 and fault in capsys.readouterr().err
    assert not (tmp_path / "s" / "study_grid.json").exists()


@pytest.mark.parametrize(("extra", "fault"), [(["--seeds", "1", "1"], "--seeds: each seed once"),
                                              (["--steps", "0"], "--steps must be >= 1")])
def test_bad_seeds_or_steps_are_refused(tmp_path, capsys, extra, fault):
    with pytest.raises(SystemExit) as done:
        _dry_run(tmp_path / "s", *extra)
    assert done.value.code == 2 and fault in capsys.readouterr().err


def test_the_table_gives_each_arm_its_mean_and_t_interval_over_seeds():
    rows = pd.DataFrame([
        {"replay": "off", "rollouts": "bf16", "seed": s, "routing agreement": a, "tokens routed differently": 0.3,
         "k3 (routing differed)": 2e-3, "k3 (routing same)": 1e-3, "kept gain": g}
        for s, a, g in ((1, 0.90, 0.1), (2, 0.95, float("nan")), (3, 1.00, 0.3))
    ] + [{"replay": "r3", "rollouts": "bf16", "seed": 1, "routing agreement": 0.97, "tokens routed differently": 0.2,
          "k3 (routing differed)": 1e-3, "k3 (routing same)": 1e-3, "kept gain": float("nan")}])
    lines = moe_demo.moe_table(rows).splitlines()
    assert lines[0].startswith("| replay | rollouts | seeds | routing agreement |") and len(lines) == 4
    off = lines[2].split(" | ")
    # mean 0.95, s = 0.05, n = 3: ± t(0.975, 2) · s / √3 with t(0.975, 2) = 4.302653 (tables)
    half = 4.302653 * 0.05 / math.sqrt(3)
    assert off[2:4] == ["3", f"0.95 [{0.95 - half:.3g}, {0.95 + half:.3g}]"]
    assert off[4] == "0.3 [0.3, 0.3]"  # no spread: a zero-width interval
    assert off[-1].rstrip(" |") == f"0.2 [{0.2 - 12.7062 * 0.1414214 / math.sqrt(2):.3g}, " \
                                   f"{0.2 + 12.7062 * 0.1414214 / math.sqrt(2):.3g}]"  # the NaN seed left out
    r3 = lines[3].split(" | ")
    assert r3[2:4] == ["1", "0.97"] and r3[-1].rstrip(" |") == "–"  # one seed: no interval; no gain at all
    assert moe_demo.moe_table(pd.DataFrame()) == "(no cell completed)"


def test_report_without_cells_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as done:
        moe_demo.main(["--out", str(tmp_path / "s"), "--report"])
    assert done.value.code == 2 and "no finished cell" in capsys.readouterr().err
