"""Where two runs part ways (runs/repeat.py): hand-made metrics lines."""

from __future__ import annotations

from openrlhf_tis.runs.repeat import first_divergence, is_timing


def test_timings_are_left_out_and_the_first_differing_step_is_named():
    a = [{"step": 1, "loss": 0.5, "wall_time": 1.0, "timing/queue_wait": 2.0, "sync/weights_s": 0.1},
         {"step": 2, "loss": 0.4, "correction/ess": 0.99, "eval/seconds": 3.0},
         {"step": 3, "loss": 0.3}]
    b = [{"step": 1, "loss": 0.5, "wall_time": 9.0, "timing/queue_wait": 7.0, "sync/weights_s": 0.3},
         {"step": 2, "loss": 0.4, "correction/ess": 0.98, "eval/seconds": 1.0},
         {"step": 3, "loss": 0.2}]
    found = first_divergence(a, b)
    assert found.step == 2 and found.metrics == {"correction/ess": (0.99, 0.98)} and found.steps_compared == 3
    assert first_divergence(a, b, rtol=0.02).step == 3  # 0.99 vs 0.98 is within 2%
    assert first_divergence(a, a).step is None


def test_a_metric_missing_on_one_side_is_a_difference_and_nan_equals_nan():
    assert first_divergence([{"step": 1, "x": 1.0}], [{"step": 1}]).metrics == {"x": (1.0, None)}
    assert first_divergence([{"step": 1, "x": float("nan")}], [{"step": 1, "x": float("nan")}]).step is None


def test_what_counts_as_a_timing():
    assert all(map(is_timing, ["wall_time", "timing/step", "sync/check_s", "eval/seconds", "generate_time"]))
    assert not any(map(is_timing, ["loss", "correction/ess", "mismatch/k3_kl", "response_length", "steps"]))
