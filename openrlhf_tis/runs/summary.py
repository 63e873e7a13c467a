"""A one-run summary: how far it got, where reward and mismatch went, how much was masked.

Metric names differ between upstream (`vllm_kl`, `is_filter_ratio`, `reward`) and the fork
(`mismatch/k3_kl`, `correction/...`), and older runs lack some: each quantity takes the first key of its
candidate list (metric_names.py) that the run has, and says which one it used.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from openrlhf_tis.metric_names import MASKED_KEYS, MISMATCH_KEYS, REWARD_KEYS
from openrlhf_tis.runs.config import PLANNED_STEPS_KEY, read_run_config
from openrlhf_tis.runs.kept_score import kept_label, read_kept
from openrlhf_tis.runs.query import mask_reason_counts, token_steps
from openrlhf_tis.runs.reader import load_metrics, run_info

_MASKED_PATTERN = re.compile(r"mask.*(frac|ratio|rate)")


def pick_key(frame: pd.DataFrame, candidates: Sequence[str], pattern: re.Pattern | None = None) -> str | None:
    """The first candidate column holding a finite value, else the first column matching `pattern`."""
    def usable(key: str) -> bool:
        return key in frame and np.isfinite(pd.to_numeric(frame[key], errors="coerce")).any()

    for key in candidates:
        if usable(key):
            return key
    if pattern is not None:
        for key in frame.columns:
            if pattern.search(key) and usable(key):
                return key
    return None


def trend(steps: np.ndarray, values: np.ndarray) -> dict[str, Any]:
    """First/last (means of the first and last tenth, so one noisy step does not decide), min, max, slope.

    `slope` is the least-squares change per step over the finite values.
    """
    finite = np.isfinite(values)
    steps, values = steps[finite].astype(float), values[finite].astype(float)
    if not len(values):
        return {"first": None, "last": None, "min": None, "max": None, "slope": None, "n": 0}
    window = max(1, len(values) // 10)
    slope = float(np.polyfit(steps, values, 1)[0]) if len(values) > 1 and np.ptp(steps) > 0 else 0.0
    return {
        "first": float(values[:window].mean()),
        "last": float(values[-window:].mean()),
        "min": float(values.min()),
        "max": float(values.max()),
        "slope": slope,
        "n": int(len(values)),
    }


def _series(frame: pd.DataFrame, key: str | None) -> dict[str, Any] | None:
    if key is None:
        return None
    values = pd.to_numeric(frame[key], errors="coerce").to_numpy(dtype=float)
    return {"key": key, **trend(frame["step"].to_numpy(), values), "values": values.tolist()}


def _planned_steps(run_dir: Path) -> int | None:
    planned = (read_run_config(run_dir) or {}).get(PLANNED_STEPS_KEY)
    return int(planned) if isinstance(planned, int) and planned > 0 else None


def summary(run_dir: str | os.PathLike) -> dict[str, Any]:
    """Steps, reward and mismatch trends, masked fraction and dump size of one run (plain dict, JSON-ready).

    `masked` comes from a masked-fraction metric when the run logs one, else from the token dumps
    (with a per-reason breakdown); `values` lists hold the whole series for sparklines. `missing_steps`
    counts the steps of 1..N without a metrics line, N being the steps the run was configured to train
    (`planned_steps`, recorded by the training CLI) or, when unknown, the last logged step. `held_out_kept`
    holds the kept policy's held-out pass1/passk before and after training (heldout_kept.json) when scored.
    """
    run_dir = Path(run_dir)
    info = run_info(run_dir)
    frame = load_metrics(run_dir)
    steps = frame["step"].to_numpy()
    planned = _planned_steps(run_dir) if info["has_config"] else None
    total = max(planned or 0, int(steps.max()) if len(steps) else 0)
    result: dict[str, Any] = {
        **info,
        "steps": int(len(frame)),
        "first_step": int(steps.min()) if len(steps) else None,
        "last_step": int(steps.max()) if len(steps) else None,
        "planned_steps": planned,
        "missing_steps": total - int(((steps >= 1) & (steps <= total)).sum()),
        "reward": _series(frame, pick_key(frame, REWARD_KEYS)),
        "mismatch": _series(frame, pick_key(frame, MISMATCH_KEYS)),
    }
    masked_key = pick_key(frame, MASKED_KEYS, _MASKED_PATTERN)
    masked: dict[str, Any] | None = None
    if masked_key is not None:
        masked = {"source": f"metrics:{masked_key}", **_series(frame, masked_key)}
    dumped = token_steps(run_dir)
    if dumped:
        counts = mask_reason_counts(run_dir)
        rows = sum(counts.values())
        by_reason = {name: n for name, n in counts.items() if name != "kept"}
        tokens = {"rows": rows, "masked_fraction": sum(by_reason.values()) / rows if rows else None,
                  "by_reason": by_reason}
        result["tokens"] = tokens
        if masked is None:
            masked = {"source": "tokens", "last": tokens["masked_fraction"], "by_reason": by_reason}
    else:
        result["tokens"] = None
    result["masked"] = masked
    result["held_out_kept"] = held_out_kept(run_dir)
    return result


def held_out_kept(run_dir: Path) -> dict[str, Any] | None:
    """The kept policy's held-out scores (heldout_kept.json), labelled; None when the run has none."""
    kept = read_kept(run_dir)
    if kept is None:
        return None
    return {"label": kept_label(kept), "n_samples": kept["n_samples"], "questions": kept["questions"],
            **{f"{stat}_{when}": kept[when][stat] for when in ("before", "after") for stat in ("pass1", "passk")}}
