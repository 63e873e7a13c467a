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
from openrlhf_tis.trainer.moe_experience import (  # noqa: E402
    OwnRoutingExperienceMaker,
    RoutingExperienceMaker,
)


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



def test_r2_asks_the_actor_forward_to_record_and_hands_its_routing_to_the_samples(monkeypatch):
    """R2: only the actor group's π_old forward is asked to record; its per-micro-batch (log-probs, routings) results
    are split: upstream gets the log-probs in order, each micro-batch's `info` its routings; the ref group's results
    pass untouched."""
    calls = []

    def dispatch(self, group, sync_condition, **kwargs):
        calls.append((group, kwargs))
        n = len(kwargs["sequences"])
        if "record_routing" in kwargs:  # one chunk per actor rank, each a list of per-micro-batch results
            return [[(f"old {i}", [torch.tensor([[i]])]) for i in range(n)[:1]],
                    [(f"old {i}", [torch.tensor([[i]])]) for i in range(n)[1:]]]
        return [[f"{group} {i}" for i in range(n)]]

    def flatten(self, refs, duplicate_factor):  # upstream's, with the results in hand instead of Ray's refs
        return [result for chunk in refs[::duplicate_factor] for result in chunk]

    def make_experience(self, samples_list):
        seqs = [s.sequences for s in samples_list]
        refs = [self._dispatch_forward(group, None, sequences=seqs) for group in ("actor", "ref")]
        return [self._flatten_results(r, 1) for r in refs]

    monkeypatch.setattr(RemoteExperienceMaker, "_dispatch_forward", dispatch)
    monkeypatch.setattr(RemoteExperienceMaker, "_flatten_results", flatten)
    monkeypatch.setattr(RemoteExperienceMaker, "make_experience", make_experience)
    maker = _maker(OwnRoutingExperienceMaker)
    samples = [SimpleNamespace(sequences=i, info={}) for i in range(3)]
    assert maker.make_experience(samples) == [["old 0", "old 1", "old 2"], ["ref 0", "ref 1", "ref 2"]]
    assert [(group, sorted(kwargs)) for group, kwargs in calls] == [("actor", ["record_routing", "sequences"]),
                                                                   ("ref", ["sequences"])]
    assert calls[0][1]["record_routing"] == [True] * 3
    assert [s.info[ROUTED_EXPERTS][0].item() for s in samples] == [0, 1, 2]
    assert maker._recording is None and maker._samples_in_flight is None
    calls.clear()
    assert maker._dispatch_forward("actor", None, sequences=[0]) == [["actor 0"]]  # outside make_experience: upstream's
    assert sorted(calls[0][1]) == ["sequences"]
