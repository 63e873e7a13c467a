"""The fall warning (runs/health.py) against hand-worked cases and the prefix minimum it must equal for any input;
the controller's HealthPart writes it on each line and a resumed run's watch starts where the kept lines left it."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from openrlhf_tis.metric_names import ESS_SEQ, HEALTH_ESS_WORST, HEALTH_FALL_WARNING
from openrlhf_tis.runs.health import FALL_WARNING_ESS, FallWatch, health_label, watch_records
from openrlhf_tis.runs.store import RunWriter
from openrlhf_tis.trainer.step_part import HealthPart


def _lines(values):
    return [{"step": i, ESS_SEQ: v} for i, v in enumerate(values, 1)]


def test_warns_from_the_first_step_below_the_bound_and_stays_warned():
    watch = FallWatch()
    out = [watch.update(r["step"], r) for r in _lines([0.9, 0.5, 0.1, 0.4])]
    assert [o[HEALTH_ESS_WORST] for o in out] == [0.9, 0.5, 0.1, 0.1]
    assert [o[HEALTH_FALL_WARNING] for o in out] == [0.0, 0.0, 1.0, 1.0]
    assert watch.warned_at == 3
    assert watch_records(_lines([0.9, 0.5, 0.1, 0.4])) == watch


def test_no_health_metrics_before_the_first_finite_ess():
    watch = FallWatch()
    assert watch.update(1, {"step": 1, "reward": 0.5}) == {}
    assert watch.update(2, {"step": 2, ESS_SEQ: math.nan}) == {}
    assert watch.update(3, {"step": 3, ESS_SEQ: 0.8}) == {HEALTH_ESS_WORST: 0.8, HEALTH_FALL_WARNING: 0.0}


@given(st.lists(st.one_of(st.none(), st.floats(0.0, 1.0)), max_size=30))
def test_worst_is_the_prefix_minimum_and_the_warning_its_crossing(values):
    watch = FallWatch()
    for step, value in enumerate(values, 1):
        out = watch.update(step, {"step": step} if value is None else {"step": step, ESS_SEQ: value})
        seen = [v for v in values[:step] if v is not None]
        if not seen:
            assert out == {}
            continue
        assert out[HEALTH_ESS_WORST] == min(seen)
        assert out[HEALTH_FALL_WARNING] == float(min(seen) < FALL_WARNING_ESS)


def test_labels():
    assert health_label([{"step": 1, "reward": 0.1}]) is None
    assert health_label(_lines([0.9, 0.8])) == "ok"
    assert health_label(_lines([0.9, 0.05, 0.5])) == "fall risk since step 2 (ESS 0.05)"


def test_the_part_adds_health_to_each_line_and_a_resume_starts_from_the_kept_lines(tmp_path):
    writer = RunWriter(tmp_path)
    for record in _lines([0.9, 0.05, 0.7]):
        writer.append_metrics(record["step"], record)
    part = HealthPart(str(tmp_path))
    part.on_start(1)  # resumed from step 1's checkpoint: steps 2-3 are trained again, their lines do not count
    logs = {ESS_SEQ: 0.6}
    part.on_log(2, logs)
    assert logs[HEALTH_ESS_WORST] == 0.6 and logs[HEALTH_FALL_WARNING] == 0.0
    part.on_start(2)  # from step 2's: its 0.05 counts
    logs = {ESS_SEQ: 0.6}
    part.on_log(3, logs)
    assert logs[HEALTH_ESS_WORST] == 0.05 and logs[HEALTH_FALL_WARNING] == 1.0
    empty = {}
    part.on_log(4, empty)
    assert empty == {}  # an empty status (no step trained) gets no line
