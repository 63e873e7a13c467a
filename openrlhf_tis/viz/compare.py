"""Several runs side by side: which runs, how their configurations differ, and one row of results each.

The configuration table shows only the flags whose values differ between the runs (a run's config.json
holds ~200 resolved flags; the handful that differ are what a reader needs to tell the curves apart).
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from openrlhf_tis.runs.config import read_run_config
from openrlhf_tis.runs.layout import is_run_dir, readable_dir_name
from openrlhf_tis.runs.reader import find_runs, load_metrics
from openrlhf_tis.runs.summary import MISMATCH_KEYS, REWARD_KEYS, pick_key
from openrlhf_tis.viz.curves import held_out

# Paths that differ between any two runs without making them different experiments.
_INCIDENTAL = ("logger.run_dir", "ckpt.path", "ckpt.output_dir", "data.prompt_dataset", "actor.model_name_or_path")


def resolve_runs(runs: str | os.PathLike | Iterable[str | os.PathLike]) -> list[Path]:
    """Run directories from paths, globs, or roots holding runs; raises naming each entry that found none."""
    entries = [runs] if isinstance(runs, (str, os.PathLike)) else list(runs)
    found: list[Path] = []
    missing = []
    for entry in entries:
        text = os.path.expanduser(os.fspath(entry))
        matches = sorted(glob.glob(text)) if glob.has_magic(text) else [text]
        dirs = [d for m in matches for d in ([Path(m)] if is_run_dir(m) else find_runs(m) if Path(m).is_dir() else [])]
        if not dirs:
            missing.append(text)
        found += [d for d in dirs if d not in found]
    if missing:
        raise FileNotFoundError(f"no run directory (config.json, metrics.jsonl or tokens/) at: {', '.join(missing)}")
    return found


def run_labels(paths: Sequence[Path]) -> list[str]:
    """Short unique names: the directory name; where those collide (sweep cells all hold `run`), the parent's
    less the sweep's hash (`correction=tis_seed=1`); parent/name as the last resort."""
    for labels in ([p.name for p in paths], [readable_dir_name(p.parent.name) for p in paths],
                   [f"{p.parent.name}/{p.name}" for p in paths]):
        if len(set(labels)) == len(labels):
            return labels
    return [str(p) for p in paths]


def _comparable(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def config_diff(paths: Sequence[Path], labels: Sequence[str] | None = None,
                ignore: Iterable[str] = _INCIDENTAL) -> pd.DataFrame:
    """Flags whose resolved values differ between runs: one row per flag, one column per run."""
    labels = list(labels) if labels is not None else run_labels(paths)
    configs = [(read_run_config(p) or {}).get("config", {}) for p in paths]
    ignore = set(ignore)
    keys = sorted({k for c in configs for k in c} - ignore)
    rows = {k: [c.get(k, "(absent)") for c in configs] for k in keys
            if len({_comparable(c.get(k, "(absent)")) for c in configs}) > 1}
    return pd.DataFrame.from_dict(rows, orient="index", columns=labels).rename_axis("flag")


def _tail_mean(frame: pd.DataFrame, key: str | None, fraction: float = 0.1) -> float:
    if key is None:
        return float("nan")
    values = pd.to_numeric(frame[key], errors="coerce").to_numpy(dtype=float)
    values = values[np.isfinite(values)]
    if not len(values):
        return float("nan")
    return float(values[-max(1, int(len(values) * fraction)):].mean())


def _column(frame: pd.DataFrame, key: str, how: str) -> float:
    if key not in frame:
        return float("nan")
    values = pd.to_numeric(frame[key], errors="coerce").to_numpy(dtype=float)
    values = values[np.isfinite(values)]
    if not len(values):
        return float("nan")
    return float(values.max() if how == "max" else values.mean())


def held_out_key(frame: pd.DataFrame) -> str | None:
    """The run's main held-out metric: the first `eval/*pass1` key, else the first `eval/` score-like key."""
    keys = sorted(k for k in frame.columns if k.startswith("eval/") and not k.endswith("seconds"))
    return next((k for k in keys if k.endswith("pass1")), keys[0] if keys else None)


def final_table(metrics: Mapping[str, pd.DataFrame]) -> pd.DataFrame:
    """One row per run: steps, reward first -> last (means of the first and last tenth), held-out score
    first (step 0 = before training, when logged) and last,
    mean k3 KL, largest |Δp|, mean masked and truncated fractions, last entropy, mean seconds per step."""
    rows = []
    for name, frame in metrics.items():
        reward_key = pick_key(frame, REWARD_KEYS)
        held = held_out_key(frame)
        held_steps, held_values = held_out(frame, held) if held else ([], [])
        first = float("nan")
        if reward_key is not None:
            values = pd.to_numeric(frame[reward_key], errors="coerce").dropna().to_numpy(dtype=float)
            first = float(values[:max(1, len(values) // 10)].mean()) if len(values) else first
        rows.append({
            "run": name,
            "steps": int(len(frame)),
            "reward_first": first,
            "reward_last": _tail_mean(frame, reward_key),
            "held_out_first": float(held_values[0]) if len(held_values) else float("nan"),
            "held_out_last": float(held_values[-1]) if len(held_values) else float("nan"),
            "held_out_first_step": int(held_steps[0]) if len(held_steps) else None,
            "k3_kl_mean": _column(frame, pick_key(frame, MISMATCH_KEYS) or "", "mean"),
            "abs_dp_max": _column(frame, "mismatch/abs_dp_max", "max"),
            "masked_frac_mean": _column(frame, "correction/masked_frac", "mean"),
            "truncated_frac_mean": _column(frame, "correction/truncated_frac", "mean"),
            "entropy_last": _tail_mean(frame, pick_key(frame, ("mismatch/entropy", "mismatch/entropy_sampled"))),
            "step_seconds": _column(frame, "timing/step_total", "mean"),
        })
    return pd.DataFrame(rows).set_index("run") if rows else pd.DataFrame()


def load_runs(paths: Sequence[Path]) -> dict[str, pd.DataFrame]:
    """Each run's metrics by its short label (see run_labels)."""
    return {label: load_metrics(p) for label, p in zip(run_labels(paths), paths, strict=True)}
