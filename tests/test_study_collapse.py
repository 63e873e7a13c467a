"""The collapse-regime study's grid, endpoint, revision and report (study/collapse.py); nothing trains."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from scipy.stats import fisher_exact, ttest_1samp
from scipy.stats import t as student_t

from openrlhf_tis.params import ParameterError
from openrlhf_tis.pipeline.sweep import load_grid
from openrlhf_tis.study import collapse
from openrlhf_tis.viz.stats import detectable_effect, pairs_for_power


def test_the_grid_is_seed_major_then_lr_with_the_reference_beside_each_pair(tmp_path):
    collapse.main(["--out", str(tmp_path / "c"), "--model", "tiny", "--dry_run", "--lrs", "1e-4", "1.5e-4",
                   "--seeds", "3", "4", "--corrections", "tis", "token_mis"])
    cells = [(c.params["seed"], c.params["lr"], c.params["sync_every"], c.params["correction"])
             for c in load_grid(tmp_path / "c" / "study_grid.json")]
    arms = [(1, "off"), (8, "off"), (8, "tis"), (8, "token_mis")]
    assert cells == [(s, lr, k, c) for s in (3, 4) for lr in (1e-4, 1.5e-4) for k, c in arms]
    assert not (tmp_path / "c" / collapse.ENDPOINT_FILE).exists()  # a dry run fixes nothing


def test_the_endpoint_is_fixed_by_the_first_sitting_and_refused_once_cells_exist(tmp_path):
    out = tmp_path / "c"
    out.mkdir()
    with pytest.raises(ParameterError, match="3 cells ran before an endpoint was fixed"):
        collapse.check_endpoint(out, collapse.Endpoint(0.1, 6), cells=3)
    collapse.check_endpoint(out, collapse.Endpoint(0.1, 6), cells=0)
    assert json.loads((out / collapse.ENDPOINT_FILE).read_text())["fall_below"] == 0.1
    collapse.check_endpoint(out, collapse.Endpoint(0.1, 6), cells=5)  # the same endpoint: a later sitting goes on
    with pytest.raises(ParameterError, match=r"--fall_below 0.2: .* fixed fall_below = 0.1"):
        collapse.check_endpoint(out, collapse.Endpoint(0.2, 6), cells=5)
    with pytest.raises(ParameterError, match=r"--runs_per_arm 23: .* fixed runs_per_arm = 6"):
        collapse.check_endpoint(out, collapse.Endpoint(0.1, 23), cells=5)


def test_report_counts_falls_by_the_endpoint_and_tests_them_with_fisher():
    arms = {(1e-4, 1, "off"): dict(enumerate([0.3, 0.4, 0.35, 0.2], 1)),
            (1e-4, 8, "off"): dict(enumerate([0.05, -0.1, 0.3, 0.0], 1)),  # 3 of 4 below 0.1
            (1e-4, 8, "tis"): {1: 0.2, 2: 0.3, 3: 0.09, 5: 0.4}}  # 1 of 4; seed 5, not 4
    text = collapse.collapse_markdown(arms, collapse.Endpoint(0.1, 6))
    assert "| lr 0.0001, K = 8, off | 4 (fewer than planned) | 3 | 0.75 [" in text
    assert "| lr 0.0001, reference (K = 1) | 4 (fewer than planned) | 0 | 0.00 [0.00, 0.60] |" in text
    p = fisher_exact([[3, 1], [1, 3]]).pvalue
    assert f"| lr 0.0001, K = 8, off vs tis | 3/4 vs 1/4 | {p:.3f} |" in text
    assert collapse.collapse_markdown({}, collapse.Endpoint(0.1, 6)).startswith("(no run")
    # every run by seed, arms as columns in the report's order, a gap where a seed has no run of an arm
    assert "| seed | lr 0.0001, reference (K = 1) | lr 0.0001, K = 8, off | lr 0.0001, K = 8, tis |" in text
    assert "| 4 | +0.200 | +0.000 |  |" in text and "| 5 |  |  | +0.400 |" in text
    one = collapse.collapse_markdown({(1e-4, 8, "off"): {1: -0.2}}, collapse.Endpoint(0.1, 6))
    assert "| 1 | 1.00 [0.03, 1.00] | -0.200 (one run: no interval) |" in one


def test_the_paired_comparison_reads_only_the_seeds_both_arms_ran():
    off, tis = {1: 0.05, 2: -0.1, 3: 0.3, 4: 0.0}, {1: 0.2, 2: 0.3, 3: 0.09, 5: 0.4}
    lines = collapse.paired_lines({(1e-4, 8, "off"): off, (1e-4, 8, "tis"): tis}, collapse.Endpoint(0.1, 6))
    diff = np.array([0.15, 0.4, -0.21])  # seeds 1-3
    sd = diff.std(ddof=1)
    half = student_t.ppf(0.975, 2) * sd / np.sqrt(3)
    p = ttest_1samp(diff, 0.0).pvalue
    # falls: seeds 1, 2 uncorrected only, seed 3 TIS only: McNemar's exact p = P(binomial(3, 1/2) this far) = 1
    assert lines[2] == (f"| lr 0.0001, K = 8, off vs tis | 3 | {diff.mean():+.3f} [{diff.mean() - half:+.3f}, "
                        f"{diff.mean() + half:+.3f}] | {p:.3f} | {p:.3f} | {sd:.3f} | 0 / 2 / 1 / 0 | 1.000 | "
                        f"{pairs_for_power(sd, collapse.PAIRED_EFFECT)} |")  # one comparison: Holm's p is its own


def _column(line: str, index: int) -> float:
    return float(line.split("|")[index + 1])


def test_several_corrections_are_one_family_adjusted_by_holm():
    off = {1: 0.0, 2: 0.1, 3: 0.05, 4: -0.05}
    tis, mask = [0.3, 0.25, 0.35, 0.28], [0.1, -0.05, 0.2, 0.02]  # each seed's gain over uncorrected
    arms = {(1e-4, 8, "off"): off,
            (1e-4, 8, "tis"): {s: off[s] + d for s, d in zip(off, tis, strict=True)},
            (1e-4, 8, "token_mis"): {s: off[s] + d for s, d in zip(off, mask, strict=True)}}
    lines = collapse.paired_lines(arms, collapse.Endpoint(0.1, 6))
    p_tis, p_mask = ttest_1samp(tis, 0.0).pvalue, ttest_1samp(mask, 0.0).pvalue
    assert p_tis < p_mask
    by_name = {line.split("|")[1].strip(): line for line in lines[2:]}
    # Holm by hand: the smaller p times 2, the larger times 1 but never below the one before it
    assert _column(by_name["lr 0.0001, K = 8, off vs tis"], 4) == pytest.approx(min(1, 2 * p_tis), abs=5e-4)
    assert _column(by_name["lr 0.0001, K = 8, off vs token_mis"], 4) == pytest.approx(
        min(1, max(2 * p_tis, p_mask)), abs=5e-4)
    # falls (< 0.1): uncorrected 3 of 4 (0.1 is not below), TIS 0 of 4, the mask 2 of 4 (0.05, -0.03)
    fisher = collapse.collapse_markdown(arms, collapse.Endpoint(0.1, 6)).split("| comparison |")[1].splitlines()[2:4]
    by_name = {line.split("|")[1].strip(): line for line in fisher}
    p_tis, p_mask = fisher_exact([[3, 1], [0, 4]]).pvalue, fisher_exact([[3, 1], [2, 2]]).pvalue
    assert _column(by_name["lr 0.0001, K = 8, off vs tis"], 3) == pytest.approx(2 * p_tis, abs=5e-4)
    assert _column(by_name["lr 0.0001, K = 8, off vs token_mis"], 3) == pytest.approx(max(2 * p_tis, p_mask), abs=5e-4)


def test_pairs_for_power_is_the_first_that_detects_the_effect():
    # one SD of differences as the effect (d = 1): the textbook paired t-test needs 10 pairs for 80% at 0.05
    assert pairs_for_power(0.1, effect=0.1) == 10
    n = pairs_for_power(0.25, collapse.PAIRED_EFFECT)
    assert detectable_effect(0.25, n) <= collapse.PAIRED_EFFECT < detectable_effect(0.25, n - 1)
    assert pairs_for_power(float("nan"), 0.1) is None and pairs_for_power(5.0, 0.1) is None


def test_a_paired_primary_is_fixed_like_the_endpoint(tmp_path):
    collapse.check_endpoint(tmp_path, collapse.Endpoint.of(0.1, 8, "paired"), cells=0)
    with pytest.raises(ParameterError, match="--primary fisher: .* fixed primary = paired"):
        collapse.check_endpoint(tmp_path, collapse.Endpoint.of(0.1, 8, "fisher"), cells=2)
    old = tmp_path / "old"
    old.mkdir()
    (old / collapse.ENDPOINT_FILE).write_text(json.dumps({"fall_below": 0.1, "runs_per_arm": 6}))
    collapse.check_endpoint(old, collapse.Endpoint.of(0.1, 6, "fisher"), cells=7)  # written before the field: Fisher


def test_bad_arguments_are_refused_naming_the_flag(tmp_path, capsys):
    for extra, fault in ((["--every", "1"], "--every must be 2 or more"),
                         (["--fall_below", "1.5"], "--fall_below in (0, 1)"),
                         (["--lrs", "1e-4", "1e-4"], "--seeds and --lrs: each once")):
        with pytest.raises(SystemExit):
            collapse.main(["--out", str(Path(tmp_path) / "c"), "--model", "tiny", "--dry_run", *extra])
        assert fault in capsys.readouterr().err


def _run(path: Path, *machines: dict | None) -> Path:
    """A run folder whose config.json says it started on machines[0] and resumed on each of the rest."""
    path.mkdir(parents=True)
    first, *resumes = machines
    record = {"config": {}, "resumes": [{"machine": m} if m else {} for m in resumes], **({"machine": first} if first
                                                                                          else {})}
    (path / "config.json").write_text(json.dumps(record))
    return path


def test_a_seed_whose_runs_trained_on_two_machines_is_named(tmp_path):
    amx = {"capability": "AVX512", "kernels": ["amx_bf16", "avx512_vnni"], "cpus": 2}
    ice = {"capability": "AVX512", "kernels": ["avx512_vnni"], "cpus": 2}
    runs = [(1, _run(tmp_path / "a", amx)), (1, _run(tmp_path / "b", amx)),
            (2, _run(tmp_path / "c", amx)), (2, _run(tmp_path / "d", amx, ice)),  # resumed on the other machine
            (3, _run(tmp_path / "e", None))]
    lines = collapse.machine_lines(runs)
    assert "Machine AVX512+amx_bf16+avx512_vnni x 2: seeds 1, 2." in lines
    assert "Machine AVX512+avx512_vnni x 2: seed 2." in lines
    assert any("before machines were" in line and line.endswith("seed 3.") for line in lines)
    split = [line for line in lines if "different machines" in line]
    assert len(split) == 1 and split[0].startswith("**Seed 2's")
    assert not any("different machines" in line for line in collapse.machine_lines(runs[:3]))
