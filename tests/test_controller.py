"""The fork's PPO controller (trainer/ppo_trainer.py) driven by upstream's own loops, without Ray or vLLM.

Upstream's synchronous `PPOTrainer.fit` and async training's `PPOTrainerAsync.fit` / `TrainingActor.fit` run
unchanged around the fork's classes; only what they reach outside the controller is fake: engines and a trainer
that score by policy version (tests/_fake_engines.py; the actor group's `fit` moves the trainer one version),
rollout batches stamped with the version that generated them, held-out scores that name the version they
scored, and a clock that moves only where the fake world spends time (a weight sync 2 s, each engine call
0.25 s, an evaluation 7 s, a wait on the rollout queue 5 s), so each timing metric has one exact value.
Every expected value below is worked out by hand from those rules.
"""

from __future__ import annotations

import math
import time
from types import SimpleNamespace

import pytest
import ray
import torch
from _fake_engines import FakeActorGroup, Remote, SleepyEngine, probe_tokenizer
from _support import read_steps

from openrlhf_tis import patches

patches.apply_platform_patches("cpu")  # openrlhf.models imports flash_attn at module level
from openrlhf.trainer.ppo_trainer import BasePPOTrainer  # noqa: E402
from openrlhf.trainer.ppo_utils.experience import Experience  # noqa: E402
from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator  # noqa: E402

from openrlhf_tis.correction import CorrectionConfig  # noqa: E402
from openrlhf_tis.metric_names import (  # noqa: E402
    EVAL_PREFIX,
    EVAL_START_PREFIX,
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
    SYNC_EXCESS,
    SYNC_GAP_MAX,
    SYNC_GAP_MEAN,
    SYNC_TRAINER_PROBE_CHANGE,
    SYNC_VLLM_LOGPROB_CHANGE,
    SYNC_VLLM_PROBE_CHANGE,
    SYNC_WEIGHTS_SECONDS,
    staleness_lag_key,
)
from openrlhf_tis.rollout.versions import VERSION_FIRST, VERSION_LAST  # noqa: E402
from openrlhf_tis.run_spec import (  # noqa: E402
    ClusterPlan,
    DumpPlan,
    RewardPlan,
    RolloutPlan,
    RunSpec,
    StalenessPlan,
    SyncPlan,
)
from openrlhf_tis.runs.tokens import select_samples  # noqa: E402
from openrlhf_tis.trainer import ppo_trainer, sync_check  # noqa: E402
from openrlhf_tis.trainer.rewards import DROP_FLAG, NonFiniteRewardError  # noqa: E402
from openrlhf_tis.trainer.staleness import LAG, MAX_LAG_FLAG, StalenessError  # noqa: E402
from openrlhf_tis.trainer.sync_check import WeightSyncError  # noqa: E402

GROUP, PROMPTS = 2, 3  # a rollout batch: 3 prompts x 2 samples
SYNC_S, ENGINE_CALL_S, EVAL_S, QUEUE_S = 2.0, 0.25, 7.0, 5.0
SEED, DUMP_SAMPLES = 7, 2
COVERAGE = 21 / 22  # per batch of `rollout`: 22 response tokens, one without a finite rollout log-prob

UPSTREAM_LINE = {"step", "wall_time", "policy_loss", "timing/make_experience", "timing/ppo_train", "timing/broadcast",
                 "timing/generation", "timing/step_total", "rollout/reward_mean", "rollout/reward_std",
                 "rollout/response_length_mean", "rollout/truncated_rate", "rollout/num_samples"}
EVERY_STEP = {REWARD_NONFINITE, REWARD_DROPPED, STALENESS_MEAN, STALENESS_MAX, staleness_lag_key(0), LOGPROB_COVERAGE,
              SYNC_WEIGHTS_SECONDS}
CHECKED_SYNC = {SYNC_GAP_MEAN, SYNC_GAP_MAX, SYNC_BASELINE, SYNC_EXCESS, SYNC_VLLM_PROBE_CHANGE,
                SYNC_TRAINER_PROBE_CHANGE, SYNC_VLLM_LOGPROB_CHANGE, SYNC_CHECK_SECONDS}
EVALUATED = {EVAL_PREFIX + "default_pass1", EVAL_PREFIX + "seconds"}
EVALUATED_AT_START = {EVAL_START_PREFIX + "default_pass1", EVAL_START_PREFIX + "seconds"}
CHECKPOINT_KEYS = {"episode", "global_step", "total_consumed_prompts", "data_loader_state_dict", "best_eval_metric_key",
                   "best_eval_metric_value", "latest_eval_metric_value"}


class Clock:
    """time.perf_counter of the fake world: moves only when the world spends time."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def spend(self, seconds: float) -> None:
        self.now += seconds


class Engine(SleepyEngine):
    """An awake engine whose calls cost time and which logs what the controller tells it."""

    def __init__(self, world, loses_syncs: bool = False):
        super().__init__(loses_syncs=loses_syncs)
        self.world = world
        self.set_policy_version = Remote(lambda version: world.events.append(("version", version)))
        self.pause_generation = Remote(lambda: world.events.append("pause"))
        self.resume_generation = Remote(lambda: world.events.append("resume"))
        self.set_reward_timeout = Remote(lambda seconds: world.events.append(("reward limit", seconds)))
        self.sync_stats: list[dict] = []  # what an INT8 engine's workers returned of the last re-quantization
        self.last_sync_stats = Remote(lambda: self.sync_stats)

    def _generate(self, prompt_ids, params):
        self.world.clock.spend(ENGINE_CALL_S)
        return super()._generate(prompt_ids, params)


class ActorGroup(FakeActorGroup):
    """The policy actors: `fit` trains one version on, checkpoints are recorded, plans and calls are logged."""

    def __init__(self, world):
        super().__init__(world.engines)
        self.world = world
        self.saved: list[tuple[str, dict]] = []
        self.checkpoint: dict | None = None  # what get_checkpoint_states returns (a resumed run)
        self.trained: list[list[Experience]] = []

    def async_run_method_batch(self, method_name, experience):
        assert method_name == "append"
        self.trained.append(list(experience))
        return []

    def async_run_method(self, method_name, **kwargs):
        events = self.world.events
        if method_name == "fit":
            events.append("fit")
            self.version += 1
            lags = [float(e.info[LAG].item()) for e in self.trained[-1] if LAG in e.info]
            return [{"policy_loss": 0.5, **({LAG: sum(lags) / len(lags)} if lags else {})}]  # every info key
        if method_name == "set_token_dump":
            events.append(("dump", kwargs["plan"]))
            return []
        if method_name == "save_checkpoint":
            self.saved.append((kwargs["tag"], dict(kwargs.get("client_states") or {})))
            return []
        if method_name == "get_checkpoint_states":
            return [self.checkpoint]
        if method_name == "broadcast_to_vllm":
            events.append("broadcast")
            self.world.clock.spend(SYNC_S)
            if self.world.int8_stats:  # what INT8 engines return of each re-quantization (the worst one counts)
                for i, engine in enumerate(self.world.engines):
                    engine.sync_stats = [{"sync": self.version, "saturated_fraction": self.version / 100 - i / 1000,
                                          "max_rel_error": 0.5 - i / 10, "quantize_s": 3.0 + i}]
        return super().async_run_method(method_name, **kwargs)


def rollout(versions: list[int | tuple[int, int]], rewards: dict[int, float] | None = None) -> list[Experience]:
    """Samples as upstream's samples generator leaves them, stamped (first, last) with the engine's versions.

    Sample 1 lacks a rollout log-prob on one response token; sample 5 has two response tokens, and its missing
    log-prob sits on a padding position: 22 response tokens, 21 covered.
    """
    samples = []
    for i, version in enumerate(versions):
        first, last = version if isinstance(version, tuple) else (version, version)
        reward = torch.tensor([(rewards or {}).get(i, float(i % GROUP))])
        mask = torch.tensor([[True, True, i != 5, i != 5]])
        logprobs = torch.full((1, 4), -1.0)
        logprobs[0, 2 if i == 1 else 3] = float("nan") if i in (1, 5) else -1.0
        samples.append(Experience(
            sequences=torch.arange(8).unsqueeze(0), action_mask=mask, rollout_log_probs=logprobs, rewards=reward,
            response_length=mask.sum(-1).float(), truncated=torch.tensor([0.0]), prompts=[f"q{i // GROUP}"],
            labels=["1"], info={"reward": reward, VERSION_FIRST: torch.tensor([float(first)]),
                                VERSION_LAST: torch.tensor([float(last)])}))
    return samples


class Tokenizer:
    def __call__(self, text, add_special_tokens=False):
        return probe_tokenizer(text, add_special_tokens)

    def decode(self, ids, skip_special_tokens=True):
        return ["a decoded sample"]


class PromptLoader:
    def __init__(self):
        self.loaded: list[dict] = []

    def __len__(self):
        return 100

    def state_dict(self):
        return {"seen": 6}

    def load_state_dict(self, state):
        self.loaded.append(state)


class ExperienceMaker:
    def __init__(self):
        self.batches: list[list[Experience]] = []

    def make_experience_batch(self, samples):
        self.batches.append(list(samples))
        return list(samples)


class Tracker:
    """wandb as upstream calls it."""

    def __init__(self):
        self.train: list[tuple[int, dict]] = []
        self.evals: list[int] = []

    def log_train(self, step, logs):
        self.train.append((step, dict(logs)))

    def log_eval(self, step, logs):
        self.evals.append(step)

    def close(self):
        pass


class RolloutQueue:
    """Async training's queue: each `get` waits QUEUE_S, then hands the next batch (then "done")."""

    def __init__(self, world, batches):
        self.world, self.batches = world, list(batches)

    def get(self, block=True):
        self.world.clock.spend(QUEUE_S)
        if not self.batches:
            return "done"
        samples = self.batches.pop(0)
        return samples, {"episode": 0, "total_consumed_prompts": PROMPTS, "data_loader_state_dict": {}}, None, 1.0


class Handle:
    """A Ray actor handle whose methods run at once."""

    def __init__(self, obj):
        self._obj = obj

    def __getattr__(self, name):
        return Remote(getattr(self._obj, name))


class World:
    def __init__(self, tmp_path, lost_sync: bool = False, **flags):
        self.run_dir = tmp_path / "run"
        self.clock, self.events = Clock(), []
        self.engines = [Engine(self), Engine(self, loses_syncs=lost_sync)]
        self.actors = ActorGroup(self)
        self.args = make_args(self.run_dir, tmp_path / "ckpt", **flags)
        self.int8_stats = self.args.fork.spec.rollout.precision == "int8"
        self.prompts, self.eval_loader = PromptLoader(), SimpleNamespace(dataset=list(range(5)))
        self.tracker, self.maker = Tracker(), ExperienceMaker()
        self.scored: list[dict] = []  # what each evaluation was asked for, and the version it scored
        self.batches: list = []  # sync: each a function of the engines' version; async: sample lists

    def upstream_attributes(self, trainer) -> None:
        """What upstream's __init__ leaves on a trainer (datasets and generator: the sync PPOTrainer's only)."""
        strategy = SimpleNamespace(args=self.args)
        BasePPOTrainer.__init__(trainer, strategy, self.actors, None, None, None, self.engines, Tokenizer())
        trainer.experience_maker, trainer.wandb_logger = self.maker, self.tracker

    def sync_init(self, trainer, *args, **kwargs) -> None:
        self.upstream_attributes(trainer)
        trainer.prompts_dataloader, trainer.eval_dataloader, trainer.max_steps = self.prompts, self.eval_loader, 9
        trainer.generate_kwargs = {"temperature": 1.0, "n_samples_per_prompt": GROUP}
        trainer.samples_generator = SamplesGenerator(trainer.strategy, self.prompts, self.eval_loader,
                                                     trainer.tokenizer, self.engines)

    def async_init(self, trainer, *args, **kwargs) -> None:
        self.upstream_attributes(trainer)
        lock = SimpleNamespace(acquire=Remote(lambda: None), release=Remote(lambda: None))
        trainer.vllm_lock, trainer._partial_rollout = lock, self.args.train.partial_rollout_enable
        trainer.rollout_queue = RolloutQueue(self, self.batches)
        trainer.rollout_slots = SimpleNamespace(put=lambda item, block=True: None)

    def generate_samples(self, generator, **generate_kwargs):
        """Upstream's sync rollout: the next batch, from the engines' version now."""
        batch = self.batches.pop(0)(self.engines[0].version)
        return batch, None, PROMPTS, not self.batches

    def generate_eval_samples(self, generator, **generate_kwargs):
        self.clock.spend(EVAL_S)
        self.scored.append({"version": self.engines[0].version, **generate_kwargs})
        return [self.engines[0].version]

    def lines(self) -> dict[int, dict]:
        return {line["step"]: line for line in read_steps(self.run_dir)}

    def dump_plans(self) -> list:
        return [event[1] for event in self.events if isinstance(event, tuple) and event[0] == "dump"]


def make_args(run_dir, ckpt, *, eval_steps=2, sync_check_steps=2, dump_every=2, nonfinite="fail", max_lag=None,
              partial=False, precision="bf16", cuda=False, load=False, logged=True):
    ns = SimpleNamespace
    # the reward flags and the lag bound are the spec's only: the namespace below has none of them to fall back on
    spec = RunSpec(ClusterPlan("cuda" if cuda else "cpu", "a test"), CorrectionConfig(), RolloutPlan(precision),
                   SyncPlan(check_steps=sync_check_steps), DumpPlan(steps=dump_every, samples=DUMP_SAMPLES),
                   RewardPlan(timeout_s=7.5, nonfinite=nonfinite), StalenessPlan(max_lag=max_lag))
    return ns(
        fork=ns(spec=spec),
        logger=ns(run_dir=str(run_dir) if logged else None, logging_steps=1, wandb=ns(key=None), tensorboard_dir=None),
        rollout=ns(n_samples_per_prompt=GROUP, micro_batch_size=1, temperature=1.0, batch_size=PROMPTS,
                   vllm_generate_batch_size=None),
        train=ns(seed=SEED, partial_rollout_enable=partial, micro_batch_size=1,
                 dynamic_batch_enable=False, num_episodes=1),
        critic=ns(freezing_steps=-1),
        ds=ns(enable_sleep=False, ring_attn_size=1, tensor_parallel_size=1),
        vllm=ns(enable_sleep=False),
        eval=ns(steps=eval_steps, temperature=0.6, n_samples_per_prompt=1),
        ckpt=ns(path=str(ckpt), load_enable=load, save_steps=1, best_metric_key=""),
        algo=ns(kl=ns(init_coef=0.0, target=None, horizon=1), dynamic_filtering_enable=False,
                advantage=ns(estimator="group_norm")),
        actor=ns(num_nodes=1, num_gpus_per_node=1),
        reward=ns(remote_url=["reward.py"]),
    )


@pytest.fixture
def world_of(tmp_path, monkeypatch):
    """A World whose fakes upstream's classes reach; each call builds a new one (a resumed run shares tmp_path)."""
    monkeypatch.setattr(ray, "get", lambda refs: refs)
    monkeypatch.setattr(sync_check, "probe_sampling_params", lambda temperature, n: SimpleNamespace(max_tokens=n))
    current: list[World] = []

    def make(**flags) -> World:
        world = World(tmp_path, **flags)
        current[:] = [world]
        monkeypatch.setattr(time, "perf_counter", world.clock)
        return world

    def scores(loader, samples, n_samples_per_prompt):
        return {"eval_default_pass1": samples[0] / 10}

    monkeypatch.setattr(ppo_trainer._UpstreamPPOTrainer, "__init__", lambda self, *a, **k: current[0].sync_init(self))
    monkeypatch.setattr(ppo_trainer._UpstreamTrainingActor, "__init__",
                        lambda self, *a, **k: current[0].async_init(self))
    monkeypatch.setattr(ppo_trainer, "prepare_datasets", lambda strategy, tokenizer: (None, current[0].eval_loader, 0))
    monkeypatch.setattr(SamplesGenerator, "generate_samples", lambda gen, **kw: current[0].generate_samples(gen, **kw))
    monkeypatch.setattr(SamplesGenerator, "generate_eval_samples",
                        lambda gen, **kw: current[0].generate_eval_samples(gen, **kw))
    import openrlhf.trainer.ppo_trainer as upstream

    monkeypatch.setattr(upstream, "compute_eval_metrics", scores)
    monkeypatch.setattr(ppo_trainer, "compute_eval_metrics", scores)
    return make


def on_policy(steps: int, **rewards) -> list:
    """Sync batches: every sample generated by the engines' current version."""
    return [lambda version: rollout([version] * (GROUP * PROMPTS), rewards.get("rewards")) for _ in range(steps)]


def run_sync(world: World):
    controller = ppo_trainer._TisPPOTrainer(strategy=SimpleNamespace(args=world.args))
    controller.fit()
    return controller


def run_async(world: World):
    trainer = ppo_trainer._TisTrainingActor(strategy=SimpleNamespace(args=world.args))
    trainer.set_generate_kwargs({"temperature": 1.0, "n_samples_per_prompt": GROUP})
    generator = SimpleNamespace(load_state_dict=lambda state: None, fit=lambda episode, total_consumed_prompts: None)
    driver = SimpleNamespace(trainer_actor=Handle(trainer), generator_actor=Handle(generator))
    ppo_trainer._UpstreamPPOTrainerAsync.fit(driver)
    return trainer


# ── synchronous training ──

@pytest.mark.parametrize("run", [run_sync, run_async])
def test_the_engines_learn_the_reward_limit_before_anything_else(world_of, run):
    world = world_of()
    world.batches = on_policy(1) if run is run_sync else [rollout([0] * (GROUP * PROMPTS))]
    run(world)
    assert world.events[:2] == [("reward limit", 7.5)] * 2 and world.events.count(("reward limit", 7.5)) == 2
    assert world.scored  # the start's evaluation, which rolls out on the engines, came after

def test_each_step_line_holds_the_forks_metrics_where_they_are_due(world_of):
    world = world_of()
    world.batches = on_policy(4)
    run_sync(world)
    lines = world.lines()
    assert sorted(lines) == [1, 2, 3, 4]
    expected = {1: EVERY_STEP | EVALUATED_AT_START | {SYNC_BASELINE}, 2: EVERY_STEP | CHECKED_SYNC | EVALUATED,
                3: EVERY_STEP, 4: EVERY_STEP | CHECKED_SYNC | EVALUATED}
    for step, line in lines.items():
        assert set(line) == UPSTREAM_LINE | expected[step], step
        assert line[LOGPROB_COVERAGE] == pytest.approx(COVERAGE)
        assert line[SYNC_WEIGHTS_SECONDS] == SYNC_S
        assert (line[REWARD_NONFINITE], line[REWARD_DROPPED]) == (0, 0)
        assert (line[STALENESS_MEAN], line[STALENESS_MAX], line[staleness_lag_key(0)]) == (0, 0, 1)
    assert list(lines[1])[2:4] == sorted(EVALUATED_AT_START)  # the untrained policy's scores open the first line


def test_sync_checks_judge_the_weights_just_synced(world_of):
    world = world_of()
    world.batches = on_policy(4)
    run_sync(world)
    lines = world.lines()
    assert lines[1][SYNC_BASELINE] == 0  # both sides at version 0 before the first step
    for step in (2, 4):
        line = lines[step]
        assert (line[SYNC_GAP_MEAN], line[SYNC_GAP_MAX], line[SYNC_EXCESS], line[SYNC_BASELINE]) == (0, 0, 0, 0)
        assert line[SYNC_VLLM_LOGPROB_CHANGE] == pytest.approx(0.7)  # through this sync: one version
        assert line[SYNC_VLLM_PROBE_CHANGE] == pytest.approx(1.4)  # since the previous check: two versions
        assert line[SYNC_TRAINER_PROBE_CHANGE] == pytest.approx(1.4)
        assert line[SYNC_CHECK_SECONDS] == 4 * ENGINE_CALL_S  # probe before, score after, two engines each


def test_held_out_scores_follow_the_sync_of_their_step(world_of):
    world = world_of()
    world.batches = on_policy(4)
    run_sync(world)
    lines = world.lines()
    assert [s["version"] for s in world.scored] == [0, 2, 4]
    assert all((s["temperature"], s["n_samples_per_prompt"]) == (0.6, 1) for s in world.scored)
    assert (lines[1][EVAL_START_PREFIX + "default_pass1"], lines[1][EVAL_START_PREFIX + "seconds"]) == (0.0, EVAL_S)
    assert [(lines[s][EVAL_PREFIX + "default_pass1"], lines[s][EVAL_PREFIX + "seconds"]) for s in (2, 4)] == [
        (0.2, EVAL_S), (0.4, EVAL_S)]
    assert world.tracker.evals == [0, 2, 4]
    logged = dict(world.tracker.train)  # upstream's trackers: the step's metrics, never the run store's eval keys
    assert all(EVERY_STEP <= set(logs) and not any(k.startswith(EVAL_START_PREFIX) for k in logs)
               for logs in logged.values())


def test_engines_learn_each_version_once_its_weights_are_in(world_of):
    world = world_of()
    world.batches = on_policy(3)
    run_sync(world)
    synced = [e for e in world.events if e == "broadcast" or (isinstance(e, tuple) and e[0] == "version")]
    assert synced == [e for v in (1, 2, 3) for e in ("broadcast", ("version", v), ("version", v))]  # two engines


def test_token_dumps_are_planned_before_fit_of_the_dumped_steps(world_of):
    world = world_of()
    world.batches = on_policy(4)
    run_sync(world)
    plans = world.dump_plans()
    assert [p.step for p in plans] == [1, 2, 4]
    for plan in plans:
        assert plan.sample_ids == tuple(select_samples(GROUP * PROMPTS, DUMP_SAMPLES, plan.step, seed=SEED,
                                                       group_size=GROUP))
        assert (plan.run_dir, plan.group_size) == (str(world.run_dir), GROUP)
        assert world.events[world.events.index(("dump", plan)) + 1] == "fit"


def test_checkpoints_hold_exactly_what_upstream_saves(world_of):
    world = world_of()
    world.batches = on_policy(4)
    run_sync(world)
    assert [tag for tag, _ in world.actors.saved] == ["global_step1", "global_step2", "best_global_step2",
                                                      "global_step3", "global_step4", "best_global_step4"]
    reference = world_of()  # upstream alone, same world
    reference.batches = on_policy(4)
    ppo_trainer._UpstreamPPOTrainer().fit()
    assert world.actors.saved == reference.actors.saved
    assert set(world.actors.saved[0][1]) == CHECKPOINT_KEYS


def test_without_a_run_directory_nothing_is_written_or_dumped(world_of):
    world = world_of(logged=False)
    world.batches = on_policy(2)
    run_sync(world)
    assert not world.run_dir.exists() and not world.dump_plans()
    assert [step for step, _ in world.tracker.train] == [1, 2]


def test_a_resumed_run_rewinds_the_store_and_continues_from_its_checkpoint(world_of, capsys):
    first = world_of()
    first.batches = on_policy(4)
    run_sync(first)
    before = first.lines()
    world = world_of(load=True)
    (world.run_dir.parent / "ckpt" / "_actor").mkdir(parents=True)
    states = {"episode": 0, "global_step": 2, "total_consumed_prompts": 6, "data_loader_state_dict": {"seen": 6}}
    world.actors.checkpoint, world.actors.version = dict(states), 2
    world.batches = on_policy(2)
    run_sync(world)
    assert "run store: dropped 2 record(s) after step 2" in capsys.readouterr().out
    lines = world.lines()
    assert sorted(lines) == [1, 2, 3, 4] and [lines[s] for s in (1, 2)] == [before[1], before[2]]
    # The resume's own sync is sync 1 (not checked), step 3's is sync 2: checked against its own gap.
    assert set(lines[3]) == UPSTREAM_LINE | EVERY_STEP | {SYNC_GAP_MEAN, SYNC_GAP_MAX, SYNC_BASELINE, SYNC_EXCESS,
                                                          SYNC_VLLM_LOGPROB_CHANGE, SYNC_CHECK_SECONDS}
    assert set(lines[4]) == UPSTREAM_LINE | EVERY_STEP | EVALUATED
    assert [s["version"] for s in world.scored] == [4]  # no start evaluation: the policy is trained
    assert [p.step for p in world.dump_plans()] == [4]
    assert [e[1] for e in world.events if isinstance(e, tuple) and e[0] == "version"][::2] == [2, 3, 4]
    assert world.prompts.loaded == [{"seen": 6}]


def test_a_nonfinite_reward_stops_the_step_before_training(world_of):
    world = world_of()
    world.batches = on_policy(1) + on_policy(1, rewards={3: math.nan})
    with pytest.raises(NonFiniteRewardError, match=f"step 2: .*1 of 6 samples.*{DROP_FLAG}"):
        run_sync(world)
    assert sorted(world.lines()) == [1] and world.events.count("fit") == 1


def test_dropped_reward_groups_leave_the_step_and_its_dump_plan(world_of):
    world = world_of(nonfinite="drop")
    world.batches = on_policy(1) + on_policy(1, rewards={3: math.inf})
    run_sync(world)
    line = world.lines()[2]
    assert (line[REWARD_NONFINITE], line[REWARD_DROPPED]) == (1, 2)
    assert [s.prompts for s in world.maker.batches[1]] == [["q0"], ["q0"], ["q2"], ["q2"]]
    assert line[LOGPROB_COVERAGE] == pytest.approx(13 / 14)  # samples 0, 1, 4, 5: 14 tokens, sample 1's gap
    assert world.dump_plans()[1].sample_ids == tuple(select_samples(4, DUMP_SAMPLES, 2, seed=SEED, group_size=GROUP))


def test_a_sync_an_engine_missed_stops_the_run_before_its_line(world_of):
    world = world_of(lost_sync=True, sync_check_steps=1)
    world.batches = on_policy(2)
    with pytest.raises(WeightSyncError, match="engine 1"):
        run_sync(world)
    assert world.lines() == {}


def test_int8_engines_report_each_requantization_on_its_step(world_of):
    world = world_of(precision="int8")
    world.batches = on_policy(2)
    run_sync(world)
    for step, line in world.lines().items():
        assert {k: v for k, v in line.items() if k.startswith(INT8_SYNC_PREFIX)} == {
            INT8_SYNC_PREFIX + "saturated_fraction": step / 100, INT8_SYNC_PREFIX + "max_rel_error": 0.5,
            INT8_SYNC_PREFIX + "quantize_s": 4.0}


@pytest.mark.parametrize(("run", "precision"), [(run_sync, "fp8"), (run_async, "fp8"), (run_sync, "int8")])
def test_cuda_quantized_engines_take_one_checked_sync_before_the_first_step(world_of, run, precision):
    world = world_of(precision=precision, sync_check_steps=1, cuda=True)
    world.batches = on_policy(1) if run is run_sync else [rollout([0] * (GROUP * PROMPTS))]
    run(world)
    assert world.events.index("broadcast") < world.events.index("fit")  # the untrained weights' sync, first
    assert world.events.count("broadcast") == 2  # and the step's own


@pytest.mark.parametrize(("precision", "cuda"), [("fp8", False), ("bf16", True), ("int8", False)])
def test_other_engines_start_training_without_an_extra_sync(world_of, precision, cuda):
    world = world_of(precision=precision, sync_check_steps=1, cuda=cuda)
    world.batches = on_policy(1)
    run_sync(world)
    assert world.events.index("fit") < world.events.index("broadcast") and world.events.count("broadcast") == 1


def test_a_cuda_fp8_sync_that_breaks_the_engine_stops_the_run_before_step_1(world_of):
    world = world_of(precision="fp8", sync_check_steps=1, cuda=True)
    world.engines[1].update_weight = Remote(lambda version: setattr(world.engines[1], "version", version + 50))
    world.batches = on_policy(1)
    with pytest.raises(WeightSyncError, match="engine 1 and the trainer disagree"):
        run_sync(world)
    assert "fit" not in world.events and world.lines() == {}


def test_a_frozen_actor_announces_no_dump(world_of):
    world = world_of()
    world.args.critic.freezing_steps = 1  # the actor trains from upstream's global_steps 2 (logged step 3) on
    world.batches = on_policy(4)
    run_sync(world)
    assert [p.step for p in world.dump_plans()] == [4]


# ── async training ──

def test_async_lines_measure_lags_queue_waits_and_score_after_the_sync(world_of):
    world = world_of(max_lag=1, partial=True, dump_every=3)
    world.batches = [rollout([0] * 6), rollout([0] * 6),
                     rollout([0, 0, (1, 2), (1, 2), 2, 2]),  # step 3 trains π_old = 2: lags 2, 2, 1, 1, 0, 0
                     rollout([3] * 6)]
    run_async(world)
    lines = world.lines()
    assert sorted(lines) == [1, 2, 3, 4]
    assert QUEUE_WAIT not in lines[1]  # nothing was waited for before the first step of a process
    assert [lines[s][QUEUE_WAIT] for s in (2, 3, 4)] == [QUEUE_S] * 3  # evaluations and checkpoints excluded
    assert all(LAG not in line for line in lines.values())
    assert [(lines[s][STALENESS_MEAN], lines[s][STALENESS_MAX], lines[s][STALENESS_DROPPED]) for s in (1, 2, 3, 4)] == [
        (0, 0, 0), (1, 1, 0), (0.5, 1, 2), (0, 0, 0)]
    assert (lines[3][staleness_lag_key(0)], lines[3][staleness_lag_key(1)]) == (0.5, 0.5)
    assert [lines[s][STALENESS_SPANNING_SYNC] for s in (1, 2, 3, 4)] == [0, 0, 0.5, 0]
    assert [s["version"] for s in world.scored] == [0, 2, 4]
    assert lines[1][EVAL_START_PREFIX + "seconds"] == EVAL_S and lines[2][EVAL_PREFIX + "default_pass1"] == 0.2
    best = [tag for tag, _ in world.actors.saved if tag.startswith("best")]
    assert best == ["best_global_step2", "best_global_step4"]
    assert [p.step for p in world.dump_plans()] == [1, 3]
    assert world.dump_plans()[1].sample_ids == tuple(select_samples(4, DUMP_SAMPLES, 3, seed=SEED, group_size=GROUP))
    assert CHECKED_SYNC <= set(lines[2]) and lines[2][SYNC_CHECK_SECONDS] == 4 * ENGINE_CALL_S


def test_async_engines_learn_their_version_inside_the_paused_sync(world_of):
    world = world_of(partial=True)
    world.batches = [rollout([0] * 6)]
    run_async(world)
    assert [e for e in world.events if e in ("pause", "broadcast", "resume") or isinstance(e, tuple) and
            e[0] == "version"] == ["pause", "pause", "broadcast", ("version", 1), ("version", 1), "resume", "resume"]


def test_async_samples_all_beyond_the_lag_bound_stop_the_run(world_of):
    world = world_of(max_lag=0)
    world.batches = [rollout([0] * 6), rollout([0] * 6)]
    with pytest.raises(StalenessError, match=f"step 2: 6 of 6 samples are older than {MAX_LAG_FLAG} 0"):
        run_async(world)
    assert sorted(world.lines()) == [1]


# ── the stall bound's record (trainer/stage_board.py) ──

def test_each_seam_publishes_its_stage_and_the_actors_it_waits_on(world_of, monkeypatch):
    """One synchronous step with the start's evaluation (eval every 2 steps): upstream's fit loads the checkpoint
    state, the start evaluates, the step makes experience around its training and sync, then saves; between seams the
    loop generates samples, and leaving fit leaves every stage. Each record's count moves by one."""
    from openrlhf_tis.trainer.stage_board import StageRecord

    records: list[StageRecord] = []
    monkeypatch.setattr(ppo_trainer, "gcs_publisher", lambda: records.append)
    world = world_of()
    world.batches = on_policy(1)
    for i, engine in enumerate(world.engines):
        engine._actor_id = SimpleNamespace(hex=lambda i=i: f"engine{i}")
    world.actors._actor_handlers = [SimpleNamespace(_actor_id=SimpleNamespace(hex=lambda: "policy0"))]
    run_sync(world)
    engines, policy = ("engine0", "engine1"), ("policy0",)
    expected = [("generate samples", engines), ("load checkpoint", policy), ("generate samples", engines),
                ("evaluate", engines), ("generate samples", engines),
                ("make experience", policy), ("train", policy), ("make experience", policy),
                ("sync weights", policy + engines), ("make experience", policy), ("generate samples", engines),
                ("save checkpoint", policy), ("generate samples", engines), (None, ())]
    assert [(r.stage, r.actors) for r in records] == expected
    assert [r.count for r in records] == list(range(1, len(expected) + 1))
