"""Routing replay in the trainer's MoE blocks (openrlhf_tis/moe/routing_replay.py), on tiny random MoE models of
each covered architecture built here (no hub).

Replaying the model's own choice changes nothing, bit for bit; replaying other experts gives what a float64
formula written here gives from the block's weights (softmax over every expert, the replayed experts' probabilities,
renormalised as the architecture does), and the router's gradient is that formula's; each layer's experts receive
that layer's replayed indices, batch-major.
"""

from __future__ import annotations

import importlib.metadata

import pytest
import torch
from transformers import (
    MixtralConfig,
    MixtralForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from openrlhf_tis.errors import UsageError
from openrlhf_tis.moe.routing_metrics import NO_ROUTE
from openrlhf_tis.moe.routing_replay import install_routing_replay, replaying
from openrlhf_tis.upstream_guards import UnsupportedUpstreamError

SHAPES = dict(vocab_size=64, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8)


def _qwen3(norm_topk_prob: bool = True):
    # layer 1 has no experts (mlp_only_layers): its slot in a routing is ignored
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**SHAPES, intermediate_size=48, moe_intermediate_size=16,
                                              num_hidden_layers=3, num_experts=6, num_experts_per_tok=2,
                                              norm_topk_prob=norm_topk_prob, mlp_only_layers=[1]))


def _mixtral():
    return MixtralForCausalLM(MixtralConfig(**SHAPES, intermediate_size=16, num_hidden_layers=2, num_local_experts=5,
                                            num_experts_per_tok=2))


def _olmoe():
    return OlmoeForCausalLM(OlmoeConfig(**SHAPES, intermediate_size=16, num_hidden_layers=2, num_experts=5,
                                        num_experts_per_tok=3, eos_token_id=0, pad_token_id=1))


BUILDERS = {"qwen3_moe": _qwen3, "qwen3_moe_unnormalised": lambda: _qwen3(False), "mixtral": _mixtral,
            "olmoe": _olmoe}
RENORMALISES = {"qwen3_moe": True, "qwen3_moe_unnormalised": False, "mixtral": True, "olmoe": False}
"""By hand from each architecture's router: Mixtral always renormalises its top-k, Qwen3-MoE and OLMoE when the
config's norm_topk_prob says so (OLMoE's default is False)."""


def _model(name: str, dtype: torch.dtype = torch.float32):
    torch.manual_seed(0)
    model = BUILDERS[name]().to(dtype).eval()
    with torch.no_grad():
        for module in model.modules():
            if type(module).__name__.endswith("TopKRouter"):  # spread logits: no ties, a distinct top-k per token
                module.weight.normal_(0.0, 1.0)
    return model


def _tokens(batch: int = 2, length: int = 7) -> torch.Tensor:
    return torch.randint(0, SHAPES["vocab_size"], (batch, length), generator=torch.Generator().manual_seed(1))


def _other_experts(own: torch.Tensor, num_experts: int) -> torch.Tensor:
    """For each routed (token, layer): the experts not in `own`, highest index first, topped up from `own` when
    there are fewer than k: every replayed set differs from the trainer's own."""
    other = own.clone()
    routed = own[..., 0] != NO_ROUTE
    for index in routed.nonzero():
        chosen = set(own[tuple(index)].tolist())
        rest = [e for e in range(num_experts - 1, -1, -1) if e not in chosen]
        other[tuple(index)] = torch.tensor((rest + sorted(chosen))[:own.shape[-1]])
    return other


@pytest.mark.parametrize("name", sorted(BUILDERS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_replaying_the_own_choice_is_bit_identical(name, dtype):
    model, ids = _model(name, dtype), _tokens()
    with torch.no_grad():
        before = model(ids).logits
        routers = install_routing_replay(model)
        layers = model.config.num_hidden_layers
        with replaying(routers, None, num_layers=layers) as record:
            recorded = model(ids).logits
        own = record.trainer_choice()
        with replaying(routers, own.reshape(*ids.shape, layers, -1), num_layers=layers):
            replayed = model(ids).logits
        with replaying(routers, torch.full_like(own, NO_ROUTE), num_layers=layers):  # nothing replayed
            unrouted = model(ids).logits
        after = model(ids).logits
    assert torch.equal(before, recorded) and torch.equal(before, replayed) and torch.equal(before, unrouted)
    assert torch.equal(before, after)  # outside the block, upstream's routing untouched
    assert sorted(routers) == [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "gate")]
    assert (own[:, [i for i in range(layers) if i not in routers]] == NO_ROUTE).all()


def _reference(block, x: torch.Tensor, experts: torch.Tensor, renormalise: bool):
    """The block's output and router weight in float64 for chosen `experts` (tokens, k), from its weights."""
    router_w = block.gate.weight.detach().double().requires_grad_(True)
    gate_up, down = block.experts.gate_up_proj.detach().double(), block.experts.down_proj.detach().double()
    h = x.double()
    probs = torch.softmax(h @ router_w.T, dim=-1)
    gates = probs.gather(1, experts)
    if renormalise:
        gates = gates / gates.sum(-1, keepdim=True)
    out = torch.zeros_like(h)
    for slot in range(experts.shape[1]):
        e = experts[:, slot]
        g, u = torch.einsum("th,tih->ti", h, gate_up[e]).chunk(2, dim=-1)
        out = out + gates[:, slot, None] * torch.einsum("ti,thi->th", torch.nn.functional.silu(g) * u, down[e])
    return out, router_w


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_other_experts_follow_the_float64_formula_and_the_router_keeps_its_gradient(name):
    model = _model(name)
    routers = install_routing_replay(model)
    layer = next(iter(routers))
    block = model.model.layers[layer].mlp
    x = torch.randn(2, 5, model.config.hidden_size, generator=torch.Generator().manual_seed(2))
    tokens = x.reshape(-1, x.shape[-1])
    with torch.no_grad(), replaying({layer: block.gate}, None, num_layers=1) as record:
        own_out = block(x)
    own = record.trainer_choice()
    other = _other_experts(own, block.gate.num_experts)
    with replaying({layer: block.gate}, other, num_layers=1) as record:
        out = block(x)
        out.pow(2).sum().backward()
    assert torch.equal(record.trainer_choice(), own)  # the trainer's own choice is still recorded
    expected, router_w = _reference(block, tokens, other[:, 0], RENORMALISES[name])
    expected.pow(2).sum().backward()
    torch.testing.assert_close(out.reshape(-1, x.shape[-1]).double(), expected, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(out, own_out, atol=1e-3)  # guards the test: other experts, another output
    torch.testing.assert_close(block.gate.weight.grad.double(), router_w.grad, rtol=1e-4, atol=1e-6)
    assert block.gate.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_each_layer_receives_its_replayed_experts_batch_major(name):
    model, ids = _model(name), _tokens(batch=3, length=4)
    routers = install_routing_replay(model)
    layers = model.config.num_hidden_layers
    seen = {}
    hooks = [model.model.layers[i].mlp.experts.register_forward_pre_hook(
        lambda _m, args, i=i: seen.__setitem__(i, args[1].clone())) for i in routers]
    with torch.no_grad(), replaying(routers, None, num_layers=layers) as record:
        model(ids)
    own = record.trainer_choice()
    other = _other_experts(own, model.config.num_local_experts).reshape(*ids.shape, layers, -1)
    with torch.no_grad(), replaying(routers, other, num_layers=layers):
        model(ids)
    for hook in hooks:
        hook.remove()
    for i in routers:
        assert torch.equal(seen[i], other[:, :, i].reshape(-1, other.shape[-1])), i


def test_a_token_left_unrouted_keeps_the_trainers_choice():
    model, ids = _model("qwen3_moe"), _tokens()
    routers, layers = install_routing_replay(model), model.config.num_hidden_layers
    with torch.no_grad(), replaying(routers, None, num_layers=layers) as record:
        model(ids)
    own = record.trainer_choice()
    other = _other_experts(own, model.config.num_experts)
    mixed = other.clone()
    mixed[3:] = NO_ROUTE  # tokens from the fourth on: no replay
    seen = {}
    hook = model.model.layers[0].mlp.experts.register_forward_pre_hook(
        lambda _m, args: seen.__setitem__(0, args[1].clone()))
    with torch.no_grad(), replaying(routers, mixed, num_layers=layers):
        model(ids)
    hook.remove()
    assert torch.equal(seen[0][:3], other[:3, 0]) and torch.equal(seen[0][3:], own[3:, 0])


@pytest.mark.parametrize("build, reason", [
    (lambda: Qwen2ForCausalLM(Qwen2Config(**SHAPES, intermediate_size=16, num_hidden_layers=1)), "dense model"),
    (lambda: Qwen2MoeForCausalLM(Qwen2MoeConfig(**SHAPES, intermediate_size=16, moe_intermediate_size=8,
                                                 shared_expert_intermediate_size=8, num_hidden_layers=1,
                                                 num_experts=4, num_experts_per_tok=2)), "does not replace"),
])
def test_refused_with_the_reason_naming_the_flag(build, reason):
    with pytest.raises(UsageError, match=reason) as refused:
        install_routing_replay(build())
    assert "--vllm.routing_replay" in str(refused.value)


@pytest.mark.parametrize("change, message", [
    (lambda r: r[:, :2], "layers"),  # the layer axis cut short
    (lambda r: r[..., :1], "routes to 2 experts"),
    (lambda r: r.float(), "integers"),
    (lambda r: r.index_fill(-1, torch.tensor([1]), 99), "outside"),
    (lambda r: r.index_fill(-1, torch.tensor([1]), NO_ROUTE), "some experts replayed and some not"),
    (lambda r: r[..., :1].expand(r.shape).clone(), "same expert twice"),
    (lambda r: r[:5], "sees"),  # fewer tokens than the forward
])
def test_a_replay_that_would_route_wrong_is_refused(change, message):
    model, ids = _model("qwen3_moe"), _tokens()
    routers, layers = install_routing_replay(model), model.config.num_hidden_layers
    with torch.no_grad(), replaying(routers, None, num_layers=layers) as record:
        model(ids)
    with pytest.raises(ValueError, match=message), torch.no_grad(), \
            replaying(routers, change(record.trainer_choice()), num_layers=layers):
        model(ids)
    assert not any(hasattr(r, "_openrlhf_tis_routes") for r in routers.values())  # the block cleaned up


def test_another_transformers_is_refused_before_any_router_changes(monkeypatch):
    model = _model("mixtral")
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "5.20.0" if name == "transformers" else real(name))
    with pytest.raises(UnsupportedUpstreamError, match=r"moe/routing_replay\.py.*transformers>=5\.19,<5\.20.*5\.20\.0"):
        install_routing_replay(model)
    assert all(type(m).__name__ != "ReplayMixtralTopKRouter" for m in model.modules())


def _router_grads(model, ids, replayed, *, backward_inside: bool) -> list[torch.Tensor]:
    model.zero_grad()
    routers, layers = install_routing_replay(model), model.config.num_hidden_layers
    with replaying(routers, replayed, num_layers=layers):
        loss = model(ids).logits.float().pow(2).mean()
        if backward_inside:
            loss.backward()
    if not backward_inside:
        loss.backward()
    return [r.weight.grad.clone() for r in routers.values()]


@pytest.mark.parametrize("reentrant", [False, True])
def test_with_gradient_checkpointing_the_backward_belongs_inside_the_block(reentrant):
    """The backward recomputes each layer's forward: inside `replaying` it routes as replayed (the gradients equal
    those without checkpointing). After the block it would route on its own: torch's non-reentrant checkpointing
    (OpenRLHF's default) refuses the different recomputation, the reentrant one silently gives other gradients."""
    from torch.utils.checkpoint import CheckpointError

    model, ids = _model("qwen3_moe").train(), _tokens()
    routers, layers = install_routing_replay(model), model.config.num_hidden_layers
    with torch.no_grad(), replaying(routers, None, num_layers=layers) as record:
        model(ids)
    other = _other_experts(record.trainer_choice(), model.config.num_experts)
    plain = _router_grads(model, ids, other, backward_inside=False)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    inside = _router_grads(model, ids, other, backward_inside=True)
    for a, b in zip(plain, inside, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-8)
    if not reentrant:
        with pytest.raises(CheckpointError):
            _router_grads(model, ids, other, backward_inside=False)
        return
    outside = _router_grads(model, ids, other, backward_inside=False)
    assert any(not torch.allclose(a, b, rtol=1e-3, atol=1e-6) for a, b in zip(plain, outside, strict=True))
