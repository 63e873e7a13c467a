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

from openrlhf_tis.metric_names import (
    ABS_DP_MAX,
    ENTROPY_KEYS,
    EVAL_PREFIX,
    K3_KL,
    MASKED_FRAC,
    MISMATCH_KEYS,
    REWARD_KEYS,
    STEP_SECONDS,
    TRUNCATED_FRAC,
)
from openrlhf_tis.rollout.precision import PRECISION_FLAG, WEIGHT_BITS_FLAG, dest, rollout_option
from openrlhf_tis.runs.config import LEGACY_CORRECTION_KEY, SPEC_KEY, read_run_config
from openrlhf_tis.runs.layout import is_run_dir, readable_dir_name
from openrlhf_tis.runs.reader import find_runs, load_metrics
from openrlhf_tis.runs.summary import pick_key
from openrlhf_tis.viz.curves import SEED_IN_NAME, held_out

# Paths that differ between any two runs without making them different experiments.
# Paths, and upstream's default run name (the start time, ppo_%m%dT%H:%M): they differ between seeds of one setting.
_INCIDENTAL = ("logger.run_dir", "ckpt.path", "ckpt.output_dir", "data.prompt_dataset", "actor.model_name_or_path",
               "logger.wandb.run_name")
SEED_FLAGS = ("train.seed", "seed")  # runs that differ only here are seeds of one setting
# config.json's keys for where a run computed (viz sits below cli, so these are spelled here): the device flag
# (--cluster.device; the decision recorded by the run spec since), and the machine, recorded before the run spec
DEVICE_KEY, LEGACY_RESOURCES_KEY = "cluster.device", "cluster.resources"


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


def as_experiment(config: Mapping[str, Any]) -> dict[str, Any]:
    """A run's recorded config as the experiment it ran, so runs recorded before and after the run spec (cli/resolve.py)
    that ran the same experiment read the same: `cluster.device` is the device the run decided (the spec's since
    then; before, the flag's value itself), and what restates other keys or describes the machine is left out (the
    run spec's record, `fork.spec.*`, and before it the resolved correction, follow from the flags and the device;
    `cluster.resources` is the machine)."""
    kept = {k: v for k, v in config.items()
            if not k.startswith(SPEC_KEY + ".") and k not in (LEGACY_CORRECTION_KEY, LEGACY_RESOURCES_KEY)}
    decided = config.get(f"{SPEC_KEY}.cluster.device", config.get(DEVICE_KEY))
    return kept if decided is None else {**kept, DEVICE_KEY: decided}


def config_diff(paths: Sequence[Path], labels: Sequence[str] | None = None,
                ignore: Iterable[str] = _INCIDENTAL) -> pd.DataFrame:
    """Flags whose resolved values differ between runs (each read `as_experiment`): one row per flag, one column per
    run."""
    labels = list(labels) if labels is not None else run_labels(paths)
    configs = [as_experiment((read_run_config(p) or {}).get("config", {})) for p in paths]
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
    keys = sorted(k for k in frame.columns if k.startswith(EVAL_PREFIX) and not k.endswith("seconds"))
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
            "abs_dp_max": _column(frame, ABS_DP_MAX, "max"),
            "masked_frac_mean": _column(frame, MASKED_FRAC, "mean"),
            "truncated_frac_mean": _column(frame, TRUNCATED_FRAC, "mean"),
            "entropy_last": _tail_mean(frame, pick_key(frame, ENTROPY_KEYS)),
            "step_seconds": _column(frame, STEP_SECONDS, "mean"),
        })
    return pd.DataFrame(rows).set_index("run") if rows else pd.DataFrame()


def load_runs(paths: Sequence[Path]) -> dict[str, pd.DataFrame]:
    """Each run's metrics by its short label (see run_labels)."""
    return {label: load_metrics(p) for label, p in zip(run_labels(paths), paths, strict=True)}


def _seed_of(config: Mapping[str, Any], label: str) -> int | None:
    for flag in SEED_FLAGS:
        if isinstance(config.get(flag), int):
            return int(config[flag])
    match = SEED_IN_NAME.search(label)
    return int(match.group(0).rpartition("=")[2]) if match else None


def dose_of(config: Mapping[str, Any]) -> str:
    """The rollout precision as a dose level (study/dose_response.py's names): `none` when the engine computes in the
    trainer's dtype, `int8` for the weight grid the CPU computes exactly (`auto`: 8 bits, 7 without VNNI),
    `w<N>a8` for an explicit grid, else the precision itself; `+q<N>` for async training with a queue of N, `+s<K>`
    for weights synced after every K-th step only (stale rollouts add to the mismatch: the staleness axis); `?` for
    a run without a config."""
    if dest(PRECISION_FLAG) not in config:
        return "?"
    precision, bits = rollout_option(config, PRECISION_FLAG), str(rollout_option(config, WEIGHT_BITS_FLAG))
    dose = "none" if precision == config.get("ds.param_dtype", "bf16") else \
        f"w{bits}a8" if precision == "int8" and bits != "auto" else str(precision)
    every = int(config.get("vllm.sync_every") or 1)
    return dose + (f"+q{config.get('train.async_queue_size')}" if config.get("train.async_enable") else "") + \
        (f"+s{every}" if every > 1 else "")


def _flags_name(diff: pd.DataFrame, label: str) -> str:
    return ",".join(f"{flag.rpartition('.')[2]}={diff.loc[flag, label]}" for flag in diff.index) or label


def run_facts(paths: Sequence[Path], labels: Sequence[str] | None = None,
              metrics: Mapping[str, pd.DataFrame] | None = None) -> pd.DataFrame:
    """One row per run (index: its label): the setting it belongs to, its seed, dose level, correction preset and
    mean k3 KL over its steps. Runs whose resolved configurations differ only by seed (and incidental paths)
    share a setting, named `dose / correction` where those two tell the settings apart (a study), else by the run
    label less its `seed=N` (a sweep's cells), else by the flags that set it apart from the other settings.
    `metrics` (by label) saves reading metrics.jsonl again."""
    labels = list(labels) if labels is not None else run_labels(paths)
    configs = [(read_run_config(p) or {}).get("config", {}) for p in paths]
    diff = config_diff(paths, labels).drop(index=list(SEED_FLAGS), errors="ignore")
    stripped = [SEED_IN_NAME.sub("", label).strip("_,/ ") or label for label in labels]
    keys = [_comparable({flag: diff.loc[flag, label] for flag in diff.index}) + "|" + ("" if config else name)
            for label, config, name in zip(labels, configs, stripped, strict=True)]
    members: dict[str, set[str]] = {}
    for key, name in zip(keys, stripped, strict=True):
        members.setdefault(key, set()).add(name)
    doses = [dose_of(config) for config in configs]
    corrections = [config.get("algo.correction.preset", "?") for config in configs]
    names = {key: f"{dose} / {correction}" for key, dose, correction in zip(keys, doses, corrections, strict=True)}
    if "?" in doses + corrections or len(set(names.values())) < len(names):  # not a dose x correction grid
        names = {key: next(iter(found)) for key, found in members.items() if len(found) == 1}
    if len(names) < len(members) or len(set(names.values())) < len(names):
        names = {key: _flags_name(diff, label) for key, label in zip(keys, labels, strict=True)}
    rows = []
    for path, label, config, key, dose, correction in zip(paths, labels, configs, keys, doses, corrections,
                                                          strict=True):
        frame = metrics[label] if metrics is not None else load_metrics(path)
        rows.append({"run": label, "setting": names[key], "seed": _seed_of(config, label), "dose": dose,
                     "correction": correction, "k3_mean": _column(frame, K3_KL, "mean"), "path": path})
    return pd.DataFrame(rows).set_index("run")


def setting_diff(paths: Sequence[Path], facts: pd.DataFrame) -> pd.DataFrame:
    """The flags that differ between settings: one column per setting (seed flags left out; a flag that differs
    between seeds of one setting, which should not happen, shows each value once, joined by ' / ')."""
    diff = config_diff(paths, list(facts.index)).drop(index=list(SEED_FLAGS), errors="ignore")
    columns = {setting: [" / ".join(dict.fromkeys(str(v) for v in diff.loc[flag, list(group.index)]))
                         for flag in diff.index] for setting, group in facts.groupby("setting", sort=False)}
    return pd.DataFrame(columns, index=diff.index)
