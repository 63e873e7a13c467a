"""Seed-aggregated comparison: settings from configs, held-out gains from heldout_kept.json (or the engine's
metrics, labelled), intervals against hand-computed values, and the report built from fixture runs."""

from __future__ import annotations

import json
import math
import warnings

import numpy as np
import pandas as pd
import pytest
from scipy.stats import nct

from openrlhf_tis.pipeline.report import show_comparison
from openrlhf_tis.runs import RunStoreWarning, RunWriter
from openrlhf_tis.runs.kept_score import KEPT_FILE, read_kept_heldout
from openrlhf_tis.runs.layout import unique_dir_name
from openrlhf_tis.viz.compare import dose_of, run_facts, setting_diff
from openrlhf_tis.viz.gain_plots import plot_dose_response, plot_gains
from openrlhf_tis.viz.gains import (
    ENGINE,
    KEPT,
    dose_response,
    headline_markdown,
    headline_source,
    holm_family,
    paired_differences,
    reference_setting,
    run_gains,
    setting_gains,
    uncorrected_of,
)

T2 = 0.95 * math.sqrt(2.0 / (1.0 - 0.95**2))  # t(0.975, 2), from the df = 2 CDF
T1 = math.tan(0.475 * math.pi)  # t(0.975, 1)


def _kept(run, before, after, q_before=None, q_after=None, seed=1):
    part = lambda p, q: {"model": "m", "pass1": p, "passk": min(1.0, 2 * p), **({"per_question": q} if q else {})}  # noqa: E731
    (run / KEPT_FILE).write_text(json.dumps({"schema": 1, "policy": "trainer weights", "dtype": "fp32", "n_samples": 4,
                                             "seed": seed, "before": part(before, q_before),
                                             "after": part(after, q_after)}))


def _cell(root, precision, correction, seed, *, bits="auto", k3=0.05, engine=(0.2, 0.3), kept=None):
    """A sweep cell's run: config, metrics with engine held-out, and optionally heldout_kept.json."""
    name = f"rollout_precision={precision},correction={correction},seed={seed}"
    if bits != "auto":
        name = name.replace(",correction", f",int8_weight_bits={bits},correction")
    run = root / "cells" / unique_dir_name(name) / "run"
    config = {"vllm.rollout_precision": precision, "ds.param_dtype": "fp32", "vllm.int8_weight_bits": bits,
              "algo.correction.preset": correction, "train.seed": seed, "logger.run_dir": str(run), "lr": 2e-5,
              # upstream's default run name is the start time (ppo_%m%dT%H:%M): different for every run
              "logger.wandb.run_name": f"ppo_1125T19:{len(list(root.glob('cells/*'))):02d}"}
    writer = RunWriter(run, config=config, origin={})
    for step in (1, 2, 3):
        line = {"rollout/reward_mean": 0.1 * step + 0.01 * seed, "mismatch/k3_kl": k3 * step / 2}
        if step == 1:
            line["eval_start/default_pass1"] = engine[0]
        if step == 3:
            line["eval/default_pass1"] = engine[1]
        writer.append_metrics(step, line)
    if kept is not None:
        _kept(run, *kept, seed=seed)
    return run


def test_the_kept_policy_file_is_read_and_a_damaged_one_is_ignored_by_name(tmp_path):
    _kept(tmp_path, 0.25, 0.5, [0.0, 0.5], [0.5, 0.5], seed=7)
    kept = read_kept_heldout(tmp_path)
    assert (kept.before.pass1, kept.after.pass1, kept.seed, kept.dtype, kept.n_samples) == (0.25, 0.5, 7, "fp32", 4)
    np.testing.assert_array_equal(kept.after.per_question - kept.before.per_question, [0.5, 0.0])
    assert read_kept_heldout(tmp_path / "nowhere") is None  # absent: the engine's score is used instead
    for bad in ({"schema": 2}, {"schema": 1, "before": {"pass1": 0.1}, "after": {"pass1": "x"}},
                {"schema": 1, "before": {"pass1": 0.1, "per_question": [0.1]}, "after": {"pass1": 0.2}}):
        (tmp_path / KEPT_FILE).write_text(json.dumps(bad))
        with pytest.warns(RunStoreWarning, match=KEPT_FILE):
            assert read_kept_heldout(tmp_path) is None


def test_dose_levels_from_the_resolved_flags():
    assert dose_of({"vllm.rollout_precision": "fp32", "ds.param_dtype": "fp32"}) == "none"
    assert dose_of({"vllm.rollout_precision": "bf16", "ds.param_dtype": "fp32"}) == "bf16"
    assert dose_of({"vllm.rollout_precision": "int8", "vllm.int8_weight_bits": "auto"}) == "int8"
    assert dose_of({"vllm.rollout_precision": "int8", "vllm.int8_weight_bits": "4"}) == "w4a8"
    assert dose_of({"vllm.rollout_precision": "int8", "vllm.int8_weight_bits": "6", "train.async_enable": True,
                    "train.async_queue_size": 2}) == "w6a8+q2"
    assert dose_of({"vllm.rollout_precision": "bf16", "vllm.sync_every": 8}) == "none+s8"  # the staleness axis
    assert dose_of({"vllm.rollout_precision": "int8", "vllm.int8_weight_bits": "auto", "vllm.sync_every": 1}) == "int8"
    assert dose_of({}) == "?"


def _study(tmp_path, kept=True):
    """Reference fp32/off and W4A8 x {off, tis}, seeds 1-3 (tis: seeds 1-2), kept-policy scores over 2 questions."""
    ref_gain, off_gain, tis_gain = (0.30, 0.20, 0.25), (0.10, 0.00, 0.20), (0.05, 0.15)
    runs = []
    for seed in (1, 2, 3):
        q = [0.25, 0.25]
        runs.append(_cell(tmp_path, "fp32", "off", seed, k3=2e-9, kept=(0.25, 0.25 + ref_gain[seed - 1], q,
                          [0.25 + ref_gain[seed - 1]] * 2) if kept else None))
        runs.append(_cell(tmp_path, "int8", "off", seed, bits="4", k3=1.0, kept=(0.25, 0.25 + off_gain[seed - 1], q,
                          [0.25, 0.25 + 2 * off_gain[seed - 1]]) if kept else None))
        if seed < 3:
            runs.append(_cell(tmp_path, "int8", "tis", seed, bits="4", k3=0.8,
                              kept=(0.25, 0.25 + tis_gain[seed - 1]) if kept else None))
    return runs


def test_runs_that_differ_only_by_seed_are_one_setting(tmp_path):
    runs = _study(tmp_path)
    facts = run_facts(runs)
    assert list(dict.fromkeys(facts["setting"])) == ["none / off", "w4a8 / off", "w4a8 / tis"]
    assert facts.groupby("setting", sort=False)["seed"].apply(list).tolist() == [[1, 2, 3], [1, 2, 3], [1, 2]]
    assert list(dict.fromkeys(facts["dose"])) == ["none", "w4a8"]
    # each run's k3 is the mean over its steps: k3 * (1 + 2 + 3) / 6
    assert facts["k3_mean"].iloc[1] == pytest.approx(1.0)
    flags = setting_diff(runs, facts)
    assert flags.shape[1] == 3 and "train.seed" not in flags.index and "logger.run_dir" not in flags.index
    assert flags.loc["algo.correction.preset"].tolist() == ["off", "off", "tis"]


def test_setting_gains_and_the_reference_comparison_against_hand_computed_intervals(tmp_path):
    facts = run_facts(_study(tmp_path))
    gains = run_gains(facts)
    assert set(gains["source"]) == {KEPT, ENGINE} and headline_source(gains) == KEPT
    table = setting_gains(gains, KEPT)
    ref, off, tis = table.index
    # reference gains 0.30, 0.20, 0.25: mean 0.25, s = 0.05
    assert table.loc[ref, "gain"] == pytest.approx(0.25)
    assert table.loc[ref, "t_low"] == pytest.approx(0.25 - T2 * 0.05 / math.sqrt(3))
    assert table.loc[ref, "shown"]  # [0.126, 0.374] and the bootstrap both exclude 0
    # W4A8 off gains 0.10, 0.00, 0.20: mean 0.1, s = 0.1, interval [-0.148, 0.348] includes 0
    assert table.loc[off, "gain"] == pytest.approx(0.1) and not table.loc[off, "shown"]
    assert table.loc[off, "t_high"] == pytest.approx(0.1 + T2 * 0.1 / math.sqrt(3))
    # tis has no per-question scores: no bootstrap interval; 2 seeds: t(0.975, 1) * s / sqrt(2)
    assert math.isnan(table.loc[tis, "boot_low"])
    assert table.loc[tis, "t_high"] - table.loc[tis, "gain"] == pytest.approx(T1 * (0.1 / math.sqrt(2)) / math.sqrt(2))
    assert reference_setting(facts) == ref
    versus = paired_differences(gains, KEPT, {off: ref, tis: ref})
    # paired by seed: off − ref = -0.2, -0.2, -0.05 -> mean -0.15, s = 0.0866
    diffs = np.array([-0.2, -0.2, -0.05])
    assert versus.loc[off, "difference"] == pytest.approx(diffs.mean())
    assert versus.loc[off, "t_high"] == pytest.approx(diffs.mean() + T2 * diffs.std(ddof=1) / math.sqrt(3))
    assert versus.loc[off, "seeds"] == 3 and versus.loc[tis, "seeds"] == 2  # tis ran seeds 1, 2 only
    # the correction against the uncorrected setting at its dose, paired by seed: tis − off = -0.05, +0.15 (seeds 1, 2)
    assert uncorrected_of(facts) == {tis: off}
    against_off = paired_differences(gains, KEPT, uncorrected_of(facts))
    assert list(against_off.index) == [tis] and against_off.loc[tis, "seeds"] == 2
    assert against_off.loc[tis, "difference"] == pytest.approx(0.05)
    assert against_off.loc[tis, "t_low"] == pytest.approx(0.05 - T1 * math.sqrt(0.02) / math.sqrt(2))
    assert not against_off.loc[tis, "shown"]
    engine = setting_gains(gains, ENGINE)
    assert engine["gain"].tolist() == pytest.approx([0.1, 0.1, 0.1])  # the fixtures' engine score: 0.2 -> 0.3


def _power(delta: float, s: float, n: int) -> float:
    """Two-sided power of the paired t-test over n = 2 or 3 pairs at a true difference δ, from scipy's noncentral t
    with noncentrality δ sqrt(n) / s; at 2 pairs the lower tail (below 1e-15, and NaN in nct.cdf this far out) is
    left out."""
    c, nc = (T1, T2)[n - 2], delta * math.sqrt(n) / s
    return float(nct.sf(c, n - 1, nc) + (nct.cdf(-c, n - 1, nc) if n > 2 else 0.0))


def test_each_comparison_says_what_it_could_detect_and_whether_it_survives_holm(tmp_path):
    facts = run_facts(_study(tmp_path))
    points = dose_response(facts, run_gains(facts), KEPT)
    _, off, tis = points.index
    # by hand (Student t with 1 and 2 df in closed form: F(t) = 1/2 + atan(t)/pi, 1/2 + t / (2 sqrt(2 + t²))):
    # w4a8 off − ref = -0.2, -0.2, -0.05: s = sqrt(0.0075), t = -3 on 2 df; w4a8 tis − ref = -0.25, -0.05 (seeds 1, 2):
    # s = sqrt(0.02), t = -1.5 on 1 df; tis − off = -0.05, +0.15: t = 0.5 on 1 df
    p = {("off", "ref"): 1.0 - 3.0 / math.sqrt(11.0), ("tis", "ref"): 1.0 - 2.0 * math.atan(1.5) / math.pi,
         ("tis", "off"): 1.0 - 2.0 * math.atan(0.5) / math.pi}
    got = {("off", "ref"): points.loc[off, "p_vs_ref"], ("tis", "ref"): points.loc[tis, "p_vs_ref"],
           ("tis", "off"): points.loc[tis, "p_vs_off"]}
    assert got == pytest.approx(p, rel=1e-9)
    # Holm over m = 3: sorted 0.0955, 0.3743, 0.7048 -> 3 p, 2 p, max(2 p_(2), p_(3))
    assert points.loc[off, "p_holm_vs_ref"] == pytest.approx(3 * p["off", "ref"], rel=1e-9)
    assert points.loc[tis, "p_holm_vs_ref"] == pytest.approx(2 * p["tis", "ref"], rel=1e-9)
    assert points.loc[tis, "p_holm_vs_off"] == pytest.approx(2 * p["tis", "ref"], rel=1e-9)
    # detectable: the δ at which the paired test has 80% power, and 1% less has less (off − ref: s = sqrt(0.0075),
    # 3 pairs; tis − off: s = sqrt(0.02), 2 pairs)
    for detectable, s, n in ((points.loc[off, "detectable_vs_ref"], math.sqrt(0.0075), 3),
                             (points.loc[tis, "detectable_vs_off"], math.sqrt(0.02), 2)):
        assert _power(detectable, s, n) == pytest.approx(0.80, abs=1e-6) and _power(0.99 * detectable, s, n) < 0.80
    assert points.loc[tis, "pairs_vs_ref"] == 2 and not points["shown_holm_vs_ref"].any()
    note, comparisons = headline_markdown(points, KEPT).split("\n\n")[1:]
    rows = [row.strip("| ").split(" | ") for row in comparisons.splitlines()[2:]]
    assert [r[:4] for r in rows] == [["w4a8", "off", "reference", "3"], ["w4a8", "tis", "reference", "2"],
                                     ["w4a8", "tis", "uncorrected (same dose)", "2"]]
    assert rows[0][8:] == ["0.283", f"{p['off', 'ref']:.3f}",  # detectable: 5.6535 · sqrt(0.0075 / 3)
                           f"{3 * p['off', 'ref']:.3f}", "no"]


def test_a_comparison_with_one_pair_has_no_test_and_says_so(tmp_path):
    runs = [_cell(tmp_path, "fp32", "off", seed, k3=2e-9, kept=(0.25, 0.25 + 0.1 * seed)) for seed in (1, 2)]
    runs += [_cell(tmp_path, "int8", "off", seed, bits="4", k3=1.0, kept=(0.25, 0.3)) for seed in (1, 2)]
    runs.append(_cell(tmp_path, "int8", "tis", 1, bits="4", k3=1.0, kept=(0.25, 0.45)))  # seed 1 only
    facts = run_facts(runs)
    points = dose_response(facts, run_gains(facts), KEPT)
    tis = points.index[2]
    assert points.loc[tis, "pairs_vs_ref"] == 1 and points.loc[tis, "difference_vs_ref"] == pytest.approx(0.1)
    for column in ("p_vs_ref", "detectable_vs_ref", "p_holm_vs_ref", "p_vs_off", "p_holm_vs_off"):
        assert math.isnan(points.loc[tis, column]), column
    note, comparisons = headline_markdown(points, KEPT).split("\n\n")[1:]
    assert "**1 in the family**" in note and "Fewer than 2 pairs in 2 of them" in note
    tis_row = comparisons.splitlines()[3].strip("| ").split(" | ")
    assert tis_row[:4] == ["w4a8", "tis", "reference", "1"] and tis_row[8:] == ["n/a (1 pair)"] * 3 + ["no"]


def test_a_shown_difference_survives_holm_only_when_its_adjusted_p_is_below_005():
    # the hand case p = 0.01, 0.04, 0.03 (m = 3) -> 0.03, 0.06, 0.06: only the first survives; the second setting's
    # comparison against the uncorrected one has one pair (no p-value), so it is not in the family
    table = pd.DataFrame({"p_vs_ref": [0.01, 0.04, 0.03], "shown_vs_ref": [True, True, False],
                          "p_vs_off": [np.nan, np.nan, np.nan], "shown_vs_off": [np.nan, False, np.nan]})
    got = holm_family(table)
    np.testing.assert_allclose(got["p_holm_vs_ref"], [0.03, 0.06, 0.06])
    assert got["shown_holm_vs_ref"].tolist() == [True, False, False] and not got["shown_holm_vs_off"].any()
    assert got["p_holm_vs_off"].isna().all()


def test_without_kept_scores_the_engine_is_the_headline_and_says_so(tmp_path):
    facts = run_facts(_study(tmp_path, kept=False))
    gains = run_gains(facts)
    assert set(gains["source"]) == {ENGINE} and headline_source(gains) == ENGINE
    text = headline_markdown(dose_response(facts, gains, ENGINE), ENGINE)
    assert "held-out gain (rollout engine)" in text.splitlines()[0]
    _kept(facts["path"].iloc[0], 0.2, 0.4)  # one run with a kept score: the others would mix sources
    with pytest.warns(UserWarning, match="only 1 of 8 runs"):
        assert headline_source(run_gains(facts)) == ENGINE


def test_the_headline_table_and_figure(tmp_path):
    facts = run_facts(_study(tmp_path))
    gains = run_gains(facts)
    points = dose_response(facts, gains, KEPT)
    assert points["k3_mean"].tolist() == pytest.approx([2e-9, 1.0, 0.8])
    text, note, comparisons = headline_markdown(points, KEPT).split("\n\n")
    rows = text.splitlines()[2:]
    assert len(rows) == 3 and rows[0].startswith("| none | off | 3 | 2e-09 | +0.250 | [+0.126, +0.374]")
    assert "**3 in the family**" in note and comparisons.splitlines()[0].count("|") == 13
    cells = [row.strip("| ").split(" | ") for row in rows]
    assert len(text.splitlines()[0].split(" | ")) == len(cells[0]) == 14
    assert cells[0][8] == "n/a"  # the reference has no difference from itself
    assert cells[1][8] == "-0.150"
    assert rows[2].startswith("| w4a8 | tis | 2 | 0.8 | +0.100 |")
    assert cells[0][11:] == cells[1][11:] == ["n/a"] * 3  # uncorrected settings have no uncorrected baseline
    assert cells[2][11:13] == ["+0.050", f"[{0.05 - T1 * 0.1:+.3f}, {0.05 + T1 * 0.1:+.3f}]"] and cells[2][13] == "no"
    fig = plot_dose_response(points, KEPT, reference_setting(facts))
    ax = fig.axes[0]
    assert ax.get_xscale() == "log" and {t.get_text() for t in ax.get_legend().get_texts()} >= {"off", "tis"}
    off_line = next(c for c in ax.containers if c.get_label() == "off").lines[0]
    np.testing.assert_allclose(off_line.get_xydata(), [[2e-9, 0.25], [1.0, 0.1]])  # sorted by k3
    labels = {a.get_text(): a.xy[0] for a in ax.texts}  # each dose named once, at its points' geometric mean k3
    assert labels == pytest.approx({"none": 2e-9, "w4a8": math.sqrt(1.0 * 0.8)})
    bars = plot_gains({KEPT: setting_gains(gains, KEPT), ENGINE: setting_gains(gains, ENGINE)}).axes[0]
    hatched = [p.get_hatch() for p in bars.patches[:3]]
    assert hatched == [None, "//", "//"]  # only the reference's gain is shown


def test_the_report_lists_settings_not_runs_and_keeps_per_run_detail(tmp_path):
    runs = _study(tmp_path)
    shown = []
    with warnings.catch_warnings():
        warnings.simplefilter("error", RunStoreWarning)
        result = show_comparison([str(tmp_path / "cells")], {"bad": "cell 3: ValueError: x"}, display=shown.append)
    assert shown[0].to_dict() == {"error": {"bad": "cell 3: ValueError: x"}}  # failures first
    assert result["setting_diff"].shape[1] == 3 and result["config_diff"].shape[1] == len(runs) == 8
    assert result["source"] == KEPT and "| none | off | 3 |" in result["headline"]
    curves = next(fig for fig in shown if getattr(fig, "legends", None) and "band" in fig._suptitle.get_text())
    reward = next(ax for ax in curves.axes if ax.get_title() == "reward")
    assert len(reward.lines) == 3 and len(reward.collections) == 3  # one line and one band per setting
    np.testing.assert_allclose(reward.lines[0].get_ydata(), [0.12, 0.22, 0.32])  # mean over seeds 1-3
    assert [t.get_text() for t in curves.legends[0].get_texts()][2].endswith("(2 seeds)")
    texts = [getattr(obj, "data", "") for obj in shown]
    assert texts.index("### Per-run detail") > texts.index(result["headline"])


def test_settings_outside_a_dose_grid_are_named_by_the_sweep_label_or_their_flags(tmp_path):
    runs = [_cell(tmp_path, "int8", "tis", seed) for seed in (1, 2)]  # one setting: its sweep label names it
    runs.append(_cell(tmp_path / "other", "int8", "tis", 1))  # the same dose and correction under another lr:
    config = json.loads((runs[2] / "config.json").read_text())
    config["config"]["lr"] = 1e-3
    (runs[2] / "config.json").write_text(json.dumps(config))
    labels = ["rollout_precision=int8_correction=tis_seed=1", "rollout_precision=int8_correction=tis_seed=2",
              "lr_sweep_seed=1"]
    facts = run_facts(runs, labels)
    assert facts["setting"].tolist() == ["rollout_precision=int8_correction=tis"] * 2 + ["lr_sweep"]


def test_plain_run_names_are_grouped_by_config_and_named_by_their_flags(tmp_path):
    runs = []
    for name, seed, lr in (("a", 1, 1e-3), ("b", 2, 1e-3), ("c", 1, 2e-3)):
        writer = RunWriter(tmp_path / name, config={"lr": lr, "train.seed": seed}, origin={})
        writer.append_metrics(1, {"mismatch/k3_kl": 0.1})
        runs.append(tmp_path / name)
    facts = run_facts(runs)
    assert facts["setting"].tolist() == ["lr=0.001", "lr=0.001", "lr=0.002"] and facts["seed"].tolist() == [1, 2, 1]


def test_a_setting_missing_from_one_source_is_drawn_as_not_shown(tmp_path):
    facts = run_facts(_study(tmp_path))
    gains = run_gains(facts)
    kept = setting_gains(gains, KEPT)
    bars = plot_gains({KEPT: kept.iloc[:1], ENGINE: setting_gains(gains, ENGINE)}).axes[0]
    assert len(bars.patches) == 6 and [p.get_hatch() for p in bars.patches[:3]] == [None, "//", "//"]
    assert [t.get_text() for t in bars.get_xticklabels()] == list(kept.index)
