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
from transformers import Qwen2Config

from openrlhf_tis.rollout import engine_actor
from openrlhf_tis.rollout.engine_actor import (
    CPU_WORKER_EXTENSION,
    UPSTREAM_WORKER_EXTENSION,
    PrecisionRolloutRayActor,
    worker_extension_override,
)
from openrlhf_tis.rollout.engine_actor import (
    CUDA_LAYOUT_EXTENSION as CUDA_LAYOUT,
)
from openrlhf_tis.rollout.engine_actor import (
    CUDA_QUANTIZED_EXTENSION as CUDA_QUANTIZED,
)
from openrlhf_tis.rollout.weight_sync.group import GlooBroadcastGroup
from openrlhf_tis.rollout.weight_sync.receive import CPUWorkerExtension
from openrlhf_tis.rollout.weight_sync.receive_cuda import CUDAWorkerExtension, QuantizedCUDAWorkerExtension


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


def _engine_kwargs(monkeypatch, model_dir) -> tuple[dict, dict]:
    """What upstream's factory passes the engine actor for `model_dir`, and what the fork's actor hands vLLM."""
    import openrlhf.trainer.ray.vllm_engine as upstream_engine

    built = []

    class RecordingActor:
        @staticmethod
        def options(**_):
            return types.SimpleNamespace(remote=lambda **kwargs: built.append(kwargs))

    monkeypatch.setattr(upstream_engine, "RolloutRayActor", RecordingActor)
    upstream_engine.create_vllm_engines(1, 1, str(model_dir), 0, False, False, True, 128, shared_pg=object())
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
    return upstream_kwargs, engine_kwargs


def test_cpu_engine_kwargs_carry_the_fork_extension(monkeypatch, tiny_model_dir):
    """Upstream's factory passes its WorkerWrap; the fork's actor hands vLLM its own class and, on CPU, turns off
    chunked prefill."""
    upstream_kwargs, engine_kwargs = _engine_kwargs(monkeypatch, tiny_model_dir)
    assert engine_kwargs["worker_extension_cls"] == CPU_WORKER_EXTENSION
    # and no chunked prefill on CPU: a seeded request's generator cannot rewind there (rollout/sampling_seeds.py)
    assert engine_kwargs.pop("enable_chunked_prefill") is False
    assert {k: v for k, v in engine_kwargs.items() if k != "worker_extension_cls"} == {
        k: v for k, v in upstream_kwargs.items() if k != "worker_extension_cls"}


def test_a_cuda_engine_of_a_float_model_gets_upstreams_kwargs_unchanged(monkeypatch, tiny_model_dir):
    """On a CUDA run (the run's device, as its driver decided) a CUDA generator rewinds, so chunked prefill stays as
    upstream leaves it, and a float engine keeps upstream's WorkerWrap: nothing is changed."""
    monkeypatch.setenv("OPENRLHF_TIS_RUN_DEVICE", "cuda")
    upstream_kwargs, engine_kwargs = _engine_kwargs(monkeypatch, tiny_model_dir)
    assert engine_kwargs == upstream_kwargs


def test_a_cuda_engine_of_a_mixtral_gets_the_converting_receive(monkeypatch, tmp_path):
    """A transformers 5 Mixtral's trainer parameters are not its checkpoint's: on CUDA the fork's converting receive
    replaces upstream's, and nothing else changes."""
    from openrlhf_tis.demo.tiny_model import build_tiny_moe

    monkeypatch.setenv("OPENRLHF_TIS_RUN_DEVICE", "cuda")
    upstream_kwargs, engine_kwargs = _engine_kwargs(monkeypatch, build_tiny_moe(tmp_path / "m", architecture="mixtral"))
    assert engine_kwargs == {**upstream_kwargs, "worker_extension_cls": CUDA_LAYOUT}


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
    assert worker_extension_override(None, cuda=True, converts=True) == {"worker_extension_cls": CUDA_LAYOUT}
    assert worker_extension_override(None, cuda=True, quantized=True, converts=True) == {  # it converts too
        "worker_extension_cls": CUDA_QUANTIZED}
    assert worker_extension_override(None, cuda=False, converts=True) == {"worker_extension_cls": CPU_WORKER_EXTENSION}
    assert resolve_obj_by_qualname(CUDA_QUANTIZED) is QuantizedCUDAWorkerExtension
    assert resolve_obj_by_qualname(CUDA_LAYOUT) is CUDAWorkerExtension
    assert issubclass(QuantizedCUDAWorkerExtension, CUDAWorkerExtension)
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
        raise AssertionError("a quantized engine's parameters must not be loaded outside a layer-wise reload")


class _Group:
    """Upstream's sync group as its receive calls it (`broadcast(tensor, src, stream)`): fills the next tensor."""

    def __init__(self, tensors):
        self.tensors = iter(tensors)

    def broadcast(self, tensor, src=0, stream=None):
        tensor.copy_(next(self.tensors))


def _layer_of(name: str) -> str:
    """The vLLM module a checkpoint tensor loads into: q/k/v into the fused qkv_proj, gate/up into gate_up_proj."""
    module = name.rsplit(".", 1)[0]
    for parts, fused in ((("q_proj", "k_proj", "v_proj"), "qkv_proj"), (("gate_proj", "up_proj"), "gate_up_proj")):
        head, _, last = module.rpartition(".")
        if last in parts:
            return f"{head}.{fused}"
    return module


class _Layerwise029:
    """vLLM 0.29's layer-wise reload as the receive drives it (vllm.model_executor.model_loader.reload):
    `initialize_layerwise_reload(model)`; `model.load_weights(weights) -> set[str]`, which buffers each layer's
    tensors until all of them arrived, then processes the layer and lets them go; `finalize_layerwise_reload(model,
    model_config)`. Counts the bytes its buffers hold, and checks the current vLLM config during each step."""

    def __init__(self, runner, expected: dict[str, set[str]]):
        self.runner, self.expected = runner, expected  # layer -> the names of the tensors it must receive
        self.buffers: dict[str, list[tuple[str, torch.Tensor]]] = {}
        self.processed: list[tuple[str, list[tuple[str, torch.Tensor]]]] = []
        self.reloading, self.peak, self.steps = False, 0, []

    def _in_config(self) -> None:
        from vllm.config import get_current_vllm_config

        assert get_current_vllm_config() is self.runner.vllm_config  # as Worker.reload_weights sets it

    def initialize_layerwise_reload(self, model) -> None:
        self._in_config()
        assert model is self.runner.model and not self.reloading
        self.reloading = True
        self.steps.append("initialize")

    def load_weights(self, weights) -> set[str]:
        self._in_config()
        assert self.reloading, "a tensor loaded outside a layer-wise reload"
        loaded = set()
        for name, tensor in weights:
            layer = _layer_of(name)
            self.buffers.setdefault(layer, []).append((name, tensor))
            loaded.add(name)
            self.peak = max(self.peak, self.held())
            if {n for n, _ in self.buffers[layer]} == self.expected[layer]:
                self.processed.append((layer, self.buffers.pop(layer)))
        self.steps.append("load")
        return loaded

    def held(self) -> int:
        return sum(t.numel() * t.element_size() for tensors in self.buffers.values() for _, t in tensors)

    def finalize_layerwise_reload(self, model, model_config) -> None:
        self._in_config()
        assert model is self.runner.model and model_config is self.runner.model_config and self.reloading
        assert not self.buffers, f"layers never completed: {sorted(self.buffers)}"
        self.reloading = False
        self.steps.append("finalize")


def _fp8_model(layers: int) -> list[tuple[str, torch.Tensor]]:
    """A decoder's checkpoint tensors in the trainer's order, in bf16 (projections in whole 128x128 blocks)."""
    g = torch.Generator().manual_seed(0)
    shapes = [("model.embed_tokens.weight", (512, 128))]
    for i in range(layers):
        p = f"model.layers.{i}"
        shapes += [(f"{p}.input_layernorm.weight", (128,)), (f"{p}.self_attn.q_proj.weight", (128, 128)),
                   (f"{p}.self_attn.k_proj.weight", (128, 128)), (f"{p}.self_attn.v_proj.weight", (128, 128)),
                   (f"{p}.self_attn.o_proj.weight", (128, 128)), (f"{p}.post_attention_layernorm.weight", (128,)),
                   (f"{p}.mlp.gate_proj.weight", (256, 128)), (f"{p}.mlp.up_proj.weight", (256, 128)),
                   (f"{p}.mlp.down_proj.weight", (128, 256))]
    shapes += [("model.norm.weight", (128,)), ("lm_head.weight", (512, 128))]
    return [(n, (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)) for n, shape in shapes]


def _fp8_worker(tmp_path, sent, monkeypatch):
    """The quantized CUDA extension on a block-FP8 engine whose model follows vLLM 0.29's reload, with upstream's
    NCCL receive running on the CPU (its "cuda" buffer allocated here)."""
    import vllm.model_executor.model_loader.reload as vllm_reload

    from openrlhf_tis.rollout.checkpoint import PLAN_FILE
    from openrlhf_tis.rollout.fp8_blocks import quantize_named_fp8
    from openrlhf_tis.rollout.quantize import is_quantized_weight

    (tmp_path / PLAN_FILE).write_text(json.dumps({"precision": "fp8", "fp8_block": [128, 128]}))
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, device=None, **k: empty(*a, **k))  # "cuda" -> the CPU
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: None)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 1)
    model = _Model()
    model.config = SimpleNamespace(tie_word_embeddings=False)
    hf_config = Qwen2Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                            num_attention_heads=1, num_key_value_heads=1, tie_word_embeddings=False)
    model_config = SimpleNamespace(model=str(tmp_path), dtype=torch.bfloat16, quantization="fp8", hf_config=hf_config)
    runner = SimpleNamespace(model=model, model_config=model_config,
                             vllm_config=SimpleNamespace(model_config=model_config))
    expected: dict[str, set[str]] = {}
    for name, _ in quantize_named_fp8(sent, is_quantized_weight, torch.bfloat16, (128, 128))[0]:
        expected.setdefault(_layer_of(name), set()).add(name)
    fake = _Layerwise029(runner, expected)
    monkeypatch.setattr(vllm_reload, "initialize_layerwise_reload", fake.initialize_layerwise_reload)
    monkeypatch.setattr(vllm_reload, "finalize_layerwise_reload", fake.finalize_layerwise_reload)
    monkeypatch.setattr(model, "load_weights", fake.load_weights)  # the model's own, as 0.29 wraps its loaders
    worker = QuantizedCUDAWorkerExtension()
    worker.model_config = SimpleNamespace(dtype=torch.bfloat16)
    worker.model_runner = runner
    worker._model_update_with_ray, worker._model_update_group = False, _Group([t for _, t in sent])
    return worker, fake


def _sync(worker, sent) -> list:
    return [worker.update_weight(name, t.dtype, tuple(t.shape), empty_cache=i == len(sent) - 1)
            for i, (name, t) in enumerate(sent)]


def test_a_quantized_cuda_sync_holds_at_most_one_layer_never_the_model(tmp_path, monkeypatch):
    """Upstream's own `WorkerWrap.update_weight` (NCCL path) streams each tensor, re-quantized, into vLLM 0.29's
    layer-wise reload: the bytes the reload holds at the peak are one layer's (the largest), not the model's, and
    what it loads is exactly what quantizing the whole model at once gives."""
    from openrlhf_tis.rollout.fp8_blocks import FP8_DTYPE, quantize_named_fp8
    from openrlhf_tis.rollout.quantize import is_quantized_weight

    sent = _fp8_model(layers=4)
    worker, fake = _fp8_worker(tmp_path, sent, monkeypatch)
    results = _sync(worker, sent)
    assert fake.steps[0] == "initialize" and fake.steps[-1] == "finalize"
    assert fake.steps.count("initialize") == fake.steps.count("finalize") == 1  # one reload for the sync
    assert results[:-1] == [None] * (len(sent) - 1)
    assert results[-1]["sync"] == 1 and results[-1]["tensors"] == 4 * 7 and 0 < results[-1]["max_rel_error"] <= 1 / 16

    whole, _ = quantize_named_fp8(sent, is_quantized_weight, torch.bfloat16, (128, 128))
    loaded = [item for _, tensors in fake.processed for item in tensors]
    assert [n for n, _ in loaded] == [n for n, _ in whole]
    assert all(got.dtype == want.dtype and torch.equal(got.view(torch.uint8) if got.dtype == FP8_DTYPE else got,
                                                       want.view(torch.uint8) if want.dtype == FP8_DTYPE else want)
               for (_, got), (_, want) in zip(loaded, whole, strict=True))
    layer_bytes: dict[str, int] = {}
    for name, t in whole:
        layer_bytes[_layer_of(name)] = layer_bytes.get(_layer_of(name), 0) + t.numel() * t.element_size()
    model_bytes = sum(t.numel() * t.element_size() for _, t in sent)  # what buffering the whole sync held
    assert fake.peak == max(layer_bytes.values())  # the embedding, the largest layer here
    assert fake.peak < model_bytes / 8
    assert "load_weights" in vars(worker.model_runner.model)  # only the test's fake: the receive's swap is gone
    assert worker.model_runner.model.load_weights == fake.load_weights

    worker._model_update_group = _Group([t for _, t in sent])
    assert _sync(worker, sent)[-1]["sync"] == 2  # the next sync starts its own reload


def test_a_plain_tensor_is_loaded_as_a_copy_never_as_the_received_memory(tmp_path, monkeypatch):
    """A layer's loader keeps its tensors until the layer completes, and a CUDA IPC tensor is the trainer's memory:
    a tensor the re-quantization passes through unchanged (a norm, the embedding) is copied before it is kept."""
    from openrlhf_tis.rollout.weight_sync.layerwise import owned

    received = [("model.norm.weight", torch.ones(4, dtype=torch.bfloat16)),
                ("a.q_proj.weight", torch.ones(2, 2, dtype=torch.bfloat16))]
    quantized = torch.ones(2, 2, dtype=torch.float32)
    kept = owned([received[0], ("a.q_proj.weight", quantized)], received)
    assert kept[0][1].data_ptr() != received[0][1].data_ptr() and torch.equal(kept[0][1], received[0][1])
    assert kept[1][1] is quantized


def test_a_failed_receive_ends_the_sync_and_restores_the_models_load_weights(tmp_path, monkeypatch):
    sent = _fp8_model(layers=1)
    worker, fake = _fp8_worker(tmp_path, sent, monkeypatch)
    worker._model_update_group = _Group([])  # the broadcast fails at the first tensor
    with pytest.raises(StopIteration):
        _sync(worker, sent)
    assert worker.model_runner.model.load_weights == fake.load_weights
    fake.reloading = False  # the failed sync's engine is left mid-reload (the run stops on its sync check)
    worker._model_update_group = _Group([t for _, t in sent])
    assert _sync(worker, sent)[-1]["sync"] == 1  # a new sync begins a new reload


class _Recorded(torch.nn.Module):
    """A vLLM model's `load_weights` as upstream's receive calls it: keeps (name, copy) of every tensor it loads."""

    def __init__(self):
        super().__init__()
        self.loaded: list[tuple[str, torch.Tensor]] = []

    def load_weights(self, weights) -> set[str]:
        named = [(name, tensor.clone()) for name, tensor in weights]
        self.loaded += named
        return {name for name, _ in named}


@pytest.mark.parametrize("architecture", ["mixtral", "qwen3_moe"])
def test_a_cuda_receive_loads_each_tensor_in_the_checkpoints_layout(tmp_path, monkeypatch, architecture):
    """Upstream's CUDA send (the trainer's names, one parameter at a time) through upstream's own NCCL receive: the
    engine's model loads exactly the tensors `save_pretrained` wrote, names and values, and a trained change in one
    expert reaches that expert's tensor only."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from openrlhf_tis.demo.tiny_model import build_tiny_moe

    model_dir = build_tiny_moe(tmp_path / architecture, architecture=architecture)
    saved = load_file(next(model_dir.glob("*.safetensors")))
    trainer = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    sent = [(name, p.data) for name, p in trainer.named_parameters()]
    assert not {name for name, _ in sent} <= set(saved)  # the trainer's names alone would not load

    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, device=None, **k: empty(*a, **k))  # "cuda" -> the CPU
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: None)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 1)
    model = _Recorded()
    model_config = SimpleNamespace(dtype=torch.float32, hf_config=AutoConfig.from_pretrained(model_dir))
    worker = CUDAWorkerExtension()
    worker.model_config, worker.model_runner = model_config, SimpleNamespace(model=model, model_config=model_config)
    worker._model_update_with_ray, worker._model_update_group = False, _Group([t for _, t in sent])
    assert _sync(worker, sent) == [None] * len(sent)
    assert sorted(name for name, _ in model.loaded) == sorted(saved)
    for name, tensor in model.loaded:
        assert torch.equal(tensor, saved[name]), name
    assert "load_weights" not in vars(model)  # the receive's swap is gone

    changed = [(name, t.clone()) for name, t in sent]
    expert = next(i for i, (name, _) in enumerate(changed) if name.endswith("layers.0.mlp.experts.gate_up_proj"))
    changed[expert][1][1] += 1.0  # expert 1's gate and up projections of layer 0
    model.loaded.clear()
    worker._model_update_group = _Group([t for _, t in changed])
    _sync(worker, changed)
    differ = {name for name, tensor in model.loaded if not torch.equal(tensor, saved[name])}
    prefix = "block_sparse_moe.experts.1" if architecture == "mixtral" else "mlp.experts.1"
    gate_up = ("w1", "w3") if architecture == "mixtral" else ("gate_proj", "up_proj")
    assert differ == {f"model.layers.0.{prefix}.{w}.weight" for w in gate_up}


def test_a_config_transformers_cannot_read_keeps_upstreams_receive(tmp_path, tiny_model_dir):
    """A model whose config needs its own code (or names a type transformers does not know): no skeleton to convert
    through, so the engine keeps upstream's receive rather than failing to start."""
    import shutil

    from openrlhf_tis.rollout.engine_actor import converts_to_checkpoint

    model = tmp_path / "remote"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "model_type": "not_in_transformers",
                                                   "auto_map": {"AutoConfig": "configuration_x.XConfig"}}))
    assert converts_to_checkpoint(str(model)) is False
    assert converts_to_checkpoint(str(tiny_model_dir)) is False  # dense: trainer names are the checkpoint's


class _WorkersAnswering:
    """vLLM's collective_rpc over two workers: the first answers what its receive recorded at a sync's end (the
    re-quantization statistics), the second nothing."""

    def __init__(self):
        self.calls = []

    async def collective_rpc(self, method, args=()):
        self.calls.append(method)
        return [{"sync": 1, "precision": "int8"}, None]


RECEIVES = {  # each receive the engine actor serves: its arguments before the one that ends the sync, and that one
    "update_weight": (("w", "bf16", (2,)), "empty_cache"),
    "update_weight_cuda_ipc": (("w", "bf16", (2,), None), "empty_cache"),
    "update_weights_bucket": (([("w", (2,))], "bf16"), "last"),
}


@pytest.mark.parametrize("receive", sorted(RECEIVES))
def test_every_receive_the_engine_actor_serves_keeps_the_last_calls_sync_statistics(receive):
    """Upstream's trainer picks the receive by transport: NCCL or Ray collective (`update_weight`), CUDA IPC when
    everything is colocated (`update_weight_cuda_ipc`), and the fork's CPU sync sends buckets. Whichever it is, the
    call that ends the sync (`empty_cache` / `last`) hands the workers' records to `last_sync_stats`, the controller's
    `rollout/int8_*` metrics; a call before the end leaves the previous sync's."""
    upstream = {name for name in dir(engine_actor._UpstreamRolloutRayActor) if name.startswith("update_weight")}
    assert upstream <= set(RECEIVES)  # a receive upstream adds must be served here too
    actor = PrecisionRolloutRayActor.__new__(PrecisionRolloutRayActor)
    actor._last_sync_stats, actor.llm = ["the previous sync's"], _WorkersAnswering()
    args, end = RECEIVES[receive]
    for last, expected in ((False, ["the previous sync's"]), (True, [{"sync": 1, "precision": "int8"}])):
        asyncio.run(getattr(actor, receive)(*args, **{end: last}))
        assert asyncio.run(actor.last_sync_stats()) == expected
    assert actor.llm.calls == [receive, receive]
