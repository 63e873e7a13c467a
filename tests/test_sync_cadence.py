"""A fixed staleness dose (trainer/sync_cadence.py): syncs after every K-th step, so step s+1's samples are s mod K
versions behind π_old, checked through the controller's own hooks and the per-sample lag stamps."""

from __future__ import annotations

import pytest

from openrlhf_tis.trainer.staleness import sample_lags
from openrlhf_tis.trainer.sync_cadence import SyncCadencePart, lag_of_step


class _Sample:
    def __init__(self, version: int):
        import torch

        from openrlhf_tis.rollout.versions import VERSION_FIRST

        self.info = {VERSION_FIRST: torch.tensor([float(version)])}


def _lags_under(every: int, steps: int, start: int = 0) -> list[int]:
    """Drive the part as the controller does: start, then for each step roll out with the engines' version, fit,
    and sync when due; the lag each step's samples get from trainer/staleness.py."""
    part = SyncCadencePart(every)
    part.on_start(start)
    engines = start  # the start's sync always happens
    lags = []
    for step in range(start + 1, start + steps + 1):
        lags.append(sample_lags([_Sample(engines)], trainer_version=step - 1)[0])
        part.after_fit(step)
        if part.due:
            engines = step
    return lags


@pytest.mark.parametrize("every", [1, 2, 3, 4])
def test_a_sample_of_step_s_plus_1_is_s_mod_k_versions_behind(every):
    lags = _lags_under(every, steps=12)
    assert lags == [lag_of_step(step, every) for step in range(1, 13)]
    assert lags == [s % every for s in range(12)]  # the hand count: lags 0, 1, ..., K-1 in turn
    assert max(lags) == every - 1


def test_every_step_syncs_at_k_1_as_upstream_does():
    assert _lags_under(1, steps=5) == [0] * 5


def test_a_resume_syncs_at_its_start_then_keeps_the_cadence():
    # resumed after step 5 with K = 4: the engines get version 5 (the checkpoint's); syncs again after step 8
    assert _lags_under(4, steps=6, start=5) == [0, 1, 2, 0, 1, 2]


def test_a_cadence_below_1_is_refused():
    with pytest.raises(ValueError, match="--vllm.sync_every must be >= 1"):
        SyncCadencePart(0)


@pytest.mark.parametrize(("extra", "fault"), [
    (["--vllm.sync_every", "0"], "--vllm.sync_every: must be >= 1 (1 syncs after every step), got 0"),
    (["--vllm.sync_every", "-2"], "--vllm.sync_every: must be >= 1"),
    (["--vllm.sync_every", "2", "--train.async_enable", "--vllm.num_engines", "1"],
     "--vllm.sync_every: 2 fixes the lag of a synchronous run; async training's lag comes from its queue"),
    (["--vllm.sync_every", "2", "--vllm.num_engines", "0"], "--vllm.sync_every: 2, but the run has no vLLM engine"),
])
def test_a_cadence_that_cannot_be_honoured_is_refused_naming_the_flag(valid_argv, capsys, extra, fault):
    from _support import error_line, refused

    assert error_line(refused(valid_argv + extra, capsys)).startswith(fault)
