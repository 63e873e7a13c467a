"""The staleness study's command (study/staleness.py): its grid, and what it refuses before any cell runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from openrlhf_tis.cpu_features import default_train_dtype
from openrlhf_tis.pipeline.sweep import STATUS_FILE, load_grid
from openrlhf_tis.study import staleness


def _dry_run(out: Path, *extra: str) -> list:
    staleness.main(["--out", str(out), "--model", "tiny", "--dry_run", *extra])
    return load_grid(out / "study_grid.json")


def test_the_grid_is_seed_major_with_its_own_reference_and_the_combined_cells(tmp_path):
    cells = _dry_run(tmp_path / "s", "--every", "3", "6", "--seeds", "5", "7")
    per_seed = 1 + 2 * len(staleness.CORRECTIONS) + len(staleness.COMBINED)
    assert len(cells) == 2 * per_seed
    first = [(c.params["sync_every"], c.params["rollout_precision"], c.params["correction"]) for c in cells[:per_seed]]
    engine = default_train_dtype("cpu")  # the `none` dose: the engine in the trainer's dtype, the CPU profile's
    assert first == [(1, engine, "off"), *((3, engine, c) for c in staleness.CORRECTIONS),
                     *((6, engine, c) for c in staleness.CORRECTIONS), *((6, "int8", c) for c in staleness.COMBINED)]
    assert {c.params["seed"] for c in cells[:per_seed]} == {5} and {c.params["seed"] for c in cells[per_seed:]} == {7}
    assert {(c.params["lr"], c.params["steps"]) for c in cells} == {(staleness.LR, staleness.STEPS)}


def test_a_narrowed_grid_names_its_cells_as_the_full_grid_does(tmp_path):
    """Extra seeds for the deciding comparisons must land as more seeds of the same settings, never new ones."""
    full = {c.name: c.params for c in _dry_run(tmp_path / "s", "--every", "4", "8", "--seeds", "4")}
    narrow = _dry_run(tmp_path / "s", "--every", "8", "--seeds", "4", "--corrections", "off", "tis", "--no_int8")
    assert [(c.params["sync_every"], c.params["correction"]) for c in narrow] == [(1, "off"), (8, "off"), (8, "tis")]
    assert all(full[c.name] == c.params for c in narrow)
    combined = _dry_run(tmp_path / "s", "--every", "8", "--seeds", "4", "--corrections", "tis", "token_mis")
    assert [(c.params["rollout_precision"], c.params["correction"]) for c in combined][-1] == ("int8", "tis")
    assert all(c.name in full for c in combined)


def test_the_adaptive_correction_runs_only_when_asked_for_by_name(tmp_path):
    """The committed folders were run with the default grid: adding a correction to it would give them new cells."""
    assert "adaptive" not in staleness.CORRECTIONS
    asked = _dry_run(tmp_path / "s", "--every", "4", "--seeds", "2", "--corrections", "off", "tis", "adaptive",
                     "--no_int8")
    assert [(c.params["sync_every"], c.params["correction"]) for c in asked] == [
        (1, "off"), (4, "off"), (4, "tis"), (4, "adaptive")]
    full = {c.name: c.params for c in _dry_run(tmp_path / "s", "--every", "4", "--seeds", "2", "--no_int8")}
    assert all(full[c.name] == c.params for c in asked if c.params["correction"] != "adaptive")


@pytest.mark.parametrize(("extra", "fault"), [
    (["--corrections", "seq_mis"], "--corrections: the study runs off tis token_mis adaptive, got seq_mis"),
    (["--corrections", "tis", "tis"], "--corrections: each correction once"),
    (["--every", "1", "8"], "--every: cadences must be 2 or more"),
    (["--every", "0"], "--every: cadences must be 2 or more"),
    (["--every", "8", "8"], "--every: each cadence once"),
    (["--seeds", "1", "1"], "--seeds: each seed once"),
])
def test_a_cadence_or_seed_that_cannot_be_honoured_is_refused_before_any_cell(tmp_path, capsys, extra, fault):
    with pytest.raises(SystemExit) as done:
        _dry_run(tmp_path / "s", *extra)
    assert done.value.code == 2 and fault in capsys.readouterr().err
    assert not (tmp_path / "s" / "study_grid.json").exists()


def test_a_folder_of_another_cpu_profile_is_refused_naming_it(tmp_path, capsys):
    out = tmp_path / "s"
    other = "fp32" if default_train_dtype("cpu") == "bf16" else "bf16"
    cell = out / "cells" / "x"
    cell.mkdir(parents=True)
    (cell / STATUS_FILE).write_text(json.dumps({"cell": "x", "status": "complete",
                                                "params": {"model": "tiny", "train_dtype": other}}))
    with pytest.raises(SystemExit):
        _dry_run(out)
    err = capsys.readouterr().err
    assert f"--out {out}: its cells trained in {other} (another CPU profile)" in err


def test_a_folder_of_another_horizon_is_refused_naming_steps(tmp_path, capsys):
    """A longer horizon in the study's folder would re-run its cells under their names (the sweep re-runs a cell whose
    values changed) and mix two horizons in one report."""
    out = tmp_path / "s"
    cell = out / "cells" / "x"
    cell.mkdir(parents=True)
    (cell / STATUS_FILE).write_text(json.dumps({"cell": "x", "status": "complete", "params": {
        "model": "tiny", "train_dtype": default_train_dtype("cpu"), "steps": staleness.STEPS}}))
    with pytest.raises(SystemExit):
        _dry_run(out, "--steps", "48")
    assert f"--steps 48: the cells under --out {out} trained for {staleness.STEPS} steps" in capsys.readouterr().err
    assert [c.params["steps"] for c in _dry_run(tmp_path / "horizon", "--steps", "48", "--every", "8")][0] == 48
