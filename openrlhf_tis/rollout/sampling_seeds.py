"""Seeded rollout requests and their canonical order: what makes a run repeat under its seed.

Two runs of one cell on one machine used to differ from their first step (docs/study.md, "Runs that repeat"):
- **Sampling.** Upstream sends every request with an unseeded `SamplingParams`, so each draw comes from the
  engine's one random stream, in whatever order the engine's continuous batching happens to serve the requests
  that step; vLLM itself warns that random sampling without an explicit seed is not batch invariant. Here each
  sample gets its own seed, a hash of (the engine's seed, the policy version it samples with, the prompt and label,
  how many times that prompt was asked of this engine at this version before, the sample's index), so a sample's
  draws depend on nothing another request does, not even on whether other requests (an evaluation) were made.
- **Order.** Upstream's samples generator collects prompts' samples in the order their requests *finish*
  (`ray.wait`), which is timing; that order is the order of the replay buffer and so of the micro-batches and the
  shuffle. The engine stamps each sample with its request's key, and the controller puts the step's samples back
  in the order the requests were made (trainer/step_part.py RolloutOrderPart), prompt groups kept whole.

On CPU the engines also run without chunked prefill (rollout/engine_actor.py): vLLM rewinds a seeded request's
generator when a prompt is split across steps, which a CPU generator cannot do ("CPU Generator does not use offset").
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

REQUEST_INDEX = "rollout_request"  # per-sample info key: the request's index on its engine, in the order made
ENGINE_SEED = "rollout_engine"  # ... and its engine's seed (unique per engine: upstream gives engine i seed + i)


def prompt_key(prompt: str, label: object) -> int:
    """A prompt and its label as one 64-bit number (sha256): the content a sample's seed is keyed by."""
    return int.from_bytes(hashlib.sha256(repr((prompt, label)).encode()).digest()[:8], "little")


def sample_seeds(engine_seed: int, policy_version: int, prompt: int, occurrence: int, n: int) -> list[int]:
    """A seed for each of a request's `n` samples, independent streams for every distinct input (numpy's
    SeedSequence hashes the entropy tuple). `prompt` is prompt_key's; `occurrence` counts the earlier requests of
    that prompt at that policy version on this engine (a prompt asked twice in a step draws twice)."""
    entropy = [int(engine_seed) & 0xFFFFFFFF, int(policy_version), int(prompt), int(occurrence)]
    state = np.random.SeedSequence(entropy).generate_state(max(n, 1), dtype=np.uint32)
    return [int(s) >> 1 for s in state[:n]]  # 31 bits: a valid seed for torch.Generator and vLLM alike


def _info_int(sample, key: str) -> int | None:
    value = sample.info.get(key) if getattr(sample, "info", None) else None
    if value is None:
        return None
    return int(value.reshape(-1)[0].item()) if hasattr(value, "reshape") else int(value)


def request_order(samples: Sequence) -> list[int]:
    """The positions of `samples` sorted by (request index, engine seed): the order the requests were made, engines
    interleaved. Stable, so a request's samples keep their order and stay together; unstamped samples keep their
    place at the end."""
    def key(position: int) -> tuple:
        sample = samples[position]
        index, engine = _info_int(sample, REQUEST_INDEX), _info_int(sample, ENGINE_SEED)
        return (1, 0, 0) if index is None else (0, index, engine or 0)

    return sorted(range(len(samples)), key=key)


def in_request_order(samples: list) -> list:
    """`samples` in the order their requests were made, with the stamps removed (the actor logs every info key)."""
    ordered = [samples[i] for i in request_order(samples)]
    for sample in ordered:
        if getattr(sample, "info", None):
            sample.info.pop(REQUEST_INDEX, None)
            sample.info.pop(ENGINE_SEED, None)
    return ordered
