"""The early-warning analysis (study/early_warning.py) on runs built by hand: each statistic against a hand count
or scipy's own, the leave-one-study-out rule's thresholds and leads worked out by hand, and the report's verdict
both ways."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from openrlhf_tis.study import early_warning as ew
from openrlhf_tis.study.early_warning import Run, Signal

ESS = Signal("ess", "mismatch/ess_seq", "low")
K3 = Signal("k3", "mismatch/k3_kl", "high")


def _run(study: str, setting: str, seed: int, gain: float, **series: list[float]) -> Run:
    steps = len(next(iter(series.values())))
    records = tuple({"step": i + 1, **{k.replace("__", "/"): v[i] for k, v in series.items()}} for i in range(steps))
    return Run(study, Path(f"/r/{study}/cells/{setting}_seed={seed}-0123abcd/run"), gain, records)


def test_trailing_signals_against_the_opening_window():
    records = [{"step": i, "reward": r} for i, r in enumerate([1, 1, 1, 1, 0, 0, 0, 0], 1)]
    drop = ew.signal_series(records, Signal("drop", "reward", "low", "difference"))
    assert np.isnan(drop[:3]).all()
    assert drop[3:].tolist() == [0.0, -0.25, -0.5, -0.75, -1.0]
    ratio = ew.signal_series(records, Signal("ratio", "reward", "low", "ratio"))
    assert ratio[3:].tolist() == [1.0, 0.75, 0.5, 0.25, 0.0]


def test_worst_so_far_skips_missing_values():
    series = np.array([math.nan, 0.5, math.nan, 0.2, 0.9])
    assert np.isnan(ew.worst_so_far(series, "low")[0])
    assert ew.worst_so_far(series, "low")[1:].tolist() == [0.5, 0.5, 0.2, 0.2]
    assert ew.worst_so_far(series, "high")[1:].tolist() == [0.5, 0.5, 0.5, 0.9]


def test_auroc_counts_pairs_ties_half():
    # fell 3 beats held 1 and 2, loses to 3.5; fell 4 beats all three; fell 2 ties held 2 and beats 1: 6.5 of 9
    assert ew.auroc(np.array([3.0, 4.0, 2.0]), np.array([1.0, 2.0, 3.5])) == pytest.approx(6.5 / 9)
    assert math.isnan(ew.auroc(np.array([]), np.array([1.0])))


def test_discrimination_reads_the_worst_by_the_horizon_and_pairs_within_a_setting():
    runs = [_run("a", "x", 1, -0.2, mismatch__ess_seq=[0.9, 0.1, 0.9]),  # fell, worst by step 2: 0.1
            _run("a", "x", 2, 0.3, mismatch__ess_seq=[0.9, 0.5, 0.05]),  # held; its 0.05 is after step 2
            _run("a", "y", 1, 0.0, mismatch__ess_seq=[0.8, 0.6, 0.6]),  # fell, 0.6
            _run("a", "y", 2, 0.4, mismatch__ess_seq=[0.7, 0.7, 0.7])]  # held, 0.7
    d = ew.discrimination(runs, ESS, horizon=2)
    # badness = -ESS: fell {-0.1, -0.6}, held {-0.5, -0.7}: -0.1 beats both, -0.6 beats -0.7 only: 3 of 4
    assert (d.fell, d.held, d.auroc) == (2, 2, pytest.approx(0.75))
    assert d.pairs == 2 and d.within == pytest.approx(1.0)  # x: 0.1 < 0.5, y: 0.6 < 0.7
    assert d.low <= d.auroc <= d.high


def test_leave_one_study_out_thresholds_from_the_other_studies_and_leads_to_the_end():
    held_b = [_run("b", "h", s, 0.3, mismatch__k3_kl=[0.1 * s, 0.1 * s, 0.1 * s, 0.1 * s]) for s in range(1, 11)]
    # study b's held k3: 0.1..1.0; their 90% quantile (linear): 0.91
    runs = [_run("a", "f", 1, -0.1, mismatch__k3_kl=[0.5, 0.95, 0.2, 0.1]),  # crosses at step 2: lead 2
            _run("a", "h", 1, 0.5, mismatch__k3_kl=[0.5, 0.5, 0.5, 0.5]),  # never crosses
            *held_b]
    assert ew.threshold(held_b, K3) == pytest.approx(0.91)
    assert ew.first_warning(runs[0], K3, 0.91) == 2
    rule = ew.out_of_study_rule(runs, K3)
    # fold a: warned 1/1 falls, 0/1 held; fold b (threshold from a's held run: 0.5): held 0.6..1.0 warned (5 of 10)
    assert (rule.falls, rule.warned_falls, rule.held, rule.warned_held, rule.leads) == (1, 1, 11, 5, (2,))


def test_the_report_says_when_no_rule_holds_up(tmp_path):
    runs = [_run(study, "s", seed, gain, mismatch__ess_seq=[0.9] * 12, mismatch__k3_kl=[0.01] * 12)
            for study in ("a", "b") for seed, gain in ((1, -0.1), (2, 0.3), (3, 0.4))]
    text = ew.report_markdown(runs)
    assert "No rule holds up" in text and "Runs: 6 from 2 studies" in text


def test_the_cli_reads_study_folders_and_names_a_missing_one(tmp_path, capsys):
    run = tmp_path / "study" / "cells" / "c_seed=1-0123abcd" / "run"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "mismatch/ess_seq": 0.9}) + "\n"
                                               for i in range(1, 13)))
    score = {"model": "m", "pass1": 0.2, "passk": 0.5, "k": 4, "per_question": [0.2], "seconds": 1.0, "cached": False}
    (run / "heldout_kept.json").write_text(json.dumps({"schema": 1, "dtype": "bf16", "n_samples": 4, "seed": 1,
                                                       "before": score, "after": {**score, "pass1": 0.5}}))
    with pytest.raises(SystemExit):
        ew.main([str(tmp_path / "nowhere"), "--out", str(tmp_path / "out")])
    assert "study folders: not found" in capsys.readouterr().err
    ew.main([str(tmp_path / "study"), "--out", str(tmp_path / "out")])
    assert "Runs: 1 from 1 studies" in (tmp_path / "out" / ew.REPORT_FILE).read_text()
    assert (tmp_path / "out" / ew.FIGURE_FILE).stat().st_size > 0
