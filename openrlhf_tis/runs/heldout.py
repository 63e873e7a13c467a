"""The held-out score of the policy a user keeps: `<run_dir>/heldout_kept.json`, read back.

The training run scores the held-out questions with the trainer's own weights in the trainer's dtype before
the first step and after the last (what a user deploys), beside the rollout engine's score in metrics.jsonl
(`eval_start/*`, `eval/*`: the possibly quantized rollout policy). Schema 1:

    {"schema": 1, "policy": "trainer weights", "dtype": "fp32", "n_samples": 4, "seed": S,
     "before": {"model": PATH, "pass1": X, "passk": Y, "per_question": [mean reward per question, file order]},
     "after": {... the same ...}}

A run without the file (older runs, or a run that stopped before scoring) is not an error: readers fall
back to the engine's score and say so. A damaged file is warned about by name and treated as absent.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from openrlhf_tis.runs.layout import RunStoreWarning

KEPT_FILE = "heldout_kept.json"
KEPT_SCHEMA = 1


@dataclass(frozen=True)
class KeptScore:
    """One scoring of the kept policy: pass@1 and, when written, the mean reward of each question (file order)."""

    pass1: float
    passk: float | None
    per_question: np.ndarray | None


@dataclass(frozen=True)
class KeptHeldOut:
    dtype: str
    n_samples: int
    seed: int | None
    before: KeptScore
    after: KeptScore


def _number(value: object, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{where} must be a finite number, got {value!r}")
    return float(value)


def _score(part: object, where: str) -> KeptScore:
    if not isinstance(part, dict):
        raise ValueError(f"{where} must be an object")
    questions = part.get("per_question")
    if questions is not None:
        if not isinstance(questions, list) or not questions:
            raise ValueError(f"{where}.per_question must be a non-empty list")
        questions = np.array([_number(v, f"{where}.per_question") for v in questions], dtype=np.float64)
    passk = part.get("passk")
    return KeptScore(_number(part.get("pass1"), f"{where}.pass1"),
                     None if passk is None else _number(passk, f"{where}.passk"), questions)


def read_kept_heldout(run_dir: str | os.PathLike) -> KeptHeldOut | None:
    """The run's kept-policy held-out scores, or None when the file is absent or unreadable (warned)."""
    path = Path(run_dir) / KEPT_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        if data.get("schema") != KEPT_SCHEMA:
            raise ValueError(f"schema must be {KEPT_SCHEMA}, got {data.get('schema')!r}")
        before, after = _score(data.get("before"), "before"), _score(data.get("after"), "after")
        if (before.per_question is None) != (after.per_question is None) or (
                before.per_question is not None and len(before.per_question) != len(after.per_question)):
            raise ValueError("before.per_question and after.per_question must both be given, of one length")
        seed = data.get("seed")
        return KeptHeldOut(str(data.get("dtype", "?")), int(data.get("n_samples", 1)),
                           seed if isinstance(seed, int) and not isinstance(seed, bool) else None, before, after)
    except (OSError, ValueError, TypeError) as err:
        warnings.warn(f"{path}: unreadable kept-policy held-out scores, ignored ({err})", RunStoreWarning, stacklevel=2)
        return None
