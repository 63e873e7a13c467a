"""Lag bookkeeping of async training (trainer/staleness.py) against hand-computed cases and properties, and
async training's flags refused before Ray starts."""

from __future__ import annotations

import pytest
import torch
from _support import refused
from hypothesis import given
from hypothesis import strategies as st
from openrlhf.trainer.ppo_utils.experience import Experience

from openrlhf_tis.cli.train_ppo_ray import check_steps_logged
from openrlhf_tis.rollout.versions import VERSION_FIRST, VERSION_LAST
from openrlhf_tis.trainer.rewards import RewardPolicy
from openrlhf_tis.trainer.staleness import (
    LAG,
    MAX_LAG_FLAG,
    StalenessError,
    drop_stale,
    sample_lags,
    spans_sync,
    staleness_metrics,
    stamp_lags,
)


def _samples(versions: list[tuple[int, int] | None]) -> list[Experience]:
    """One Experience per sample, stamped as upstream's samples generator turns the engine's extra_logs into info."""
    out = []
    for i, v in enumerate(versions):
        info = {"reward": torch.tensor([1.0])}
        if v is not None:
            info[VERSION_FIRST], info[VERSION_LAST] = torch.tensor([float(v[0])]), torch.tensor([float(v[1])])
        out.append(Experience(rewards=torch.tensor([1.0]), prompts=[f"q{i // 2}"], labels=["1"], info=info))
    return out


def test_lags_by_hand():
    # trainer at step 5 (π_old = version 5): samples generated at versions 5, 4, 3 (one spanning 3 -> 5)
    samples = _samples([(5, 5), (4, 4), (3, 5), (5, 5)])
    assert sample_lags(samples, 5) == [0, 1, 2, 0]
    assert spans_sync(samples) == [False, False, True, False]


def test_unstamped_samples_are_on_policy():
    assert sample_lags(_samples([None, None]), 7) == [0, 0]


def test_metrics_by_hand():
    metrics = staleness_metrics([0, 1, 2, 0], partial=[False, False, True, False])
    assert metrics == {"staleness/mean": 0.75, "staleness/max": 2.0, "staleness/lag_0": 0.5,
                       "staleness/lag_1": 0.25, "staleness/lag_2": 0.25, "staleness/spanning_sync": 0.25}
    assert staleness_metrics([0] * 8) == {"staleness/mean": 0.0, "staleness/max": 0.0, "staleness/lag_0": 1.0}


@given(st.lists(st.integers(0, 6), min_size=1, max_size=40))
def test_lag_shares_sum_to_one_and_match_the_mean(lags):
    metrics = staleness_metrics(lags)
    shares = {int(k.rsplit("_", 1)[1]): v for k, v in metrics.items() if k.startswith("staleness/lag_")}
    assert sum(shares.values()) == pytest.approx(1.0)
    assert sum(k * v for k, v in shares.items()) == pytest.approx(metrics["staleness/mean"])
    assert metrics["staleness/max"] == max(lags)


def test_stamp_replaces_versions_with_the_lag():
    samples = _samples([(2, 3), (3, 3)])
    stamp_lags(samples, [1, 0])
    assert [float(s.info[LAG]) for s in samples] == [1.0, 0.0]
    assert all(VERSION_FIRST not in s.info and VERSION_LAST not in s.info for s in samples)


def test_drop_removes_whole_groups_beyond_the_bound():
    samples = _samples([(3, 3), (3, 3), (2, 2), (3, 3), (3, 3), (3, 3)])  # groups of 2: group 1 holds lag 1
    lags = sample_lags(samples, 3)
    kept, kept_lags, metrics = drop_stale(samples, lags, 0, RewardPolicy("fail", 2, "r.py"), step=4)
    assert [id(s) for s in kept] == [id(samples[i]) for i in (0, 1, 4, 5)] and kept_lags == [0, 0, 0, 0]
    assert metrics == {"staleness/dropped_samples": 2.0}
    same, same_lags, metrics = drop_stale(samples, lags, 1, RewardPolicy("fail", 2, "r.py"), step=4)
    assert same is samples and same_lags == lags and metrics == {"staleness/dropped_samples": 0.0}
    assert drop_stale(samples, lags, None, RewardPolicy("fail", 2, "r.py"), step=4)[2] == {}


def test_drop_that_leaves_too_little_names_the_flag():
    samples = _samples([(1, 1)] * 4)
    rules = RewardPolicy("fail", 2, "r.py", train_micro_batch=2)
    with pytest.raises(StalenessError, match=MAX_LAG_FLAG.replace(".", r"\.")) as err:
        drop_stale(samples, sample_lags(samples, 3), 1, rules, step=4)
    assert "step 4: 4 of 4 samples" in str(err.value)


# --- flags, checked before Ray starts -------------------------------------------------------------------

@pytest.mark.parametrize(("extra", "flag", "expected"), [
    (["--train.partial_rollout_enable"], "--train.partial_rollout_enable", "applies to async training only"),
    (["--train.async_max_lag", "1"], "--train.async_max_lag", "applies to async training only"),
    (["--train.async_queue_size", "2"], "--train.async_queue_size", "applies to async training only"),
    (["--train.async_enable", "--train.async_max_lag", "-1"], "--train.async_max_lag", "must be >= 0"),
    (["--train.async_enable", "--train.async_queue_size", "0"], "--train.async_queue_size", "must be >= 1"),
])
def test_async_flags_are_refused_where_they_cannot_apply(valid_argv, capsys, extra, flag, expected):
    stderr = refused(valid_argv + extra, capsys)
    line = stderr.strip().splitlines()[-1]
    assert line.startswith(f"openrlhf_tis.cli.train_ppo_ray: error: {flag}: ") and expected in line, stderr


def test_a_run_that_logged_no_step_exits_non_zero(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        check_steps_logged(str(tmp_path))
    assert exit_info.value.code == 1 and "logged no training step" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "wall_time": 0}\n')
    check_steps_logged(str(tmp_path))  # a logged step: no exit
