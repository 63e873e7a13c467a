"""One correction against others, paired by seed (study/contrast.py): the differences and intervals against scipy's
paired t-test in float64, the verdict's rule as a property, and the committed W5A8 folder read back to the numbers
docs/study.md gives for it."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from scipy.stats import t as student_t
from scipy.stats import ttest_rel

from openrlhf_tis.study import contrast
from openrlhf_tis.viz.stats import Interval, holm

ROOT = Path(__file__).resolve().parents[1]
W5A8 = ROOT / "results" / "study" / "adaptive-w5a8-fp32"


def test_a_setting_is_the_cell_name_without_correction_and_seed():
    assert contrast.setting_of("rollout_precision=fp32,sync_every=4,lr=6e-05,correction=adaptive,seed=3") == (
        "rollout_precision=fp32,sync_every=4,lr=6e-05")
    assert contrast.setting_of("correction=off,seed=1") == ""


def test_rows_pair_only_the_seeds_both_corrections_ran_in_each_setting():
    gains = {"k=4": {"adaptive": {1: 0.30, 2: 0.10, 3: 0.25, 4: 0.5}, "tis": {1: 0.20, 2: 0.15, 3: 0.05},
                     "off": {2: 0.0, 3: 0.1}},
             "k=1": {"off": {1: 0.3}},  # no adaptive run: no row
             "k=8": {"adaptive": {1: 0.2}, "tis": {2: 0.1}}}  # no common seed: no row
    rows = contrast.contrast_rows(gains, "adaptive", ["tis", "off"])
    assert [(row.setting, row.against, row.seeds) for row in rows] == [("k=4", "tis", [1, 2, 3]),
                                                                      ("k=4", "off", [2, 3])]
    a, b = np.array([0.30, 0.10, 0.25], dtype=np.float64), np.array([0.20, 0.15, 0.05], dtype=np.float64)
    diff = a - b
    half = student_t.ppf(0.975, 2) * diff.std(ddof=1) / np.sqrt(3)
    first = rows[0]
    assert first.gap.estimate == pytest.approx(diff.mean(), abs=1e-12)
    assert (first.gap.low, first.gap.high) == pytest.approx((diff.mean() - half, diff.mean() + half), abs=1e-12)
    assert first.p == pytest.approx(ttest_rel(a, b).pvalue, abs=1e-12)
    assert first.sd == pytest.approx(diff.std(ddof=1), abs=1e-12)


finite = st.floats(-1.0, 1.0, allow_nan=False)


@given(finite, finite, st.floats(0.01, 0.5))
def test_the_verdict_follows_the_interval_and_the_margin(a, b, margin):
    low, high = min(a, b), max(a, b)
    said = contrast.verdict(Interval((low + high) / 2, low, high, 6), margin)
    if high < 0:
        assert said == "costs more: shown"
    elif low > 0:
        assert said == "better: shown"
    elif low > -margin:
        assert said == "costs no more: claimed"
    else:
        assert said == "not shown either way"
    assert contrast.verdict(Interval(0.1, float("nan"), float("nan"), 1), margin).startswith("no interval")


def test_the_committed_w5a8_folder_gives_the_numbers_the_study_reports(tmp_path):
    """docs/study.md's W5A8 table (computed by hand when it ran): adaptive − TIS +0.042 [−0.042, +0.126], p 0.26,
    SD 0.080, 8 seeds for ±0.1; adaptive − off +0.047 [−0.086, +0.179], p 0.41, SD 0.126, 15 seeds."""
    folder = tmp_path / W5A8.name
    shutil.copytree(W5A8, folder)
    text = contrast.write_contrast(folder, "adaptive", ["tis", "off"])
    assert text == (folder / "contrast_adaptive.md").read_text().rstrip("\n")
    lines = [line for line in text.splitlines() if line.startswith("| rollout_precision=int8,int8_weight_bits=5 |")]
    assert len(lines) == 2
    cells = [[c.strip() for c in line.split("|")[2:-1]] for line in lines]
    assert cells[0][:3] == ["adaptive − tis", "6", "+0.042 [-0.042, +0.126]"]
    assert cells[0][5:] == ["0.080", "8", "costs no more: claimed"]
    assert cells[1][:3] == ["adaptive − off", "6", "+0.047 [-0.086, +0.179]"]
    assert cells[1][5:] == ["0.126", "15", "secondary: costs no more: claimed"]
    p = [float(cells[0][3]), float(cells[1][3])]
    assert p == pytest.approx([0.259, 0.405], abs=1e-3)
    assert [float(c[4]) for c in cells] == pytest.approx(list(holm(p)), abs=2e-3)
    assert "Machine " in text and "seeds 1, 2, 3, 4, 5, 6" in text


def test_bad_input_is_refused_naming_the_flag(tmp_path, capsys):
    for argv, flag in ((["--margin", "0"], "--margin"), (["--margin", "1.5"], "--margin"),
                       (["--against", "adaptive"], "--against"), (["--against", "tis", "tis"], "--against")):
        with pytest.raises(SystemExit):
            contrast.main(["--out", str(W5A8), "--arm", "adaptive", "--against", "tis", *argv]
                          if argv[0] != "--against" else ["--out", str(W5A8), "--arm", "adaptive", *argv])
        assert flag in capsys.readouterr().err
    with pytest.raises(SystemExit):
        contrast.main(["--out", str(tmp_path), "--arm", "adaptive", "--against", "tis"])
    assert "--out" in capsys.readouterr().err
    folder = tmp_path / "copy"
    shutil.copytree(W5A8, folder)
    (folder / "contrast_adaptive.md").unlink()  # the committed table: a refused call must not write one
    for argv, flag in ((["--arm", "token_mis", "--against", "tis"], "--arm token_mis"),
                       (["--arm", "adaptive", "--against", "tis", "icepop"], "--against icepop")):
        with pytest.raises(SystemExit):
            contrast.main(["--out", str(folder), *argv])
        assert flag in capsys.readouterr().err
    assert not (folder / "contrast_adaptive.md").exists() and not (folder / "contrast_token_mis.md").exists()
