"""Async training end to end on CPU (`--train.async_enable`): the fork's controller serves upstream's async
trainer, so the run store, held-out evaluation, the sync check and the token dumps work as in a synchronous
run, and every sample's lag behind the trained policy is measured. Killed mid-run (SIGKILL to the process
group) and resumed from upstream's checkpoint: every step is logged exactly once. The run takes partial rollouts
(generation paused, not locked, for each weight sync), so one run checks both."""

from __future__ import annotations

from pathlib import Path

import pytest
from _support import kill_and_resume, train_argv

from openrlhf_tis.demo.task import split, write_jsonl, write_prompts
from openrlhf_tis.runs import query_tokens, token_steps

pytestmark = pytest.mark.e2e

TOTAL_STEPS = 6
QUEUE = 2
EVAL_EVERY = 3


def _async_argv(model_dir: Path, work: Path, steps: int, *extra: str) -> list[str]:
    argv = train_argv(model_dir, work, steps, dump_every=1)
    at = argv.index("--eval.steps")
    argv[at + 1] = str(EVAL_EVERY)
    return argv + ["--eval.dataset", str(work / "heldout.jsonl"), "--eval.n_samples_per_prompt", "1",
                   "--train.async_enable", "--train.async_queue_size", str(QUEUE), *extra]


def _prepare(work: Path, steps: int) -> None:
    write_prompts(work / "prompts.jsonl", 4 * steps)
    write_jsonl(work / "heldout.jsonl", split()[1][:6])


@pytest.fixture(scope="module")
def async_run(tiny_model_dir, tmp_path_factory):
    """Async training with a queue of 2 and partial rollouts, killed after two logged steps, then resumed to the end."""
    work = tmp_path_factory.mktemp("e2e_async")
    _prepare(work, TOTAL_STEPS)
    argv = _async_argv(tiny_model_dir, work, TOTAL_STEPS, "--train.partial_rollout_enable")
    log, steps = kill_and_resume(argv, work, TOTAL_STEPS)
    return work, steps


def test_every_step_is_logged_once_across_the_kill(async_run):
    _, steps = async_run
    assert [s["step"] for s in steps] == list(range(1, TOTAL_STEPS + 1))


def test_lags_are_measured_and_bounded_by_the_queue(async_run):
    work, steps = async_run
    for s in steps:
        shares = [v for k, v in s.items() if k.startswith("staleness/lag_")]
        assert sum(shares) == pytest.approx(1.0) and 0 <= s["staleness/mean"] <= s["staleness/max"] <= QUEUE, s
        assert s.get("timing/queue_wait", 0.0) >= 0  # absent on a process's first step: nothing was waited for
    # the generator runs ahead of the trainer: some batch was sampled by an older policy than it trained
    assert max(s["staleness/max"] for s in steps) >= 1
    assert sum("timing/queue_wait" in s for s in steps) >= TOTAL_STEPS - 2
    tokens = query_tokens(work / "run")
    assert token_steps(work / "run") == list(range(1, TOTAL_STEPS + 1))
    by_step = {s["step"]: s for s in steps}
    for step, rows in tokens.groupby("step"):
        assert rows["lag"].between(0, by_step[step]["staleness/max"]).all(), step


def test_the_correction_measures_precision_and_staleness_together(async_run):
    """μ is what the engine sampled with, π_old the trainer's policy at the step: stale samples differ more."""
    work, _ = async_run
    tokens = query_tokens(work / "run")
    gap = (tokens["old_logprob"] - tokens["rollout_logprob"]).abs()
    on_policy, stale = gap[tokens["lag"] == 0], gap[tokens["lag"] >= 1]
    assert len(on_policy) and len(stale)
    # on-policy: same weights, bf16 kernels apart (~1e-3); one step of lr 1e-3 moves log-probs by ~0.05
    assert on_policy.mean() < 0.02 and stale.mean() > 2 * on_policy.mean(), (on_policy.mean(), stale.mean())


def test_held_out_is_scored_before_training_and_at_every_eval_step(async_run):
    _, steps = async_run
    by_step = {s["step"]: s for s in steps}
    assert "eval_start/default_pass1" in by_step[1] or "eval_start/pass1" in str(by_step[1])
    for step in (EVAL_EVERY, 2 * EVAL_EVERY):
        assert any(k.startswith("eval/") and k.endswith("pass1") for k in by_step[step]), by_step[step].keys()
    assert not any(k.startswith("eval/") for s in steps if s["step"] % EVAL_EVERY for k in s)


def test_every_sync_is_checked(async_run):
    _, steps = async_run
    for s in steps:
        assert s["sync/vllm_vs_trainer_mean_abs_logprob"] < 1e-2, s


def test_partial_rollouts_log_the_share_of_samples_spanning_a_sync(async_run):
    _, steps = async_run
    assert all("staleness/spanning_sync" in s and 0 <= s["staleness/spanning_sync"] <= 1 for s in steps)
