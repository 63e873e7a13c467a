"""Each of the controller's parts (trainer/step_part.py) alone, against hand-worked cases.

No controller, Ray or engine: a part sees only its constructor's arguments and its hooks' (tests/test_controller.py
drives them all together under upstream's loops). `ray.get` is the identity here and `time.perf_counter` a clock
the test moves.
"""

from __future__ import annotations

import math
import re
import time
from types import SimpleNamespace

import pytest
import ray
import torch
from _fake_engines import Remote
from _support import read_steps

from openrlhf_tis import patches

patches.apply_platform_patches("cpu")  # openrlhf.models imports flash_attn at module level
from openrlhf.trainer.ppo_utils.experience import Experience  # noqa: E402

from openrlhf_tis.correction import preset  # noqa: E402
from openrlhf_tis.metric_names import (  # noqa: E402
    FP8_SYNC_PREFIX,
    INT8_SYNC_PREFIX,
    LOGPROB_COVERAGE,
    QUEUE_WAIT,
    REWARD_DROPPED,
    REWARD_NONFINITE,
    STALENESS_DROPPED,
    STALENESS_MAX,
    STALENESS_MEAN,
    STALENESS_SPANNING_SYNC,
    SYNC_BASELINE,
    SYNC_CHECK_SECONDS,
    SYNC_GAP_MEAN,
    SYNC_WEIGHTS_SECONDS,
    staleness_lag_key,
)
from openrlhf_tis.rollout.versions import VERSION_FIRST, VERSION_LAST  # noqa: E402
from openrlhf_tis.run_spec import ClusterPlan, DumpPlan, RolloutPlan, RunSpec  # noqa: E402
from openrlhf_tis.runs.store import RunWriter  # noqa: E402
from openrlhf_tis.runs.tokens import select_samples  # noqa: E402
from openrlhf_tis.trainer import step_part  # noqa: E402
from openrlhf_tis.trainer.rewards import NonFiniteRewardError, RewardPolicy  # noqa: E402
from openrlhf_tis.trainer.staleness import LAG, StalenessError  # noqa: E402
from openrlhf_tis.trainer.step_part import (  # noqa: E402
    CoveragePart,
    EvalSchedule,
    MetricsLinePart,
    PolicyVersionPart,
    QueueWaitPart,
    RewardScreenPart,
    RoutingCapturePart,
    StalenessPart,
    StartEvalPart,
    StepPart,
    SyncCheckPart,
    SyncCostPart,
    TokenDumpPart,
)

RULES = RewardPolicy(policy="drop", group_size=2, source="reward.py")


class Clock:
    def __init__(self):
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(time, "perf_counter", clock)
    return clock


@pytest.fixture(autouse=True)
def no_ray(monkeypatch):
    monkeypatch.setattr(ray, "get", lambda refs: refs)


def samples(versions=None, rewards=None) -> list[Experience]:
    """Samples of prompt groups of 2, each stamped with its (first, last) policy versions."""
    versions = versions or [(0, 0)] * len(rewards)
    rewards = rewards or [1.0] * len(versions)
    return [Experience(rewards=torch.tensor([r]), prompts=[f"q{i // 2}"], labels=["1"],
                       info={VERSION_FIRST: torch.tensor([float(a)]), VERSION_LAST: torch.tensor([float(b)])})
            for i, ((a, b), r) in enumerate(zip(versions, rewards, strict=True))]


def test_the_hooks_the_module_doc_lists_are_the_base_class_hooks():
    listed = re.findall(r"^    (\w+)\(", step_part.__doc__, flags=re.MULTILINE)
    hooks = [name for name in vars(StepPart) if not name.startswith("_")]
    assert listed == hooks


def test_the_base_part_changes_nothing():
    part, batch, status = StepPart(), samples(rewards=[1.0, 2.0]), {"a": 1.0}
    assert part.before_step(batch, 1) is batch and part.rollout_metrics(batch) == {}
    part.end_step(status)
    assert status == {"a": 1.0}


def test_reward_screen_drops_nonfinite_groups_and_reports_them_at_the_step_end():
    part = RewardScreenPart(RULES)
    kept = part.before_step(samples(rewards=[1.0, 0.0, math.nan, 1.0, 0.0, 0.0]), 3)
    assert [s.prompts[0] for s in kept] == ["q0", "q0", "q2", "q2"]
    status = {"policy_loss": 0.5}
    part.end_step(status)
    assert status == {"policy_loss": 0.5, REWARD_NONFINITE: 1.0, REWARD_DROPPED: 2.0}
    part.end_step(status := {})
    assert status == {}  # reported once


def test_reward_screen_fails_the_step_when_told_to():
    part = RewardScreenPart(RewardPolicy(policy="fail", group_size=2, source="reward.py"))
    with pytest.raises(NonFiniteRewardError, match="step 4: the reward from reward.py"):
        part.before_step(samples(rewards=[1.0, math.inf]), 4)


def test_staleness_measures_lags_behind_the_previous_version_and_bounds_them():
    part = StalenessPart(RULES, max_lag=1, partial_rollouts=True)
    # step 4 trains with π_old = version 3: lags 3 and 0 (the group goes: 3 > 1), 1 and 1 (one spans a sync), 0 and 0
    batch = samples(versions=[(0, 0), (3, 3), (2, 3), (2, 2), (3, 3), (3, 3)])
    kept = part.before_step(batch, 4)
    assert [s.prompts[0] for s in kept] == ["q1", "q1", "q2", "q2"]
    assert [s.info[LAG].item() for s in kept] == [1, 1, 0, 0] and VERSION_FIRST not in kept[0].info
    status = {LAG: 0.5, "policy_loss": 0.1}  # the actor logs the per-sample lag like any info key
    part.end_step(status)
    assert status == {"policy_loss": 0.1, STALENESS_MEAN: 0.5, STALENESS_MAX: 1.0, staleness_lag_key(0): 0.5,
                      staleness_lag_key(1): 0.5, STALENESS_SPANNING_SYNC: 0.25, STALENESS_DROPPED: 2.0}


def test_staleness_without_a_bound_keeps_everything_and_reports_no_drops():
    part = StalenessPart(RULES, max_lag=None, partial_rollouts=False)
    assert len(part.before_step(samples(versions=[(0, 0), (0, 0)]), 9)) == 2
    part.end_step(status := {})
    assert status == {STALENESS_MEAN: 8.0, STALENESS_MAX: 8.0, **{staleness_lag_key(k): 0.0 for k in range(8)},
                      staleness_lag_key(8): 1.0}


def test_staleness_refuses_a_step_left_without_samples():
    with pytest.raises(StalenessError, match="--train.async_max_lag 0"):
        StalenessPart(RULES, max_lag=0, partial_rollouts=False).before_step(samples(versions=[(0, 0)] * 2), 2)


def test_queue_wait_runs_from_a_step_handed_over_to_the_next_step_start(clock):
    part = QueueWaitPart()
    part.before_step([], 1)
    part.end_step(status := {})
    assert status == {}  # nothing handed over yet in this process
    clock.now = 60.0
    part.after_save(1)
    clock.now = 64.5
    part.before_step([], 2)
    clock.now = 99.0  # training the step is not waiting
    part.end_step(status)
    assert status == {QUEUE_WAIT: 4.5}


def test_coverage_counts_response_tokens_with_a_finite_rollout_logprob():
    nan = math.nan
    experiences = [
        SimpleNamespace(action_mask=torch.tensor([[1, 1, 1], [1, 1, 0]]), rollout_log_probs=torch.tensor(
            [[-1.0, nan, -2.0], [-1.0, -1.0, nan]])),  # 5 response tokens, one without a log-prob
        SimpleNamespace(action_mask=torch.tensor([[1, 1, 0]]), rollout_log_probs=None),  # 2, none
    ]
    assert CoveragePart().rollout_metrics(experiences) == {LOGPROB_COVERAGE: 4 / 7}


class ActorGroup:
    def __init__(self):
        self.sent = []

    def async_run_method(self, method_name, **kwargs):
        self.sent.append((method_name, kwargs))
        return []


def test_token_dumps_are_announced_for_dumped_steps_whose_actor_trains():
    args = SimpleNamespace(logger=SimpleNamespace(run_dir="run"), rollout=SimpleNamespace(n_samples_per_prompt=2),
                           train=SimpleNamespace(seed=3))
    group = ActorGroup()
    part = TokenDumpPart(args, DumpPlan(steps=2, samples=2), group)
    for step in range(1, 6):
        part.before_step(list(range(8 - step)), step)  # the samples left after screening
        part.before_fit(step, trains_actor=step != 4)
    assert [(name, kw["plan"].step) for name, kw in group.sent] == [("set_token_dump", 1), ("set_token_dump", 2)]
    assert group.sent[1][1]["plan"].sample_ids == tuple(select_samples(6, 2, 2, seed=3, group_size=2))


def test_engines_learn_the_version_of_the_last_fit_or_of_the_checkpoint():
    told = []
    part = PolicyVersionPart([SimpleNamespace(set_policy_version=Remote(told.append))] * 2)
    part.on_start(5)
    part.synced()  # a resumed run's first sync sends the checkpoint's weights
    part.after_fit(6)
    part.synced()
    assert told == [5, 5, 6, 6]


def test_the_routing_capture_starts_with_the_run_and_each_sync_drops_requests_never_taken():
    calls = []
    engine = SimpleNamespace(start_routing_capture=Remote(lambda: calls.append("start")),
                             forget_stale_routing=Remote(lambda: calls.append("forget")))
    part = RoutingCapturePart([engine, engine])
    part.on_start(1)
    part.synced()
    assert calls == ["start", "start", "forget", "forget"]


class Checker:
    """A sync checker whose scoring takes 1 s (probe) and 2 s (judging) of the test's clock."""

    def __init__(self, clock):
        self.clock, self.calls = clock, []

    def start(self):
        self.calls.append("start")
        return {SYNC_BASELINE: 0.25}

    def before_sync(self):
        self.calls.append("probe")
        self.clock.now += 1.0
        return "probe of the old weights"

    def after_sync(self, probe):
        self.calls.append(("judge", probe))
        self.clock.now += 2.0
        return {SYNC_GAP_MEAN: 0.5}


def test_every_nth_sync_is_checked_and_its_scoring_timed(clock):
    checker = Checker(clock)
    part = SyncCheckPart(checker, every=2)
    part.on_start(0)
    lines = []
    for _ in range(4):
        part.before_sync()
        clock.now += 10.0  # the weight sync itself
        part.after_sync(10.0)
        part.end_step(status := {})
        lines.append(status)
    judged = ("judge", "probe of the old weights")
    assert checker.calls == ["start", "probe", judged, "probe", judged]
    assert lines == [{SYNC_BASELINE: 0.25}, {SYNC_GAP_MEAN: 0.5, SYNC_CHECK_SECONDS: 3.0}, {},
                     {SYNC_GAP_MEAN: 0.5, SYNC_CHECK_SECONDS: 3.0}]


def test_a_resumed_run_measures_no_start_baseline(clock):
    checker = Checker(clock)
    SyncCheckPart(checker, every=1).on_start(4)
    assert checker.calls == []


class _Engine:
    """An engine actor's `last_sync_stats` as Ray calls it (`.remote()`; ray.get is the identity here)."""

    def __init__(self, stats: list[dict]):
        self.last_sync_stats = SimpleNamespace(remote=lambda: stats)


def test_sync_cost_reports_the_sync_and_the_worst_engines_int8_requantization():
    part = SyncCostPart()
    part.after_sync(1.5)
    part.end_step(status := {})
    assert status == {SYNC_WEIGHTS_SECONDS: 1.5}
    engines = [_Engine([{"saturated_fraction": 0.1, "max_rel_error": 0.5, "quantize_s": 0.3, "layers": 9}]),
               _Engine([{"saturated_fraction": 0.4, "max_rel_error": 0.2}]), _Engine([])]
    part = SyncCostPart(engines)
    part.after_sync(2.0)
    part.end_step(status := {})
    assert status == {SYNC_WEIGHTS_SECONDS: 2.0, INT8_SYNC_PREFIX + "saturated_fraction": 0.4,
                      INT8_SYNC_PREFIX + "max_rel_error": 0.5, INT8_SYNC_PREFIX + "quantize_s": 0.3}


@pytest.mark.parametrize(("precision", "cuda", "engines", "asked", "prefix"), [
    ("int8", False, ["e"], ["e"], INT8_SYNC_PREFIX), ("int8", False, None, [], INT8_SYNC_PREFIX),
    ("int8", False, [], [], INT8_SYNC_PREFIX), ("bf16", False, ["e"], [], INT8_SYNC_PREFIX),
    ("fp8", True, ["e"], ["e"], FP8_SYNC_PREFIX), ("fp8", False, ["e"], [], INT8_SYNC_PREFIX),
    ("bf16", True, ["e"], [], INT8_SYNC_PREFIX)])
def test_sync_cost_asks_only_re_quantizing_engines(precision, cuda, engines, asked, prefix):
    """INT8 engines on either device and FP8 ones on CUDA re-quantize at a sync; CPU FP8 engines quantize online."""
    spec = RunSpec(ClusterPlan("cuda" if cuda else "cpu", "a test"), preset("off"), RolloutPlan(precision))
    part = SyncCostPart.of(spec, engines)
    assert (list(part.quantized_engines), part.prefix) == (asked, prefix)


@pytest.mark.parametrize(("loaded", "every", "due_at"), [
    (True, 2, [2, 4]), (True, 1, [1, 2, 3, 4]), (True, math.inf, []), (False, 2, [])])
def test_eval_schedule_follows_upstreams_condition(loaded, every, due_at):
    schedule = EvalSchedule.of(SimpleNamespace(eval=SimpleNamespace(steps=every)), object() if loaded else None)
    assert [step for step in range(1, 5) if schedule.due(step)] == due_at
    assert schedule.configured == bool(due_at)


def test_only_a_fresh_run_scores_the_untrained_policy():
    asked = []
    part = StartEvalPart(lambda step: asked.append(step) or {})
    part.on_start(3)
    part.on_start(0)
    assert asked == [0]


def test_metrics_lines_wait_for_their_step_scores_and_open_with_the_untrained_ones(tmp_path):
    part = MetricsLinePart(RunWriter(tmp_path), EvalSchedule(loaded=True, every=2))
    part.on_start(0)
    part.on_eval(0, {"eval_pass1": 0.1}, seconds=4.0)
    part.on_log(1, {"loss": 1.0})
    part.on_log(2, {"loss": 0.9})
    assert [line["step"] for line in read_steps(tmp_path)] == [1]  # step 2 waits for its scores
    part.on_eval(2, {"eval_pass1": 0.3}, seconds=5.0)
    part.on_log(3, {})  # upstream logs nothing: no line
    lines = read_steps(tmp_path)
    assert [{k: v for k, v in line.items() if k != "wall_time"} for line in lines] == [
        {"step": 1, "eval_start/pass1": 0.1, "eval_start/seconds": 4.0, "loss": 1.0},
        {"step": 2, "loss": 0.9, "eval/pass1": 0.3, "eval/seconds": 5.0}]
    assert list(lines[0])[2:4] == ["eval_start/pass1", "eval_start/seconds"]


def test_a_resumed_run_forgets_the_lines_after_its_checkpoint(tmp_path, capsys):
    writer = RunWriter(tmp_path)
    for step in (1, 2, 3):
        writer.append_metrics(step, {"loss": float(step)})
    MetricsLinePart(RunWriter(tmp_path), EvalSchedule(loaded=False, every=math.inf)).on_start(1)
    assert [line["step"] for line in read_steps(tmp_path)] == [1]
    assert "run store: dropped 2 record(s) after step 1, which this run trains again" in capsys.readouterr().out
