"""Routing replay on the controller (trainer/actor_forward.py's seam, trainer/moe_experience.py): the engines'
experts go to the actor group's π_old forward and to no other group's, and not to a forward dispatched outside
`make_experience` (the weight-sync check's). Upstream's `RemoteExperienceMaker` is the real class; only its two
methods are replaced by recorders. Bypass, the seam's other user: tests/test_actor_wiring.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from openrlhf_tis import patches

patches.apply_platform_patches("cpu")  # openrlhf.models imports flash_attn at module level
from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker  # noqa: E402

from openrlhf_tis.moe.routing_batch import ROUTED_EXPERTS  # noqa: E402
from openrlhf_tis.trainer.moe_experience import RoutingExperienceMaker  # noqa: E402


@pytest.fixture()
def dispatched(monkeypatch) -> list[tuple[str, list[str]]]:
    """(group, forward kwargs) of every forward upstream's dispatch sends; make_experience forwards actor then ref."""
    calls = []

    def dispatch(self, group, sync_condition, **kwargs):
        calls.append((group, sorted(kwargs)))
        return f"{group} forward"

    def make_experience(self, samples_list):
        return [self._dispatch_forward(group, None, sequences=len(samples_list)) for group in ("actor", "ref")]

    monkeypatch.setattr(RemoteExperienceMaker, "_dispatch_forward", dispatch)
    monkeypatch.setattr(RemoteExperienceMaker, "make_experience", make_experience)
    return calls


def _maker(cls):
    maker = object.__new__(cls)
    maker.actor_model_group = "actor"
    return maker


def test_routing_replay_gives_the_experts_to_the_actor_forward_only(dispatched):
    experts = [torch.tensor([[1, 2]]), torch.tensor([[0, 3]])]
    maker = _maker(RoutingExperienceMaker)
    assert maker.make_experience([SimpleNamespace(info={ROUTED_EXPERTS: e}) for e in experts]) == [
        "actor forward", "ref forward"]
    assert dispatched == [("actor", ["routed_experts", "sequences"]), ("ref", ["sequences"])]
    dispatched.clear()
    assert maker._dispatch_forward("actor", None, sequences=1) == "actor forward"  # outside make_experience
    assert dispatched == [("actor", ["sequences"])]


def test_routing_replay_refuses_samples_without_experts_and_forgets_them(dispatched):
    maker = _maker(RoutingExperienceMaker)
    samples = [SimpleNamespace(info={ROUTED_EXPERTS: torch.zeros(1, 2)}), SimpleNamespace(info={})]
    with pytest.raises(RuntimeError, match=r"--vllm.routing_replay r3: 1 of 2 micro-batches"):
        maker.make_experience(samples)
    assert maker._samples_in_flight is None
    maker._dispatch_forward("actor", None)
    assert dispatched == [("actor", [])]

