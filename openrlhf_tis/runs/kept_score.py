"""The held-out score of the policy a user keeps: `<run_dir>/heldout_kept.json`, its settings, arithmetic, writer,
labels and readers.

pipeline/kept_eval.py scores it after a run: the trainer's saved weights in the trainer's dtype (what a user
deploys) and the base model, scored on the held-out questions, beside the rollout engine's in-run score in
metrics.jsonl (`eval_start/*`, `eval/*`: the possibly quantized rollout policy). This module owns the file:
`write_kept` writes it, `read_kept` returns the raw record (the summary, the console), `read_kept_heldout` a
checked, typed one for statistics, and treats a damaged file as absent, warning by name: an older run, or one
that stopped before scoring, is not an error, and readers fall back to the engine's score and say so.

`<run_dir>/heldout_kept.json` (schema 1):
    {"schema": 1, "policy": "trainer weights", "dtype": "fp32", "n_samples": 4, "seed": 42,
     "temperature": 1.0, "max_new_tokens": 32, "eval_prompts": "...", "questions": 64,
     "before": {"model": PATH, "pass1": x, "passk": y, "k": 4, "per_question": [...], "seconds": s,
                "cached": bool},
     "after": {...same, "model": <run_dir>/model}}
`per_question` is each question's mean reward over its samples, in file order; `pass1` their mean;
`passk` the mean over questions of the best of the k = n_samples rewards (upstream's `pass{n}`).
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from openrlhf_tis.runs.layout import RunStoreWarning, atomic_write

SCHEMA = 1
KEPT_FILE = "heldout_kept.json"


@dataclass(frozen=True)
class HeldoutSettings:
    """How both models are sampled and scored: the run's own settings (pipeline/train_params.py
    `TrainParams.heldout_settings`). Every field is part of the base model's cache key (pipeline/kept_eval.py)."""

    dtype: str  # the trainer's dtype: what the saved model holds
    n_samples: int  # responses per question
    seed: int
    temperature: float
    max_new_tokens: int
    max_len: int  # prompt + response budget (--data.max_len)
    chat_template: bool = True
    input_key: str = "input"
    label_key: str = "label"


def pass_at_k(rewards: Sequence[Sequence[float]]) -> dict[str, Any]:
    """pass1 (mean over questions of the mean reward), passk (mean over questions of the best of the k
    samples, upstream's `pass{k}`) and each question's mean reward, for k samples per question."""
    if not rewards or any(len(r) != len(rewards[0]) or not r for r in rewards):
        raise ValueError("every question needs the same, non-zero number of samples")
    per_question = [sum(r) / len(r) for r in rewards]
    return {"pass1": sum(per_question) / len(per_question), "passk": sum(max(r) for r in rewards) / len(rewards),
            "k": len(rewards[0]), "per_question": per_question}


def write_kept(run_dir: str | os.PathLike, settings: HeldoutSettings, eval_prompts: Path, questions: int,
               before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Write `<run_dir>/heldout_kept.json` (atomically) from both models' scores; returns the record."""
    record = {"schema": SCHEMA, "policy": "trainer weights", "dtype": settings.dtype, "n_samples": settings.n_samples,
              "seed": settings.seed, "temperature": settings.temperature, "max_new_tokens": settings.max_new_tokens,
              "eval_prompts": str(eval_prompts), "questions": questions, "before": before, "after": after}
    atomic_write(Path(run_dir) / KEPT_FILE, json.dumps(record, indent=1).encode())
    return record


def kept_label(kept: dict[str, Any]) -> str:
    """How a report names the policy heldout_kept.json scored, e.g. 'kept policy (trainer weights, fp32)'."""
    return f"kept policy ({kept['policy']}, {kept['dtype']})"


def engine_label(precision: str) -> str:
    """How a report names the in-run held-out score, e.g. 'rollout engine (int8)'."""
    return f"rollout engine ({precision})"


def read_kept(run_dir: str | os.PathLike) -> dict[str, Any] | None:
    """A run's heldout_kept.json, or None when it has none; ValueError for another schema."""
    path = Path(run_dir) / KEPT_FILE
    if not path.is_file():
        return None
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a JSON object")
    if data.get("schema") != SCHEMA:
        raise ValueError(f"{path}: schema {data.get('schema')!r}, this version reads schema {SCHEMA}")
    return data


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
        data = read_kept(run_dir)
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
