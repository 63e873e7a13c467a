"""The held-out score of the kept policy: `<run_dir>/heldout_kept.json`, its arithmetic and its label.

Written by pipeline/heldout.py after a run (the format is documented there); read by the run summary,
the main job's console lines and the study. Lives in the run store's layer so every reader can use it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

SCHEMA = 1
KEPT_FILE = "heldout_kept.json"


def pass_at_k(rewards: Sequence[Sequence[float]]) -> dict[str, Any]:
    """pass1 (mean over questions of the mean reward), passk (mean over questions of the best of the k
    samples, upstream's `pass{k}`) and each question's mean reward, for k samples per question."""
    if not rewards or any(len(r) != len(rewards[0]) or not r for r in rewards):
        raise ValueError("every question needs the same, non-zero number of samples")
    per_question = [sum(r) / len(r) for r in rewards]
    return {"pass1": sum(per_question) / len(per_question), "passk": sum(max(r) for r in rewards) / len(rewards),
            "k": len(rewards[0]), "per_question": per_question}


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
    if data.get("schema") != SCHEMA:
        raise ValueError(f"{path}: schema {data.get('schema')!r}, this version reads schema {SCHEMA}")
    return data
