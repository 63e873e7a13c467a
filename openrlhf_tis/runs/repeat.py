"""Where two runs of one cell part ways: the first step, and the metrics, at which their metrics.jsonl differ.

A run repeats under its seed on one machine (rollout/sampling_seeds.py); this is how that is checked, and how a user
who cannot reproduce a run finds the step and the component (sampling, the loss, the weights) that diverged first.
Timings are left out: they are the machine's, not the run's.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from openrlhf_tis.runs.store import WALL_TIME_KEY

TIMING = re.compile(r"(^|/)(timing|time)(/|_|$)|_s$|/seconds$|_seconds$|_time$|throughput|per_s(ec)?$")
"""Keys that measure the machine, not the run: wall time, seconds, throughput (upstream's and the fork's)."""


def is_timing(key: str) -> bool:
    return key == WALL_TIME_KEY or bool(TIMING.search(key))


@dataclass(frozen=True)
class Divergence:
    """The first step whose metrics differ beyond `rtol`, and those metrics with both values (None: none differ)."""

    step: int | None
    metrics: dict[str, tuple[object, object]]
    steps_compared: int


def _differs(a: object, b: object, rtol: float) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        if math.isnan(a) and math.isnan(b):
            return False
        return not math.isclose(a, b, rel_tol=rtol, abs_tol=0.0)
    return a != b


def first_divergence(a: Sequence[dict], b: Sequence[dict], rtol: float = 0.0) -> Divergence:
    """Compare two runs' metrics lines step by step (timings left out); `rtol` 0 asks for equality."""
    for line_a, line_b in zip(a, b, strict=False):
        keys = (set(line_a) | set(line_b)) - {k for k in set(line_a) | set(line_b) if is_timing(k)}
        differ = {k: (line_a.get(k), line_b.get(k)) for k in sorted(keys)
                  if _differs(line_a.get(k), line_b.get(k), rtol)}
        if differ:
            return Divergence(int(line_a.get("step", -1)), differ, min(len(a), len(b)))
    return Divergence(None, {}, min(len(a), len(b)))
