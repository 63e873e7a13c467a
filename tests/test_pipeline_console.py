"""The console view of a run: one line per step as steps land, and the main job's closing summary."""

from __future__ import annotations

import io
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
    text = describe({"summary": summary(tmp_path), "run_dir": tmp_path, "html": tmp_path / "report.html",
                     "held_out": ("eval/default_pass1", 0.25, 0.5)})
    assert "reward (first -> last tenth of steps): 0.100 -> 1.000" in text
    assert "held-out eval/default_pass1 (before training -> last evaluation): 0.250 -> 0.500" in text
    assert "masked fraction (last): 0.020" in text and f"report: {tmp_path / 'report.html'}" in text


def test_set_values_are_python_literals_or_plain_words():
    assert _literal("steps=5") == ("steps", 5) and _literal("correction=tis") == ("correction", "tis")
    assert _literal("extra_args=['--a', '1']") == ("extra_args", ["--a", "1"])
