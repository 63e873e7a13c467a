"""The console view of a run: one line per step as steps land, and the main job's closing summary."""

from __future__ import annotations

import io
import json
import threading

from openrlhf_tis.pipeline.console import follow_run
from openrlhf_tis.pipeline.main_job import _literal, describe
from openrlhf_tis.runs import RunWriter, summary


def test_each_step_is_printed_once_as_it_lands(tmp_path):
    writer, done, out = RunWriter(tmp_path), threading.Event(), io.StringIO()
    writer.append_metrics(1, {"rollout/reward_mean": 0.25, "mismatch/k3_kl": 2e-3})

    def train():
        writer.append_metrics(2, {"rollout/reward_mean": 0.5, "timing/step_total": 1.5})
        done.set()

    threading.Timer(0.2, train).start()
    records = follow_run(tmp_path, 2, done, poll_seconds=0.05, out=out)
    lines = [line for line in out.getvalue().splitlines() if line.startswith("step ")]
    assert [r["step"] for r in records] == [1, 2]
    assert lines == ["step 1/2  reward 0.250  k3 2.00e-03  max|Δp| -  masked -  - s",
                     "step 2/2  reward 0.500  k3 -  max|Δp| -  masked -  1.5 s"]


def test_the_summary_says_where_reward_went_and_where_the_report_is(tmp_path):
    writer = RunWriter(tmp_path)
    for step in range(1, 11):
        writer.append_metrics(step, {"rollout/reward_mean": step / 10, "correction/masked_frac": 0.02})
    result = {"summary": summary(tmp_path), "run_dir": tmp_path, "html": tmp_path / "report.html",
              "held_out": ("eval/default_pass1", 0.25, 0.5), "rollout_precision": "int8"}
    text = describe(result)
    assert "reward (first -> last tenth of steps): 0.100 -> 1.000" in text
    assert ("held-out eval/default_pass1, rollout engine (int8) (before training -> last evaluation): "
            "0.250 -> 0.500") in text
    assert "kept policy" not in text  # not scored: no row
    assert "masked fraction (last): 0.020" in text and f"report: {tmp_path / 'report.html'}" in text
    # The kept policy's score, when pipeline/kept_eval.py wrote it, is a row of its own, named by what it scored.
    kept = {"schema": 1, "policy": "trainer weights", "dtype": "fp32", "n_samples": 2, "seed": 1, "questions": 3,
            "before": {"pass1": 0.5, "passk": 2 / 3}, "after": {"pass1": 0.75, "passk": 1.0}}
    (tmp_path / "heldout_kept.json").write_text(json.dumps(kept))
    text = describe({**result, "summary": summary(tmp_path)})
    assert ("held-out pass1, kept policy (trainer weights, fp32) (base model -> saved final model): 0.500 -> 0.750 "
            "(3 questions x 2)") in text
    assert "rollout engine (int8) (before training -> last evaluation): 0.250 -> 0.500" in text
    assert summary(tmp_path)["held_out_kept"] == {
        "label": "kept policy (trainer weights, fp32)", "n_samples": 2, "questions": 3, "pass1_before": 0.5,
        "passk_before": 2 / 3, "pass1_after": 0.75, "passk_after": 1.0}


def test_set_values_are_python_literals_or_plain_words():
    assert _literal("steps=5") == ("steps", 5) and _literal("correction=tis") == ("correction", "tis")
    assert _literal("extra_args=['--a', '1']") == ("extra_args", ["--a", "1"])
