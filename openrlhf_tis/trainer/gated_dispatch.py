"""The controller's end of the batch gate (rollout/batch_gate.py): each dispatch of prompts, gated and sealed.

Upstream's `SamplesGenerator._dispatch_prompts_to_vllm` picks an engine for each prompt and sends it one
`generate_responses` call. Here the engines it sees are stand-ins that add the dispatch's id to every such call and
count them; once upstream's dispatch returns, each engine that got calls is told how many (`seal_dispatch`), so it can
admit the whole dispatch at once, in a fixed order. Which engine a prompt goes to stays upstream's choice.
"""

from __future__ import annotations

import uuid

import ray

from openrlhf_tis.rollout.batch_gate import GATE_KWARG


class _CountedMethod:
    def __init__(self, method, dispatch: str, counts: list[int], index: int) -> None:
        self._method, self._dispatch, self._counts, self._index = method, dispatch, counts, index

    def remote(self, *args, **kwargs):
        ref = self._method.remote(*args, **{**kwargs, GATE_KWARG: self._dispatch})
        self._counts[self._index] += 1
        return ref


class _GatedEngine:
    """An engine's actor handle whose `generate_responses` calls belong to one dispatch; the rest passes through."""

    def __init__(self, engine, dispatch: str, counts: list[int], index: int) -> None:
        self._engine = engine
        self.generate_responses = _CountedMethod(engine.generate_responses, dispatch, counts, index)

    def __getattr__(self, name: str):
        return getattr(self._engine, name)


class GatedDispatch:
    """A `SamplesGenerator` mixin: every dispatch of prompts to the engines is admitted by each engine as one batch."""

    def _dispatch_prompts_to_vllm(self, prompts, labels, *, images=None, **generate_kwargs):
        engines = self.vllm_engines
        dispatch = uuid.uuid4().hex
        counts = [0] * len(engines)
        self.vllm_engines = [_GatedEngine(engine, dispatch, counts, i) for i, engine in enumerate(engines)]
        try:
            return super()._dispatch_prompts_to_vllm(prompts, labels, images=images, **generate_kwargs)
        finally:
            self.vllm_engines = engines  # and the calls sent are sealed even if the dispatch failed part-way
            ray.get([engine.seal_dispatch.remote(dispatch, n) for engine, n in zip(engines, counts, strict=True) if n])
