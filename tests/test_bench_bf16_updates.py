"""benchmarks/bench_bf16_updates.py against hand-computed bf16 spacings: which updates survive the rounding, and
how far a saved model moved from its base."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_bf16_updates.py"
sys.path.insert(0, str(SCRIPT.parent))

from bench_bf16_updates import movement, survival  # noqa: E402


def test_an_update_survives_only_above_half_the_bf16_spacing():
    # bf16 keeps 8 significant bits: the spacing is 2^-7 at 1.0, 2^-6 at 2.0 and 2^-13 at 1/64
    weights = torch.tensor([1.0, 2.0, -2.0, 1 / 64])
    assert survival(weights, 2**-8 * 0.99) == pytest.approx(0.25)  # only 1/64 (half spacing 2^-14)
    assert survival(weights, 2**-8 * 1.01) == pytest.approx(0.5)  # and 1.0 (half spacing 2^-8)
    assert survival(weights, 2**-7 * 1.01) == pytest.approx(1.0)  # and ±2.0, whatever the sign


def test_movement_counts_changed_weights_and_their_relative_norm():
    base = {"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([3.0, 4.0])}
    bf16 = torch.bfloat16
    run = {"a": torch.tensor([1.0, 2.0 + 2**-6], dtype=bf16), "b": torch.tensor([3.0, 4.0], dtype=bf16),
           "lm_head.weight": torch.ones(2, dtype=bf16)}  # a tied head saved under its own name: skipped
    changed, relative = movement(base, run)
    assert changed == pytest.approx(0.25)
    assert relative == pytest.approx(2**-6 / 30**0.5)


def test_the_script_prints_the_survival_table_and_a_row_per_run(tmp_path):
    base, run = tmp_path / "base", tmp_path / "run" / "model"
    base.mkdir()
    run.mkdir(parents=True)
    save_file({"w": torch.tensor([1.0, 1 / 64])}, str(base / "model.safetensors"))
    save_file({"w": torch.tensor([1.0, 1 / 64 + 2**-13], dtype=torch.bfloat16)}, str(run / "model.safetensors"))
    out = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "run"), "--model", str(base), "--updates", "1e-4",
                          "1e-2"], capture_output=True, text=True, check=True).stdout
    lines = out.splitlines()
    assert lines[2].split() == ["0.0001", "0.500"] and lines[3].split() == ["0.01", "1.000"]
    assert lines[-1].split()[1:3] == ["bfloat16", "0.500"]
