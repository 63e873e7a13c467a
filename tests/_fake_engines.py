"""Engines and a trainer that score by policy version: the fake cluster the controller tests drive.

Both sides give a token the log-prob `logprob(version, position)`, so equal weights score equally and every
step moves both by a known amount. The engine follows vLLM's sleep rules (vllm/v1/executor/abstract.py and
upstream's `RolloutRayActor`), which upstream's rollout and weight-sync code rely on. Every `.remote` runs at
once: tests replace `ray.get` with the identity.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

PROMPT = [5, 6, 7, 8]
ALL_TAGS = ("weights", "kv_cache")


def logprob(version: int, position: int) -> float:
    """Both sides' log-prob of a token at `position` for weights of `version`: equal for equal weights."""
    return -0.5 - 0.7 * version - 0.01 * position


def probe_tokenizer(text, add_special_tokens=False):
    """The sync checker's tokenizer call: every probe text is PROMPT."""
    return {"input_ids": PROMPT}


class Remote:
    """A Ray actor method whose `.remote(...)` runs the call at once."""

    def __init__(self, fn):
        self.remote = fn


class SleepyEngine:
    """An engine actor under vLLM's sleep rules, which upstream's flow relies on.

    Executor (vllm/v1/executor/abstract.py): `sleep` while the weights sleep does nothing; `wake_up(tags)` does
    nothing when nothing sleeps or when a tag is already awake, else wakes the tags (all without tags). Level 1
    keeps the weights. Upstream's actor wakes its tags one by one (`wake_up(tags=None)` = weights, then KV cache).
    Sleeping while only the KV cache sleeps is never done by upstream; here it fails. An engine that never sleeps
    is a plain awake engine.
    """

    def __init__(self, loses_syncs: bool = False):
        self.sleeping: set[str] = set()
        self.version = 0
        self.loses_syncs = loses_syncs
        self.generations = 0
        self.weight_offloads = 0  # the costly part of a wake/sleep cycle: weights to host memory (and back later)
        self.sleep, self.wake_up = Remote(self._sleep), Remote(self._wake_up)
        self.generate, self.update_weight = Remote(self._generate), Remote(self._update_weight)

    def _sleep(self, level: int = 1):
        if "weights" in self.sleeping:
            return
        assert not self.sleeping, "sleep with the KV cache already released"
        self.sleeping = set(ALL_TAGS)
        self.weight_offloads += 1

    def _executor_wake_up(self, tags):
        if not self.sleeping or any(tag not in self.sleeping for tag in tags):
            return
        self.sleeping -= set(tags)

    def _wake_up(self, tags=None):
        for tag in tags or ALL_TAGS:
            self._executor_wake_up([tag])

    def _update_weight(self, version: int):
        assert "weights" not in self.sleeping, "weights sent to sleeping weights"
        if not self.loses_syncs:
            self.version = version

    def _generate(self, prompt_ids, params):
        assert not self.sleeping, f"generate while {sorted(self.sleeping)} sleep"
        self.generations += 1
        n = len(prompt_ids)
        new = list(range(1, params.max_tokens + 1))
        lp = lambda pos: SimpleNamespace(logprob=logprob(self.version, pos))  # noqa: E731
        prompt_lps = [None] + [{tok: lp(i)} for i, tok in enumerate(prompt_ids) if i > 0]
        completion = SimpleNamespace(token_ids=new, logprobs=[{tok: lp(n + i)} for i, tok in enumerate(new)])
        return SimpleNamespace(prompt_token_ids=list(prompt_ids), prompt_logprobs=prompt_lps, outputs=[completion])


class FakeActorGroup:
    """The trainer: scores like the engines at its own version; its `broadcast_to_vllm` sends that version."""

    def __init__(self, engines):
        self.engines = engines
        self.version = 0

    def async_run_method(self, method_name, **kwargs):
        if method_name == "forward":
            n = kwargs["action_mask"].shape[1]
            return [torch.tensor([[logprob(self.version, pos) for pos in range(1, n + 1)]])]
        assert method_name == "broadcast_to_vllm"
        for engine in self.engines:
            engine.update_weight.remote(self.version)
        return []
