"""Routing replay in the actor's forwards (openrlhf_tis/trainer/moe_replay.py) through upstream's own `Actor`, on a tiny
random Qwen3-MoE: a right-padded batch replays each sample's routing on that sample's tokens, and the step's tally
measures the engine's routing against the routers' own choice while replaying."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from openrlhf_tis import patches

patches.apply_platform_patches("cpu")  # openrlhf.models imports flash_attn at module level
from openrlhf.models import Actor  # noqa: E402
from openrlhf.trainer.ppo_utils.experience import Experience  # noqa: E402

from openrlhf_tis.moe.routing_batch import ROUTED_EXPERTS  # noqa: E402
from openrlhf_tis.moe.routing_metrics import NO_ROUTE  # noqa: E402
from openrlhf_tis.moe.routing_replay import replaying  # noqa: E402
from openrlhf_tis.trainer.moe_replay import ActorRouting, replay_training_step, unwrapped_model  # noqa: E402

LAYERS, EXPERTS = 3, 6
LENGTHS = (7, 4)


@pytest.fixture(scope="module")
def actor():
    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=64, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                            intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=LAYERS,
                            num_experts=EXPERTS, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1])
    model = Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():
        for module in model.modules():
            if type(module).__name__.endswith("TopKRouter"):  # spread logits: a distinct top-k per token
                module.weight.normal_(0.0, 1.0)
    actor = Actor(model)
    actor.packing_samples = False  # upstream sets it only when it loads the model itself
    return actor


def _samples() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, 64, (n,), generator=gen) for n in LENGTHS]


def _own_routing(actor, routing: ActorRouting, tokens: torch.Tensor) -> torch.Tensor:
    """(tokens, layers, k): what the model routes this sample to, run alone."""
    with torch.no_grad(), replaying(routing.routers, None, num_layers=LAYERS) as record:
        unwrapped_model(actor)(tokens[None])
    return record.trainer_choice()


def _other(own: torch.Tensor) -> torch.Tensor:
    """For every routed (token, layer) the two lowest experts outside its own pair: always another set."""
    other = own.clone()
    for index in (own[..., 0] != NO_ROUTE).nonzero():
        chosen = set(own[tuple(index)].tolist())
        other[tuple(index)] = torch.tensor([e for e in range(EXPERTS) if e not in chosen][:2])
    return other


def _batch(samples: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in samples)
    sequences = torch.zeros(len(samples), width, dtype=torch.long)
    mask = torch.zeros_like(sequences)
    for i, tokens in enumerate(samples):
        sequences[i, :len(tokens)], mask[i, :len(tokens)] = tokens, 1
    return sequences, mask


def _log_probs(actor, sequences, mask) -> torch.Tensor:
    action_mask = torch.ones(sequences.shape[0], sequences.shape[1] - 1)
    return actor(sequences, action_mask, attention_mask=mask)


def _experience(sequences, mask, engine, gaps: tuple[float, float]) -> Experience:
    """The two samples with 4 and 2 action tokens, the engine's routing, and log μ = log π_old + each sample's gap."""
    old = -torch.rand(2, sequences.shape[1] - 1)
    rollout = old + torch.tensor(gaps)[:, None]
    action_mask = torch.zeros_like(old, dtype=torch.bool)
    action_mask[0, 2:6], action_mask[1, 1:3] = True, True
    return Experience(sequences=sequences, attention_mask=mask, action_mask=action_mask, action_log_probs=old,
                      rollout_log_probs=rollout, info={ROUTED_EXPERTS: [e.short() for e in engine]})


def test_a_padded_batch_replays_each_sample_on_its_own_tokens(actor):
    routing = ActorRouting(unwrapped_model(actor), packed=False)
    samples = _samples()
    replayed = [_other(_own_routing(actor, routing, s)) for s in samples]
    replayed[1][0] = NO_ROUTE  # a prefix-cached token: the trainer's own choice
    sequences, mask = _batch(samples)
    with torch.no_grad():
        with routing.replaying(replayed, mask):
            batched = _log_probs(actor, sequences, mask)
        own = _log_probs(actor, sequences, mask)
        for i, tokens in enumerate(samples):  # reference: the sample alone, its routing replayed on it
            with replaying(routing.routers, replayed[i], num_layers=LAYERS):
                alone = _log_probs(actor, tokens[None], torch.ones(1, len(tokens), dtype=torch.long))[0]
            n = len(tokens) - 1
            torch.testing.assert_close(batched[i, :n], alone, rtol=0, atol=1e-5)
            assert (batched[i, :n] - own[i, :n]).abs().max() > 1e-3  # other experts: the test can fail


def test_a_training_step_replays_and_tallies_the_routers_own_choice(actor):
    routing = ActorRouting(unwrapped_model(actor), packed=False)
    samples = _samples()
    own = [_own_routing(actor, routing, s) for s in samples]
    engine = [own[0], _other(own[1])]  # sample 0: the engine routed as the trainer; sample 1: never
    sequences, mask = _batch(samples)
    experience = _experience(sequences, mask, engine, gaps=(0.1, 0.1))
    mismatch = []

    def step(batch):
        _log_probs(actor, sequences, mask)
        mismatch.append(batch.mismatch_by_position())  # what a token dump of this micro-batch reads
        return {}

    status = replay_training_step(routing, experience, step)
    assert status == {} and ROUTED_EXPERTS not in experience.info  # upstream logs every info entry
    differed, compared = mismatch[0]
    assert compared.tolist() == [[True] * 7, [True] * 4 + [False] * 3]  # sample 1's padding is not compared
    assert not differed[0].any()  # the engine routed sample 0 as the trainer does
    assert differed[1, :4].tolist() == [[True, False, True]] * 4  # sample 1: other experts in both MoE layers
    assert not differed[1, 4:].any()
    metrics = routing.step_metrics(None, "cpu")
    routed = [int((r[:, [0, 2], 0] != NO_ROUTE).sum()) for r in engine]  # layer 1 has no experts
    assert metrics["moe/routing_agreement"] == pytest.approx(routed[0] / sum(routed))
    assert metrics["moe/routing_agreement_layer_0"] == pytest.approx(routed[0] / sum(routed))
    assert "moe/routing_agreement_layer_1" not in metrics
    assert metrics["moe/tokens_routing_differed"] == pytest.approx(2 / 6)  # 4 action tokens agree, 2 differ
    k3 = math.exp(-0.1) - 1 + 0.1  # log π_old − log μ = −0.1 on every action token
    assert metrics["moe/k3_routing_differed"] == pytest.approx(k3)
    assert metrics["moe/k3_routing_same"] == pytest.approx(k3)
    assert math.isnan(routing.step_metrics(None, "cpu")["moe/routing_agreement"])  # the tally restarted


def test_measure_routes_on_its_own_and_tallies_the_engines_routing_against_it(actor):
    """`measure`: the step's forward is the unpatched model's (nothing replayed, the engine's routing notwithstanding),
    and the tally compares the engine's routing with the routers' own choice in that forward, k3 split by cause."""
    routing = ActorRouting(unwrapped_model(actor), packed=False, replays=False)
    samples = _samples()
    own = [_own_routing(actor, routing, s) for s in samples]
    engine = [own[0], _other(own[1])]
    sequences, mask = _batch(samples)
    with torch.no_grad():
        unpatched = _log_probs(actor, sequences, mask)
    experience = _experience(sequences, mask, engine, gaps=(0.0, 0.3))  # sample 1, routed differently, carries it
    seen = []

    def step(batch):
        with torch.no_grad():
            seen.append(_log_probs(actor, sequences, mask))
        return {}

    replay_training_step(routing, experience, step)
    assert torch.equal(seen[0], unpatched)  # the engine's other experts were not used
    metrics = routing.step_metrics(None, "cpu")
    routed = [int((r[:, [0, 2], 0] != NO_ROUTE).sum()) for r in engine]
    assert metrics["moe/routing_agreement"] == pytest.approx(routed[0] / sum(routed))
    assert metrics["moe/tokens_routing_differed"] == pytest.approx(2 / 6)
    assert metrics["moe/k3_routing_differed"] == pytest.approx(math.exp(-0.3) - 1 + 0.3)
    assert metrics["moe/k3_routing_same"] == pytest.approx(0.0)


def _differed(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(tokens,) whether two routings' top-k sets differ in some layer (sorted: a top-k's order is the kernel's)."""
    return (a.sort(-1).values != b.sort(-1).values).any(-1).any(-1)


def test_r2_records_pi_old_routing_and_the_update_replays_it_after_the_weights_moved(actor):
    """R2: the π_old forward records what the routers chose (each sample's own routing, as if run alone); once the
    weights moved (the policy update), the π_θ forward replays that routing, not the new router's, and the step's
    moe/* count the tokens whose new routing departed from π_old's."""
    routing = ActorRouting(unwrapped_model(actor), packed=False, k3_by_cause=False)
    samples = _samples()
    sequences, mask = _batch(samples)
    with torch.no_grad():
        old_log_probs, recorded = routing.record_own(lambda: _log_probs(actor, sequences, mask), mask)
        for tokens, own in zip(samples, recorded, strict=True):
            assert own.dtype == torch.int16 and torch.equal(own.long(), _own_routing(actor, routing, tokens))
        saved = {layer: router.weight.detach().clone() for layer, router in routing.routers.items()}
        gen = torch.Generator().manual_seed(3)
        for router in routing.routers.values():  # the update moved the routers
            router.weight.add_(0.6 * torch.randn(router.weight.shape, generator=gen))
    try:
        moved = [_own_routing(actor, routing, tokens) for tokens in samples]
        changed = torch.cat([_differed(a, b.long()) for a, b in zip(moved, recorded, strict=True)])
        assert 0 < int(changed.sum()) < len(changed)  # some tokens route elsewhere now: the test can fail
        action_mask = mask[:, 1:].bool()  # every next token of each sample is an action
        experience = Experience(sequences=sequences, attention_mask=mask, action_mask=action_mask,
                                action_log_probs=old_log_probs, rollout_log_probs=None,
                                info={ROUTED_EXPERTS: recorded})
        trained = []
        with torch.no_grad():
            replay_training_step(routing, experience, lambda batch: trained.append(_log_probs(actor, sequences, mask)))
            for i, tokens in enumerate(samples):
                with replaying(routing.routers, recorded[i], num_layers=LAYERS):
                    alone = _log_probs(actor, tokens[None], torch.ones(1, len(tokens), dtype=torch.long))[0]
                torch.testing.assert_close(trained[0][i, :len(tokens) - 1], alone, rtol=0, atol=1e-5)
            assert (trained[0] - _log_probs(actor, sequences, mask))[action_mask].abs().max() > 1e-3
        metrics = routing.step_metrics(None, "cpu")
        scored = torch.cat([_differed(a, b.long())[:-1] for a, b in zip(moved, recorded, strict=True)])
        assert metrics["moe/tokens_routing_differed"] == pytest.approx(float(scored.float().mean()))
        pairs = torch.cat([(a.sort(-1).values == b.long().sort(-1).values).all(-1)[:, [0, 2]]
                           for a, b in zip(moved, recorded, strict=True)])
        assert metrics["moe/routing_agreement"] == pytest.approx(float(pairs.float().mean()))
        assert "moe/k3_routing_differed" not in metrics and "moe/k3_routing_same" not in metrics
    finally:
        with torch.no_grad():
            for layer, router in routing.routers.items():
                router.weight.copy_(saved[layer])
