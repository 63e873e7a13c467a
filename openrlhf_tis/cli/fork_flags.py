"""Flags the fork adds to upstream's train_ppo_ray, in upstream's dotted style.

Each is declared once (openrlhf_tis/flags.py): a flag the run holds as given is a field of a run-spec plan
(run_spec/plans.py `spec_flags`); the others are the `Flag`s below, read before the spec exists or decided first. The
correction's flags are generated from CorrectionConfig's fields (`add_correction_arguments`)."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any

from openrlhf_tis.cli.cluster_device import DEVICE_FLAG, DEVICES
from openrlhf_tis.cli.stall import DEFAULT_STALL_TIMEOUT_S, check_stall_timeout
from openrlhf_tis.cli.stall import FLAG as STALL_FLAG
from openrlhf_tis.correction.config import FLAG_PREFIX
from openrlhf_tis.flags import Flag
from openrlhf_tis.run_spec import WEIGHT_GRID, spec_flags
from openrlhf_tis.trainer.untrained_scores import FLAG as UNTRAINED_CACHE_FLAG
from openrlhf_tis.upstream_guards import PatchTargetMissingError, require_version


def allow_fp32_training(parser: argparse.ArgumentParser) -> None:
    """Add fp32 to upstream's `--ds.param_dtype` choices (bf16, fp16): CPUs without native bf16 emulate it,
    and a bf16 backward there is 5-25x slower than fp32 (patches/fp32_training.py). Idempotent; an upstream parser
    without that flag or its choices is refused, naming this file (patches/README.md)."""
    where = "openrlhf_tis/cli/fork_flags.py"
    require_version("openrlhf", "==0.11.2", patch=where)
    action = next((a for a in parser._actions if a.dest == "ds.param_dtype"), None)
    if action is None or not action.choices:
        raise PatchTargetMissingError(f"patch {where!r}: openrlhf.cli.train_ppo_ray no longer has --ds.param_dtype "
                                      "with choices; review the patch")
    if "fp32" in action.choices:
        return
    action.choices = [*action.choices, "fp32"]
    action.help = f"{action.help} (the fork adds fp32: on CPUs without native bf16 it trains several times faster)"


FORK_FLAGS: tuple[Flag, ...] = (
    Flag(DEVICE_FLAG, default="auto", choices=tuple(DEVICES), help=(
        "What the run computes on, decided by its cluster, never by the driver: auto reads the Ray cluster "
        "RAY_ADDRESS names (any GPU there: cuda), else this machine's CUDA devices. cpu or cuda must agree with the "
        "cluster (cpu on a cluster declaring logical GPU slots for CPU processes is fine). On cpu, upstream's GPU "
        "defaults are replaced and GPU-only flags refused; on cuda, CPU-only choices are refused.")),
    *spec_flags().values(),
    Flag("--logger.run_dir", help="Run directory of the run store (metrics.jsonl, ...). Default: "
         "./runs/<UTC timestamp>."),
    Flag("--logger.run_dir_override", switch=True, help=(
        "Continue in a run directory whose stored configuration differs (the change is recorded in config.json).")),
    Flag("--logger.run_dir_overwrite", switch=True, help=(
        "Start over in a run directory that already holds steps: its metrics, token dumps and config are "
        "erased first. Without it such a directory is refused unless --ckpt.load_enable resumes it.")),
    Flag(STALL_FLAG, type=float, default=DEFAULT_STALL_TIMEOUT_S, check=check_stall_timeout, help=(
        "Stop the run, naming the stage (generate samples, make experience, train, sync weights, evaluate, save or "
        "load checkpoint) and the Ray actors it waited on, when the training loop makes no progress for this many "
        "seconds: an actor that hangs without dying (SIGSTOP, a deadlock). Progress is a change of stage or, while "
        "generating or evaluating, a finished response; start-up is not bounded. Exit code 4. 0 disables.")),
    WEIGHT_GRID,
    Flag(UNTRAINED_CACHE_FLAG, help=(
        "A folder where the untrained policy's held-out scores (eval_start/*, scored before step 1) are kept and "
        "shared: a run whose key (everything the scores depend on: model and data files' content, engine and "
        "sampling flags, seed, code revision, packages, CPU) finds them there writes them instead of evaluating, "
        "unless a held-out question is also a training prompt (openrlhf_tis.trainer.untrained_scores). A sweep "
        "sets it to OUT/untrained for its cells. Default: every run evaluates.")),
)


FLAGS: dict[str, Flag] = {flag.name: flag for flag in FORK_FLAGS}


def add_fork_arguments(parser: argparse.ArgumentParser) -> None:
    """Every flag the fork adds: fp32 training, the flags of FORK_FLAGS, the correction's generated flags."""
    allow_fp32_training(parser)
    for flag in FORK_FLAGS:
        flag.add_to(parser)
    add_correction_arguments(parser)


def add_correction_arguments(parser: argparse.ArgumentParser) -> None:
    """`--algo.correction.*`: the rollout correction (openrlhf_tis.correction, docs/correction.md).

    `preset`, then one flag per CorrectionConfig field, generated from the field: its annotation gives the
    type (bool: a switch; the rejection tuple: one or more STAT:AGG:... strings), its metadata the choices
    and the help. Every flag defaults to None, meaning "as the preset says"; cli/resolve.py
    `resolve_correction` resolves preset + overrides (or upstream's --algo.advantage.is_correction_* flags)
    into the run spec's CorrectionConfig.
    """
    from openrlhf_tis.correction.config import PRESETS, CorrectionConfig

    parser.add_argument(
        FLAG_PREFIX + "preset", type=str, default=None, choices=sorted(PRESETS),
        help="Named correction recipe (docs/correction.md); other --algo.correction.* flags override its fields. "
        "Default: upstream's --algo.advantage.is_correction_* mapping, else 'off' (metrics only).")
    for f in dataclasses.fields(CorrectionConfig):
        parser.add_argument(FLAG_PREFIX + f.name, default=None, help=f.metadata["help"], **_flag_kind(f))


def _flag_kind(f: dataclasses.Field) -> dict:
    """argparse arguments for a CorrectionConfig field, from its resolved type (`typing.get_type_hints`, never the
    annotation's text): bool a switch, a tuple one or more strings, int or float (optional or not) a number, str one
    of its declared choices."""
    from openrlhf_tis.correction.config import CorrectionConfig

    kind = typing.get_type_hints(CorrectionConfig)[f.name]
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    base = args[0] if typing.get_origin(kind) in (types.UnionType, typing.Union) and len(args) == 1 else kind
    if base is bool:
        return {"action": "store_true"}
    if typing.get_origin(base) is tuple:
        return {"type": str, "nargs": "+"}
    if base in (int, float):
        return {"type": base}
    if base is str:
        return {"type": str, "choices": f.metadata["choices"]}
    raise TypeError(f"CorrectionConfig.{f.name}: no command-line flag for a field of type {kind}")


def correction_option_problem(name: str, value: Any) -> str | None:
    """Why `value` cannot be `--algo.correction.<name>` (a notebook's correction_options entry), in the CLI's terms;
    None when it can. Judged by the same declaration the flag is generated from (`_flag_kind`)."""
    from openrlhf_tis.correction.config import CorrectionConfig

    fields = {f.name: f for f in dataclasses.fields(CorrectionConfig)}
    if name not in fields:
        return f"{name!r} is not a CorrectionConfig field; known: {', '.join(fields)}"
    kind, flag = _flag_kind(fields[name]), FLAG_PREFIX + name
    if kind.get("action") == "store_true":
        return None if isinstance(value, bool) else f"{flag} is a switch: give True or False, got {value!r}"
    if kind.get("nargs") == "+":
        ok = isinstance(value, (list, tuple)) and value and all(isinstance(v, str) for v in value)
        return None if ok else f"{flag} takes one or more strings (a list), got {value!r}"
    number = kind["type"] in (int, float) and not isinstance(value, bool)
    if number and (isinstance(value, kind["type"]) or kind["type"] is float and isinstance(value, int)):
        return None
    if kind["type"] is str and isinstance(value, str):
        choices = kind["choices"]
        return None if choices is None or value in choices else \
            f"{flag}: invalid choice: {value!r} (choose from {', '.join(map(repr, choices))})"
    return f"{flag} takes a {kind['type'].__name__}, got {value!r}"
