"""Curves, bucket tables, run comparison and the live view, on hand-written run stores."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from openrlhf_tis.metric_names import BUCKET_NAMES
from openrlhf_tis.pipeline.live import LiveCurves, step_line
from openrlhf_tis.pipeline.report import KEPT_POLICY, held_out_label, show_comparison, show_run
from openrlhf_tis.runs import RunWriter, summary
from openrlhf_tis.runs.layout import unique_dir_name
from openrlhf_tis.viz.compare import config_diff, final_table, resolve_runs, run_facts, run_labels
from openrlhf_tis.viz.curves import PANELS, bucket_table, panel_keys, plot_buckets, plot_curves, run_styles

B0, B1 = BUCKET_NAMES[0], BUCKET_NAMES[-1]


def _records(n=10, **extra):
    return [{"step": s, "rollout/reward_mean": s / 10, "mismatch/k3_kl": 1e-3 * s, "timing/step_total": 2.0,
             **{k: (v(s) if callable(v) else v) for k, v in extra.items()}} for s in range(1, n + 1)]


def _write_run(path, records, config):
    writer = RunWriter(path, config=config, origin={})
    for record in records:
        writer.append_metrics(record["step"], {k: v for k, v in record.items() if k != "step"})
    return path


def test_bucket_table_weights_each_step_by_its_token_share():
    records = [{"step": 1, f"mismatch/abs_dlogp_{B0}": 0.4, f"mismatch/frac_{B0}": 0.1,
                f"mismatch/abs_dlogp_{B1}": 0.01, f"mismatch/frac_{B1}": 0.9},
               {"step": 2, f"mismatch/abs_dlogp_{B0}": 0.1, f"mismatch/frac_{B0}": 0.3,
                f"mismatch/abs_dlogp_{B1}": float("nan"), f"mismatch/frac_{B1}": 0.0}]
    table = bucket_table(records).set_index("bucket")
    # bucket 0 holds 0.1 and 0.3 of two equal-sized steps: (0.4*0.1 + 0.1*0.3) / 0.4
    assert table.loc[B0, "mean_abs_dlogp"] == pytest.approx(0.07 / 0.4)
    assert table.loc[B0, "token_share"] == pytest.approx(0.2)
    assert table.loc[B1, "mean_abs_dlogp"] == pytest.approx(0.01)  # the empty step adds nothing
    assert len(table) == 2  # buckets the run never logged are left out


def test_panels_draw_the_first_logged_alternative_and_say_when_nothing_is_logged():
    frame = pd.DataFrame(_records(3, reward=0.5, vllm_kl=1.0, **{"eval/default_pass1": 0.2}))
    reward, held_out = PANELS[0], PANELS[1]
    assert panel_keys(frame, reward) == ["rollout/reward_mean"]  # not also the upstream synonym
    assert panel_keys(frame, held_out) == ["eval/default_pass1"]
    fig = plot_curves(frame)
    texts = {t.get_text() for ax in fig.axes for t in ax.texts}
    assert "not logged" in texts  # e.g. the IS-weight panel: this run logs no correction/*
    frame.loc[0, "eval_start/default_pass1"] = 0.1
    held_ax = next(ax for ax in plot_curves(frame).axes if ax.get_title() == "held-out reward")
    np.testing.assert_allclose(held_ax.lines[0].get_xydata(), [[0, 0.1], [1, 0.2], [2, 0.2], [3, 0.2]])
    reward_ax = next(ax for ax in fig.axes if ax.get_title() == "reward")
    np.testing.assert_allclose(reward_ax.lines[0].get_ydata(), [0.1, 0.2, 0.3])


def test_overlaid_runs_get_one_line_each():
    fig = plot_curves({"a": _records(4), "b": _records(2)})
    k3 = next(ax for ax in fig.axes if ax.get_title().startswith("k3"))
    assert [len(line.get_xdata()) for line in k3.lines] == [4, 2] and k3.get_yscale() == "log"
    assert len(plot_buckets({"a": bucket_table(_records(2))}).axes[0].texts) == 1  # "no bucket metrics logged"


def test_run_labels_drop_the_sweeps_digest_and_fall_back_to_parent_and_name():
    cells = [Path("sweep/cells") / unique_dir_name(f"correction=tis,seed={seed}") / "run" for seed in (1, 2)]
    assert run_labels(cells) == ["correction=tis_seed=1", "correction=tis_seed=2"]  # the sweep's own names
    stamped = [Path("x/runs/20261125-0101"), Path("y/runs/20261125-0202")]
    assert run_labels(stamped) == ["20261125-0101", "20261125-0202"]
    twins = [Path("a/c-0123abcd/run"), Path("b/c-89abcdef/run")]  # the same cell name under two sweeps
    assert run_labels(twins) == ["c-0123abcd/run", "c-89abcdef/run"]
    assert run_labels([Path("a/c/run"), Path("b/c/run")]) == ["a/c/run", "b/c/run"]


def test_many_runs_share_one_legend_and_seeds_of_a_setting_share_a_colour():
    names = ["int8_tis_seed=1", "int8_tis_seed=2", "int8_off_seed=1", "seed=2", "seed=3"]
    styles = run_styles(names)
    assert styles[names[0]]["color"] == styles[names[1]]["color"] != styles[names[2]]["color"]
    assert styles[names[0]]["linestyle"] != styles[names[1]]["linestyle"]
    assert styles["seed=2"]["color"] == styles["seed=3"]["color"] != styles[names[0]]["color"]
    assert len({tuple(style["color"]) for style in run_styles([f"c{i}" for i in range(14)]).values()}) == 14
    fig = plot_curves({name: _records(3) for name in names})
    assert not any(ax.get_legend() for ax in fig.axes)  # per-panel legends of many runs hid the curves
    (legend,) = fig.legends
    assert [text.get_text() for text in legend.get_texts()] == names
    reward = next(ax for ax in fig.axes if ax.get_title() == "reward")
    assert [line.get_color() for line in reward.lines] == [styles[name]["color"] for name in names]


def test_final_table_against_hand_computed_values():
    records = _records(10, **{"correction/masked_frac": lambda s: 0.1 * (s % 2), "mismatch/abs_dp_max":
                              lambda s: s / 100, "eval/default_pass1": lambda s: 0.8 if s == 10 else np.nan,
                              "eval/default_seconds": 3.0})
    records[0]["eval_start/default_pass1"] = 0.3  # the untrained policy, logged on step 1's line
    row = final_table({"r": pd.DataFrame(records)}).loc["r"]
    assert row["held_out_first"] == pytest.approx(0.3) and row["held_out_first_step"] == 0
    assert row["steps"] == 10 and row["reward_first"] == pytest.approx(0.1) and row["reward_last"] == pytest.approx(1.0)
    assert row["held_out_last"] == pytest.approx(0.8)
    assert row["k3_kl_mean"] == pytest.approx(5.5e-3) and row["abs_dp_max"] == pytest.approx(0.1)
    assert row["masked_frac_mean"] == pytest.approx(0.05) and math.isnan(row["truncated_frac_mean"])


def test_comparison_shows_only_the_flags_that_differ(tmp_path):
    a = _write_run(tmp_path / "a" / "run", _records(3), {"lr": 1e-3, "seed": 1, "logger.run_dir": "x", "same": [1]})
    b = _write_run(tmp_path / "b" / "run", _records(2), {"lr": 1e-3, "seed": 2, "logger.run_dir": "y", "same": [1],
                                                         "new": True})
    assert run_labels([a, b]) == ["a", "b"]
    diff = config_diff([a, b])
    assert diff.to_dict(orient="index") == {"new": {"a": "(absent)", "b": True}, "seed": {"a": 1, "b": 2}}
    shown = []
    result = show_comparison([str(tmp_path / "*" / "run")], {"c": "cell 3: ValueError: x"}, display=shown.append)
    assert result["runs"] == [a, b] and list(result["table"].index) == ["a", "b"]
    assert shown[0].to_dict() == {"error": {"c": "cell 3: ValueError: x"}}  # failures come first


def test_runs_recorded_before_and_after_the_run_spec_are_one_setting(tmp_path):
    """A study resumed under a version that records the run spec (cli/resolve.py) keeps its settings whole: the legacy
    record (the decided device in `cluster.device`, the machine, the resolved correction) and the spec's (the asked
    device in `cluster.device`, the decision in `fork.spec.*`) describe the same experiment. A device that differs
    still differs."""
    flags = {"algo.correction.preset": "tis", "vllm.rollout_precision": "bf16", "ds.param_dtype": "bf16"}
    legacy = {**flags, "seed": 1, "cluster.device": "cpu", "cluster.resources": "this machine (GPU: 0, CPU: 2)",
              "algo.correction.resolved": '{"mode": "truncate"}'}
    spec = {**flags, "seed": 2, "cluster.device": "auto", "fork.spec.cluster.device": "cpu",
            "fork.spec.cluster.resources": "another machine (GPU: 0, CPU: 4)", "fork.spec.correction.mode": "truncate"}
    runs = [_write_run(tmp_path / name / "run", _records(2), config) for name, config in
            (("seed=1", legacy), ("seed=2", spec), ("cuda", {**spec, "seed": 3, "fork.spec.cluster.device": "cuda"}))]
    diff = config_diff(runs)
    assert diff.to_dict(orient="index") == {"cluster.device": {"seed=1": "cpu", "seed=2": "cpu", "cuda": "cuda"},
                                            "seed": {"seed=1": 1, "seed=2": 2, "cuda": 3}}
    assert config_diff(runs[:2]).index.tolist() == ["seed"]
    facts = run_facts(runs[:2])
    assert facts["setting"].nunique() == 1 and sorted(facts["seed"]) == [1, 2]


def test_resolve_runs_names_what_it_could_not_find(tmp_path):
    run = _write_run(tmp_path / "r", _records(1), {})
    assert resolve_runs(tmp_path) == [run] == resolve_runs(str(tmp_path / "r*"))
    with pytest.raises(FileNotFoundError, match="nothing-here"):
        resolve_runs([str(run), str(tmp_path / "nothing-here")])


def test_live_curves_redraw_only_when_steps_land():
    class Handle:
        def __init__(self):
            self.updates = 0

        def update(self, obj):
            self.updates += 1
            self.last = obj

    handle, shown = Handle(), []

    def display(obj, display_id=False):
        shown.append(obj)
        return handle

    live = LiveCurves(3, display=display)
    records = _records(3)
    live([])
    live(records[:1])
    live(records[:1])
    live(records)
    live.close()
    assert len(shown) == 1 and handle.updates == 1 and live.drawn == 3
    with live:  # a finished run: the live figure gives way to a note (the final curves follow)
        pass
    assert handle.updates == 2 and "3 steps trained" in handle.last.data
    with pytest.raises(RuntimeError), live:  # a failed run keeps its last live figure
        raise RuntimeError("training failed")
    assert handle.updates == 2
    assert step_line(records[1], 3).startswith("step 2/3  reward 0.200  k3 2.00e-03")


def test_step_line_shows_the_lag_only_when_there_is_one():
    record = {"step": 4, "rollout/reward_mean": 0.5, "timing/step_total": 3.0}
    assert "lag" not in step_line({**record, "staleness/mean": 0.0, "staleness/max": 0.0}, 8)
    stale = {**record, "staleness/mean": 0.75, "staleness/max": 2.0}
    assert "  lag 0.75 (k3 lag 0 -, stale -)  3.0 s" in step_line(stale, 8)
    split = {**stale, "mismatch_by_lag/k3_lag_0": 0.002, "mismatch_by_lag/k3_lag_stale": 0.05}
    assert "  lag 0.75 (k3 lag 0 2.00e-03, stale 5.00e-02)  3.0 s" in step_line(split, 8)  # precision vs staleness


def test_step_line_shows_the_routing_mismatch_only_in_a_replay_run():
    record = {"step": 4, "correction/masked_frac": 0.0, "timing/step_total": 3.0}
    assert "routing" not in step_line(record, 8)
    line = step_line({**record, "moe/routing_agreement": 0.995, "moe/k3_routing_differed": 2e-4,
                      "moe/k3_routing_same": float("nan")}, 8)
    assert "masked 0.000  routing 0.995 (k3 differed 2.00e-04, same nan)  3.0 s" in line


def test_step_line_and_curves_show_the_adaptive_cap_only_where_it_runs():
    record = {"step": 4, "correction/masked_frac": 0.0, "timing/step_total": 3.0}
    assert "cap" not in step_line(record, 8)
    line = step_line({**record, "correction/adaptive_bound": 1.75, "correction/adaptive_ess": 0.9}, 8)
    assert "masked 0.000  cap 1.75 (ess 0.900)  3.0 s" in line
    panel = next(p for p in PANELS if p.title.startswith("adaptive"))
    frame = pd.DataFrame({"step": [1, 2], "correction/adaptive_bound": [5.0, 1.5], "correction/adaptive_ess": [1, 0.9]})
    assert panel_keys(frame, panel) == ["correction/adaptive_bound", "correction/adaptive_ess"]
    assert panel_keys(pd.DataFrame({"step": [1]}), panel) == []


def test_step_line_flags_the_fall_warning_once_it_fired():
    record = {"step": 4, "timing/step_total": 3.0, "health/ess_seq_worst": 0.08, "health/fall_warning": 0.0}
    assert "FALL RISK" not in step_line(record, 8)
    assert step_line({**record, "health/fall_warning": 1.0}, 8).endswith("3.0 s  FALL RISK (ESS 0.08)")


def test_staleness_is_drawn_for_async_runs():
    frame = pd.DataFrame({"step": [1, 2, 3], "staleness/mean": [0.0, 0.5, 1.0], "staleness/max": [0.0, 1.0, 2.0]})
    panel = next(p for p in PANELS if p.title.startswith("staleness"))
    assert panel_keys(frame, panel) == ["staleness/mean", "staleness/max"]
    assert panel_keys(pd.DataFrame({"step": [1]}), panel) == []  # runs from before async support: no panel data


def test_the_run_report_draws_each_figure_once_and_names_the_scored_policy(tmp_path):
    records = _records(10, **{"eval/default_pass1": lambda s: 0.8 if s == 10 else np.nan})
    records[0]["eval_start/default_pass1"] = 0.3
    run = _write_run(tmp_path / "run", records, {"vllm.rollout_precision": "int8"})
    shown = []
    result = show_run(run, display=shown.append)
    assert [type(obj).__name__ for obj in shown] == ["Figure", "Figure", "DataFrame"]  # curves, buckets, table
    table = result["shown"]
    assert list(table.columns) == ["value"]  # one quantity a row: as narrow as its longest label
    assert table.loc["held-out · rollout engine (int8) · before training", "value"] == "0.3"
    assert table.loc["held-out · rollout engine (int8) · last evaluation", "value"] == "0.8"
    assert table.loc["reward · last tenth of steps", "value"] == "1" and table.loc["steps", "value"] == "10"
    # the labels another policy's rows (the trainer's kept weights) take
    kept = "held-out · kept policy (trainer weights) · last evaluation"
    assert held_out_label(KEPT_POLICY, "last evaluation") == kept


def test_the_run_report_has_the_kept_policys_score_that_the_console_prints(tmp_path):
    """Regression: the table had the rollout engine's held-out score but not the kept policy's."""
    import json

    from openrlhf_tis.pipeline.main_job import describe

    records = _records(4, **{"eval/default_pass1": lambda s: 0.4 if s == 4 else np.nan})
    records[0]["eval_start/default_pass1"] = 0.2
    run = _write_run(tmp_path / "run", records, {"vllm.rollout_precision": "int8"})
    (run / "heldout_kept.json").write_text(json.dumps({
        "schema": 1, "policy": "trainer weights", "dtype": "fp32", "n_samples": 4, "questions": 64, "seed": 1,
        "before": {"pass1": 0.23, "passk": 0.5}, "after": {"pass1": 0.5, "passk": 0.75}}))
    labels = list(show_run(run, display=lambda _: None)["shown"]["value"].items())
    at = labels.index(("held-out · rollout engine (int8) · last evaluation", "0.4"))
    assert labels[at + 1:at + 3] == [("held-out · kept policy (trainer weights, fp32) · base model", "0.23"),
                                     ("held-out · kept policy (trainer weights, fp32) · saved final model", "0.5")]
    console = describe({"summary": summary(run), "rollout_precision": "int8", "run_dir": run, "html": "r.html"})
    assert "kept policy (trainer weights, fp32) (base model -> saved final model): 0.230 -> 0.500" in console
    (run / "heldout_kept.json").unlink()  # a run scored by the engine only keeps the table it had
    assert not any("kept policy" in label for label, _ in show_run(run, display=lambda _: None)["shown"].iterrows())


def test_the_comparison_table_headings_wrap_and_name_the_policy(tmp_path):
    for name, precision in (("a", "int8"), ("b", "bf16")):
        _write_run(tmp_path / name / "run", _records(2), {"vllm.rollout_precision": precision})
    shown = []
    show_comparison([str(tmp_path / "*" / "run")], display=shown.append)
    # the per-run final table comes last (the seed-averaged one, by setting, is shown before it)
    table = [obj for obj in shown if isinstance(obj, pd.DataFrame) and "steps" in obj.columns][-1]
    assert all(" " in heading or heading == "steps" for heading in table.columns)  # a browser can wrap them
    assert "held-out · rollout engine (each run's rollout precision) · last evaluation" in table.columns
