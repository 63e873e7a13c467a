"""The fork's vLLM worker extension (the engine's end of the CPU weight sync), without a vLLM engine.

vLLM mixes the class named by `worker_extension_cls` into its worker (vllm/v1/worker/worker_base.py);
upstream's engine factory names its CUDA `WorkerWrap`, and the fork's engine actor must name the fork's
subclass instead on CPU. tests/test_weight_sync_vllm.py drives the same class inside a real engine.
"""

from __future__ import annotations

import asyncio
import json
import types
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch
from _support import free_port

from openrlhf_tis.rollout import engine_actor
from openrlhf_tis.rollout.engine_actor import (
    CPU_WORKER_EXTENSION,
    UPSTREAM_WORKER_EXTENSION,
    PrecisionRolloutRayActor,
    worker_extension_override,
)
from openrlhf_tis.rollout.engine_actor import (
    CUDA_QUANTIZED_EXTENSION as CUDA_QUANTIZED,
)
from openrlhf_tis.rollout.weight_sync.group import GlooBroadcastGroup
from openrlhf_tis.rollout.weight_sync.receive import CPUWorkerExtension
from openrlhf_tis.rollout.weight_sync.receive_cuda import QuantizedCUDAWorkerExtension


def test_the_extension_resolves_as_vllm_does_and_extends_upstreams_worker_wrap():
    from openrlhf.trainer.ray.vllm_worker_wrap import WorkerWrap
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.worker.cpu_worker import CPUWorker

    assert resolve_obj_by_qualname(CPU_WORKER_EXTENSION) is CPUWorkerExtension
    assert resolve_obj_by_qualname(UPSTREAM_WORKER_EXTENSION) is WorkerWrap
    assert issubclass(CPUWorkerExtension, WorkerWrap)
    # vLLM refuses an extension whose names the worker class already has (assert in WorkerWrapperBase).
    names = [a for a in dir(CPUWorkerExtension) if not a.startswith("__")]
    assert {"init_process_group", "update_weight", "update_weights_bucket", "update_weight_cuda_ipc"} <= set(names)
    # An engine started earlier in this process has already mixed an extension into CPUWorker itself (vLLM
    # appends it to the class's bases), so the worker's own names are those of its non-extension classes.
    own = {a for cls in CPUWorker.__mro__ if not issubclass(cls, WorkerWrap) for a in vars(cls)}
    assert not set(names) & own
    # Mixed in as vLLM does (appended to the worker's bases), the fork's methods win over upstream's.
    if issubclass(CPUWorker, CPUWorkerExtension):
        worker_class = CPUWorker
    else:
        worker_class = type("Worker", (CPUWorker,), {})
        worker_class.__bases__ = worker_class.__bases__ + (CPUWorkerExtension,)
    assert worker_class.update_weight is CPUWorkerExtension.update_weight
    assert worker_class.init_process_group is CPUWorkerExtension.init_process_group
    assert worker_class.update_weight_cuda_ipc is WorkerWrap.update_weight_cuda_ipc  # upstream's other methods stay


def test_override_names_the_fork_extension_on_cpu_only():
    assert worker_extension_override(UPSTREAM_WORKER_EXTENSION, cuda=False) == {
        "worker_extension_cls": "openrlhf_tis.rollout.weight_sync.receive.CPUWorkerExtension"}
    assert worker_extension_override(None, cuda=False) == {"worker_extension_cls": CPU_WORKER_EXTENSION}
    assert worker_extension_override(UPSTREAM_WORKER_EXTENSION, cuda=True) == {}  # upstream's class on CUDA
    with pytest.raises(RuntimeError, match="upstream now starts vLLM with worker_extension_cls='other.Ext'"):
        worker_extension_override("other.Ext", cuda=False)


def test_cpu_engine_kwargs_carry_the_fork_extension(monkeypatch, tiny_model_dir):
    """Upstream's factory passes its WorkerWrap; the fork's actor hands vLLM its own class, nothing else changed."""
    import openrlhf.trainer.ray.vllm_engine as upstream_engine

    built = []

    class RecordingActor:
        @staticmethod
        def options(**_):
            return types.SimpleNamespace(remote=lambda **kwargs: built.append(kwargs))

    monkeypatch.setattr(upstream_engine, "RolloutRayActor", RecordingActor)
    upstream_engine.create_vllm_engines(1, 1, str(tiny_model_dir), 0, False, False, True, 128, shared_pg=object())
    (upstream_kwargs,) = built
    assert upstream_kwargs["worker_extension_cls"] == UPSTREAM_WORKER_EXTENSION

    received = []

    async def upstream_init(self, *args, **kwargs):
        received.append(kwargs)
        self.executor = object()  # a user's own agent executor: left alone

    monkeypatch.setattr(engine_actor._UpstreamRolloutRayActor, "__init__", upstream_init)
    actor = PrecisionRolloutRayActor.__new__(PrecisionRolloutRayActor)
    asyncio.run(actor.__init__(**upstream_kwargs))
    (engine_kwargs,) = received
    assert engine_kwargs["worker_extension_cls"] == CPU_WORKER_EXTENSION
    assert {k: v for k, v in engine_kwargs.items() if k != "worker_extension_cls"} == {
        k: v for k, v in upstream_kwargs.items() if k != "worker_extension_cls"}


class _FilledGroup:
    """Stands in for the gloo group: the 'broadcast' delivers what the trainer sent."""

    def __init__(self, sent: torch.Tensor):
        self.sent = sent

    def broadcast(self, tensor, src=0, stream=None):
        tensor.copy_(self.sent.reshape(tensor.shape))


def _runner(engine_dtype, model_dir):
    """The slice of vLLM's model runner the reload touches, recording what it is given."""
    model = torch.nn.Module()  # the sync walks the model's modules (cached fp32 heads)
    model.config = types.SimpleNamespace(tie_word_embeddings=False)
    runner = types.SimpleNamespace(
        model_config=types.SimpleNamespace(model=str(model_dir), quantization=None, dtype=engine_dtype),
        vllm_config=types.SimpleNamespace(name="the engine's vLLM config"),
        model=model, reloaded=[], reload_default_dtypes=[], reload_vllm_configs=[],
    )

    def reload_weights(weights_iterator):
        from vllm.config import get_current_vllm_config_or_none

        runner.reload_default_dtypes.append(torch.get_default_dtype())  # vLLM's loaders read it (static int8)
        runner.reload_vllm_configs.append(get_current_vllm_config_or_none())  # layers may ask for it
        runner.reloaded.extend(weights_iterator)

    runner.reload_weights = reload_weights
    return runner


def _worker(engine_dtype, sent, model_dir) -> CPUWorkerExtension:
    """The extension as vLLM's worker holds it: model config, runner and the joined sync group."""
    worker = CPUWorkerExtension()
    worker.model_config = types.SimpleNamespace(dtype=engine_dtype)
    worker.model_runner = _runner(engine_dtype, model_dir)
    worker._model_update_with_ray = False
    worker._model_update_group = _FilledGroup(sent)
    return worker


def test_cpu_weight_sync_buffers_until_the_last_tensor_and_upcasts_for_fp32_engines(tmp_path):
    sent = torch.randn(4, 3).to(torch.bfloat16)
    worker = _worker(torch.float32, sent, tmp_path)
    worker.update_weight("a.weight", torch.bfloat16, (4, 3))
    assert worker.model_runner.reloaded == []  # nothing reaches the engine before the sync's last tensor
    worker.update_weight("b.weight", torch.bfloat16, (4, 3), empty_cache=True)
    names = [name for name, _ in worker.model_runner.reloaded]
    assert names == ["a.weight", "b.weight"]
    for _, weight in worker.model_runner.reloaded:
        assert weight.dtype == torch.float32 and torch.equal(weight, sent.float())  # bf16 -> fp32 is exact
    assert worker.model_runner.reload_default_dtypes == [torch.float32]

    fp32_sent = torch.randn(4, 3, dtype=torch.float64).float()
    bf16_engine = _worker(torch.bfloat16, fp32_sent, tmp_path)  # an fp32 trainer (--ds.param_dtype fp32)
    bf16_engine.update_weight("a.weight", torch.float32, (4, 3), empty_cache=True)
    ((_, weight),) = bf16_engine.model_runner.reloaded
    assert weight.dtype == torch.bfloat16 and torch.equal(weight, fp32_sent.to(torch.bfloat16))  # round to nearest

    int_engine = _worker(torch.bfloat16, torch.zeros(4, 3, dtype=torch.int32), tmp_path)
    with pytest.raises(TypeError, match="--ds.param_dtype"):
        int_engine.update_weight("a.weight", torch.int32, (4, 3))


def test_bucketed_receive_splits_one_broadcast_into_the_named_tensors(tmp_path):
    a, b = torch.randn(4, 3).to(torch.bfloat16), torch.randn(5).to(torch.bfloat16)
    worker = _worker(torch.bfloat16, torch.cat([a.reshape(-1), b]), tmp_path)
    worker.update_weights_bucket([("a.weight", (4, 3)), ("b.bias", (5,))], torch.bfloat16, last=True)
    (name_a, got_a), (name_b, got_b) = worker.model_runner.reloaded
    assert (name_a, name_b) == ("a.weight", "b.bias")
    assert torch.equal(got_a, a) and torch.equal(got_b, b)
    # the reload runs under the engine dtype, as vLLM's own load does; the caller's default comes back
    assert worker.model_runner.reload_default_dtypes == [torch.bfloat16]
    assert torch.get_default_dtype() == torch.float32


def test_the_reload_runs_with_the_engines_vllm_config_current_as_workers_reload_weights_sets_it(tmp_path):
    """vLLM's `Worker.reload_weights` wraps the runner's in `set_current_vllm_config`; the fork calls the runner
    itself, so it sets the config: a layer whose processing asks for it would raise otherwise."""
    from vllm.config import get_current_vllm_config_or_none

    worker = _worker(torch.bfloat16, torch.randn(3).to(torch.bfloat16), tmp_path)
    assert get_current_vllm_config_or_none() is None
    worker.update_weights_bucket([("a.weight", (3,))], torch.bfloat16, last=True)
    assert worker.model_runner.reload_vllm_configs == [worker.model_runner.vllm_config]
    assert get_current_vllm_config_or_none() is None  # and unset again after it


def test_sync_with_ray_is_refused_at_the_receive(tmp_path):
    worker = _worker(torch.bfloat16, torch.zeros(3), tmp_path)
    worker._model_update_with_ray = True
    with pytest.raises(RuntimeError, match="--vllm.sync_with_ray is not supported on CPU"):
        worker.update_weights_bucket([("a.weight", (3,))], torch.bfloat16, last=True)


def test_trainer_and_extension_meet_in_one_gloo_group(monkeypatch, tmp_path):
    """Both ends over a real gloo group: the trainer's (the cpu_weight_sync patch) and the extension's."""
    from openrlhf_tis.rollout.weight_sync.group import gloo_sync_group

    monkeypatch.setattr(torch.distributed, "get_rank", lambda *a, **k: 0)  # the engine's own (world of 1) rank
    worker = CPUWorkerExtension()  # no group yet: init_process_group joins one
    worker.model_config = types.SimpleNamespace(dtype=torch.bfloat16)
    worker.model_runner = _runner(torch.bfloat16, tmp_path)
    port = free_port()
    a, b = torch.randn(2, 3).to(torch.bfloat16), torch.randn(4).to(torch.bfloat16)
    with ThreadPoolExecutor(1) as trainer:
        group = trainer.submit(gloo_sync_group, "127.0.0.1", port, 0, 2)
        worker.init_process_group("127.0.0.1", port, 1, 2, "openrlhf_tis_test", "gloo", False)
        assert isinstance(group.result(timeout=60), GlooBroadcastGroup)
        assert isinstance(worker._model_update_group, GlooBroadcastGroup) and not worker._model_update_with_ray
        assert worker._model_update_group.rank == 1
        sent = trainer.submit(group.result().broadcast, torch.cat([a.reshape(-1), b]), 0)
        worker.update_weights_bucket([("a.weight", (2, 3)), ("b.bias", (4,))], torch.bfloat16, last=True)
        sent.result(timeout=60)
    (_, got_a), (_, got_b) = worker.model_runner.reloaded
    assert torch.equal(got_a, a) and torch.equal(got_b, b)


# ── CUDA: the buffered, re-quantizing receive of a quantized engine ──

def test_override_names_the_quantized_receive_on_cuda_only_for_quantized_engines():
    from vllm.utils.import_utils import resolve_obj_by_qualname

    assert worker_extension_override(UPSTREAM_WORKER_EXTENSION, cuda=True, quantized=True) == {
        "worker_extension_cls": "openrlhf_tis.rollout.weight_sync.receive_cuda.QuantizedCUDAWorkerExtension"}
    assert worker_extension_override(None, cuda=True, quantized=True) == {"worker_extension_cls": CUDA_QUANTIZED}
    assert worker_extension_override(None, cuda=True, quantized=False) == {}
    assert resolve_obj_by_qualname(CUDA_QUANTIZED) is QuantizedCUDAWorkerExtension
    with pytest.raises(RuntimeError, match="worker_extension_cls='other.Ext'"):
        worker_extension_override("other.Ext", cuda=True, quantized=True)


@pytest.mark.parametrize(("plan", "quantized"), [
    ({"precision": "int8"}, True), ({"precision": "fp8", "fp8_block": [128, 128]}, True),
    ({"precision": "fp8", "fp8_block": None}, False), ({"precision": "bf16"}, False), (None, False)])
def test_a_plan_is_quantized_when_a_sync_must_re_quantize_into_it(tmp_path, plan, quantized):
    from openrlhf_tis.rollout.checkpoint import PLAN_FILE
    from openrlhf_tis.rollout.engine_actor import is_quantized_plan

    if plan is not None:
        (tmp_path / PLAN_FILE).write_text(json.dumps(plan))
    assert is_quantized_plan(str(tmp_path)) is quantized


class _Model(torch.nn.Module):
    def load_weights(self, weights):
        raise AssertionError("a quantized engine's parameters must not be loaded tensor by tensor")


class _Group:
    """Upstream's sync group as its receive calls it (`broadcast(tensor, src, stream)`): fills the next tensor."""

    def __init__(self, tensors):
        self.tensors = iter(tensors)

    def broadcast(self, tensor, src=0, stream=None):
        tensor.copy_(next(self.tensors))


def test_upstreams_cuda_receive_is_buffered_until_the_last_tensor_then_reloaded_once(monkeypatch):
    """Upstream's own `WorkerWrap.update_weight` (NCCL path) runs here with its CUDA buffer on the CPU; the fork's
    extension must load nothing until the sync's last tensor, then reload all of them once, through vLLM 0.29's
    `reload_weights(weights_iterator=...)`, and return the re-quantization's statistics."""
    from openrlhf_tis.rollout.weight_sync import reload

    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, device=None, **k: empty(*a, **k))  # "cuda" -> the CPU
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: None)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 1)
    reloads = []
    monkeypatch.setattr(reload, "reload_into_engine",
                        lambda runner, named: reloads.append([(n, t.clone()) for n, t in named]) or {"sync": 1})
    sent = [("a.weight", torch.full((2, 3), 1.5, dtype=torch.bfloat16)),
            ("b.weight", torch.full((4,), -2.0, dtype=torch.bfloat16))]
    worker = QuantizedCUDAWorkerExtension()
    worker.model_config = SimpleNamespace(dtype=torch.bfloat16)
    worker.model_runner = SimpleNamespace(model=_Model())
    worker._model_update_with_ray, worker._model_update_group = False, _Group([t for _, t in sent])
    results = [worker.update_weight(name, t.dtype, tuple(t.shape), empty_cache=i == len(sent) - 1)
               for i, (name, t) in enumerate(sent)]
    assert results == [None, {"sync": 1}]
    (reloaded,) = reloads
    assert [n for n, _ in reloaded] == ["a.weight", "b.weight"]
    assert all(torch.equal(got, want) for (_, got), (_, want) in zip(reloaded, sent, strict=True))
    assert "load_weights" not in vars(worker.model_runner.model)  # the model's own method is back


def test_the_models_load_weights_is_restored_when_a_receive_fails():
    from openrlhf_tis.rollout.weight_sync.receive_cuda import loads_collected

    model, kept = _Model(), []
    with pytest.raises(RuntimeError, match="broadcast failed"), loads_collected(model, kept):
        model.load_weights([("a", torch.ones(1))])
        raise RuntimeError("broadcast failed")
    assert len(kept) == 1 and "load_weights" not in vars(model)
    with pytest.raises(AssertionError, match="tensor by tensor"):
        model.load_weights([("a", torch.ones(1))])
