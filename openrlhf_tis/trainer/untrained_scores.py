"""The untrained policy's in-run held-out scores, computed once and shared by every run that would compute the same.

Why: a fresh run scores the untrained policy through its rollout engine before step 1 (StartEvalPart, `eval_start/*`),
≈ 25 s of a study cell, and every cell of one seed, base model, task and engine computes the same numbers: runs repeat
bit for bit under their seed (rollout/sampling_seeds.py), and nothing a study varies between those cells (learning
rate, correction, sync cadence, steps) acts before that evaluation. `--eval.untrained_cache DIR` keeps the scores in
DIR/untrained-<key>.json (written atomically) and a later run with the same key writes them on its first metrics
line instead of evaluating; `eval_start/seconds` is then what the lookup took.

The key (`untrained_key`) is a hash of everything the evaluation depends on, built by exclusion so that a forgotten
input costs a miss, never a wrong reuse: the run's whole resolved configuration but the keys `UNTRAINED_IGNORED` names
(outputs, and what only acts once training starts), every path in it replaced by its content (a file's sha256, a
folder's files'), the code revision, the package versions and the CPU's kernel capability, the extensions that pick
other kernels within it (AMX, AVX-512 BF16, VNNI) and the thread count (cpu_features.machine).

One more condition, checked at run time (`may_reuse`): no held-out question may also be a training prompt. An engine
seeds a sample by the prompt's occurrence at the policy version (rollout/sampling_seeds.py), so a held-out question
asked at version 0 would shift step 1's seeds for the same training prompt; where the sets share one, the run
evaluates (and its samples stay those of a run without the cache).
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from openrlhf_tis.cpu_features import machine
from openrlhf_tis.runs.config import RESUME_IGNORED, SPEC_KEY, git_revision, package_versions, resolve_config
from openrlhf_tis.runs.layout import atomic_write

FLAG = "--eval.untrained_cache"
SCHEMA = 1
UNTRAINED_IGNORED: tuple[str, ...] = (
    *RESUME_IGNORED,
    "eval.untrained_cache",
    "eval.steps",  # when later evaluations come
    "data.prompt_dataset",  # the training prompts: a file of each cell's own (may_reuse checks they are not held out)
    "train.num_episodes", "train.max_epochs",
    # the optimizer, the loss and the estimator act from step 1's update on
    "actor.adam.*", "actor.muon.*", "actor.optim", "actor.lr_*", "actor.min_lr_ratio", "actor.max_norm",
    "actor.eps_clip*", "actor.dual_clip", "actor.entropy_coef", "actor.aux_loss_coef", "actor.loss_agg_mode",
    "actor.policy_loss_type", "algo.*", f"{SPEC_KEY}.correction.*",
    # the sync cadence acts from the first sync, after step 1
    "vllm.sync_every", f"{SPEC_KEY}.sync.*",
)


def _digest(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _content(value: Any) -> Any:
    """A path's content in place of its name (a file: its sha256; a folder: each file's relative name and sha256);
    any other value as it is."""
    if not isinstance(value, str) or not value or "\n" in value:
        return value
    path = Path(value).expanduser()
    if path.is_file():
        return {"file": _digest(path)}
    if path.is_dir():
        return {"folder": sorted((str(f.relative_to(path)), _digest(f)) for f in path.rglob("*") if f.is_file())}
    return value


def untrained_key(config: Any, revision: Mapping[str, Any] | None = None, versions: Mapping[str, str] | None = None,
                  host: Mapping[str, Any] | None = None) -> str:
    """The cache key of a run's untrained held-out scores. `config`: its flags (argparse Namespace or dotted dict);
    `revision`, `versions`, `host`: the code's git revision, package versions and machine (this process's when
    None)."""
    flat = {k: _content(v) for k, v in resolve_config(config).items()
            if not any(fnmatch.fnmatchcase(k, pattern) for pattern in UNTRAINED_IGNORED)}
    git = revision if revision is not None else git_revision()
    identity = {"config": flat, "revision": [git.get("revision"), git.get("dirty")],
                "versions": dict(versions if versions is not None else package_versions()),
                "machine": dict(host if host is not None else machine()), "schema": SCHEMA}
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=repr).encode()).hexdigest()[:24]


def cache_path(folder: str | os.PathLike, key: str) -> Path:
    return Path(folder) / f"untrained-{key}.json"


def read_scores(folder: str | os.PathLike, key: str) -> dict[str, float] | None:
    """Upstream's eval logs (`eval_*`) stored under `key`, or None (never computed, or a damaged file)."""
    try:
        record = json.loads(cache_path(folder, key).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    logs = record.get("logs") if isinstance(record, dict) and record.get("schema") == SCHEMA else None
    return logs if isinstance(logs, dict) and logs else None


def write_scores(folder: str | os.PathLike, key: str, logs: Mapping[str, float], seconds: float) -> Path:
    """Store a run's untrained eval logs under `key` (atomically: a reader sees the whole file or none)."""
    path = cache_path(folder, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"schema": SCHEMA, "key": key, "logs": dict(logs), "seconds": seconds,
              "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    atomic_write(path, json.dumps(record, indent=1).encode())
    return path


def may_reuse(held_out: Any, train: Any | None) -> bool:
    """Whether stored scores may stand in for this run's evaluation: the training prompts are known and share no
    (prompt, label) with the held-out set (see the module doc). Both: upstream's PromptDataset (`prompts`,
    `labels`); `train` None where this process does not hold the training prompts (async training)."""
    if train is None:
        return False
    pairs = [set(map(repr, zip(d.prompts, d.labels, strict=True))) for d in (held_out, train)]
    return not pairs[0] & pairs[1]


@dataclass(frozen=True)
class UntrainedCache:
    """Where a run keeps or finds its untrained scores, under which key, and whether it may read them (may_reuse)."""

    folder: Path
    key: str
    reusable: bool

    @property
    def path(self) -> Path:
        return cache_path(self.folder, self.key)

    def read(self) -> dict[str, float] | None:
        return read_scores(self.folder, self.key) if self.reusable else None

    def write(self, logs: Mapping[str, float], seconds: float) -> Path:
        return write_scores(self.folder, self.key, logs, seconds)
