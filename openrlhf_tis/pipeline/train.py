"""One training job driven from a notebook: parameters -> the training CLI in a subprocess -> live curves.

Ray and vLLM never live in the notebook's kernel: the job is `python -m openrlhf_tis.cli.train_ppo_ray`
in a child process (its whole log goes to `<run_dir>/train.log`), so a crash or a kill of the job never
takes the kernel down, and `RAY_ADDRESS`, inherited from the environment, sends the same notebook to a
cluster. Progress is read where every consumer reads it: the run store's `metrics.jsonl`. The job ends
with the kernel even when the kernel is killed rather than interrupted (cli/lifetime.py).
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TextIO

from openrlhf_tis.cli.cluster_device import ClusterResources, read_cluster
from openrlhf_tis.cli.lifetime import PARENT_ENV, stop_process_tree
from openrlhf_tis.cli.run_dir import check_fork_made, lock_owner
from openrlhf_tis.errors import UsageError
from openrlhf_tis.params import ParameterError
from openrlhf_tis.pipeline import kept_eval
from openrlhf_tis.pipeline.failure import failure
from openrlhf_tis.pipeline.train_params import TrainParams
from openrlhf_tis.runs.kept_score import KEPT_FILE
from openrlhf_tis.runs.reader import read_metrics_records

LOG_FILE = "train.log"


class TrainingFailed(RuntimeError):
    """The training process exited non-zero; the message carries the tail of its log."""


def resolve_model(model: str, cache: Path, log: TextIO) -> Path:
    """The model directory for `model`: built once under `cache` for 'tiny', the embedded one for 'default', the
    default one upcycled into a Mixtral for 'upcycled' (demo/upcycle.py; built with the default one when missing).

    A model is built in a child process writing to `log` (the run's train.log), never in the caller: saving
    one imports transformers, hence accelerate, hence DeepSpeed, whose import probes its ops by compiling test
    programs. DeepSpeed silences the compiler through sys.stderr's file descriptor, which in a notebook kernel
    is not fd 2, so `ld: cannot find -laio` / `collect2: error` would land in the report and on the console.
    """
    if model == "tiny":
        path = cache / "tiny_model"
        module = "openrlhf_tis.demo.tiny_model"
    elif model == "default":
        from openrlhf_tis.demo.default_model import default_model_dir, is_complete

        path = default_model_dir()
        if is_complete(path):
            return path
        module = "openrlhf_tis.demo.default_model"
    elif model == "upcycled":
        from openrlhf_tis.demo.upcycle import is_complete, upcycled_model_dir

        path = upcycled_model_dir()
        if is_complete(path):
            return path
        module = "openrlhf_tis.demo.upcycle"
    else:
        return Path(model).expanduser().resolve()
    if not (path / "config.json").is_file():
        log.write(f"$ building the {model} model: python -m {module} {path}\n")
        log.flush()
        done = subprocess.run([sys.executable, "-m", module, str(path)], stdin=subprocess.DEVNULL, stdout=log,
                              stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        if done.returncode != 0:
            raise TrainingFailed(failure(f"building the {model} model", done.returncode, Path(log.name)))
    return path


def resolve_prompts(prompts: str, run_dir: Path, count: int) -> Path:
    """A prompt file beside the run directory holding the `count` prompts the run trains on.

    The first `count` prompts of the given file, or `count` training questions of the demo task. The run
    is bounded by this file, not by `--data.max_samples`, because upstream clips the held-out set with that flag too.
    """
    out = run_dir.parent / f"{run_dir.name}.prompts.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    if not prompts:
        from openrlhf_tis.demo.task import write_prompts

        return write_prompts(out, count)
    with open(Path(prompts).expanduser(), encoding="utf-8") as src:
        lines = [line for line in src if line.strip()][:count]
    out.write_text("".join(line if line.endswith("\n") else line + "\n" for line in lines), encoding="utf-8")
    return out


def kept_eval_argv(params: TrainParams, model_dir: Path, run_dir: Path, device: str | None = None) -> list[str]:
    """The held-out evaluation of the kept policy and the base model (pipeline/kept_eval.py), after training;
    `device`: the run's (TrainParams.run_device)."""
    return kept_eval.command(run_dir, model_dir, params.eval_file(), params.reward_file(),
                           params.heldout_settings(device),
                           heldout_cache_dir())


def heldout_cache_dir() -> Path:
    """Where base-model held-out scores are shared by every run (and every sweep cell) that asks the same question:
    `$OPENRLHF_TIS_CACHE/heldout`, by default ~/.cache/openrlhf_tis/heldout. Safe to share: an entry is keyed by
    the model's files and mtimes, the eval and reward files and every sampling setting."""
    return Path(os.environ.get("OPENRLHF_TIS_CACHE", Path.home() / ".cache" / "openrlhf_tis")).expanduser() / "heldout"


RUN_DIR_FLAGS = {flag: "the job derives it from run_dir (set run_dir instead)"
                 for flag in ("--logger.run_dir", "--ckpt.path", "--ckpt.output_dir")}
"""Flags extra_args must not set, and why: the job reads the run's metrics, checkpoint and kept model where run_dir
puts them, so a run trained elsewhere would show no step and be recorded complete."""
_UNSET = object()


def owned_flag_given(parser: argparse.ArgumentParser, extra_args: list[str], owned: Mapping[str, str]) -> str | None:
    """The first flag of `owned` that `extra_args` sets, as the training CLI's parser reads them (abbreviations and
    `--flag=value` included); None when they set none."""
    unset = argparse.Namespace(**{flag[2:]: _UNSET for flag in owned})
    parsed, _ = parser.parse_known_args(list(extra_args), unset)
    return next((flag for flag in owned if getattr(parsed, flag[2:]) is not _UNSET), None)


def check_training_command(params: TrainParams, cluster: ClusterResources | None = None,
                           owned: Mapping[str, str] = RUN_DIR_FLAGS) -> None:
    """The training CLI's own checks of what its flags decide (cli/checks.py `check_flags`: batch sizes, async,
    rollout precision, correction, ...) on the command line that checked `params` become, before any file is
    written or process started, so a refusal costs seconds instead of a notebook's start-up. What needs the job's
    files (the model, built later for 'tiny'; the prompt file, written later) is left to the CLI itself. Raises
    ParameterError naming the flag. `cluster`: the run's (cli/cluster_device.py ClusterResources), read when None.
    `owned`: flags extra_args must not set (flag -> why), the caller's own: the job's, or a sweep's."""
    from openrlhf_tis import patches
    from openrlhf_tis.cli.train_ppo_ray import build_parser, parse_flags

    def error(message: str):
        raise ParameterError(f"training CLI flags: {message}")

    given = Path(params.model).expanduser(), Path(params.prompts), Path(params.run_dir)
    cluster = read_cluster() if cluster is None else cluster
    try:
        device = params.run_device(cluster)
        argv = params.argv(*given, device=device)[3:]
        # the run's patches (upstream's parser module cannot be imported without them on CPU), for its device
        patches.apply_platform_patches(device)
        parser = build_parser()
        parser.error = error
        parse_flags(parser, argv, cluster)
        if (flag := owned_flag_given(parser, params.extra_args, owned)) is not None:
            error(f"extra_args sets {flag}: {owned[flag]}")
    except UsageError as err:
        raise ParameterError(f"training CLI flags: {err}") from None


def run_training(
    params: TrainParams,
    on_progress: Callable[[list[dict[str, Any]]], None] | None = None,
    cache: Path | None = None,
) -> Path:
    """Run one training job for checked `params`; returns its run directory, raises TrainingFailed.

    `on_progress(records)` is called with every metrics record so far whenever new steps land (and once
    at the end), so a notebook can redraw its curves as the run goes.
    """
    run_dir = Path(params.run_dir).expanduser().resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    owner = lock_owner(run_dir)
    if owner is not None:  # checked here too, so a second start never truncates the live run's train.log
        raise TrainingFailed(f"{run_dir} is in use by another run (pid {owner}); wait for it to end, stop it, "
                             "or choose another run_dir")
    try:  # before train.log is written there: a model's or a project's directory is left as it was
        check_fork_made(run_dir)
    except UsageError as err:
        raise TrainingFailed(str(err)) from None
    log_path = run_dir / LOG_FILE
    device = params.run_device() if params.train_dtype == "auto" else None  # the dtype "auto" resolves to needs it
    with open(log_path, "w") as log:
        model = resolve_model(params.model, cache or run_dir.parent / ".models", log)
        prompts = resolve_prompts(params.prompts, run_dir, params.prompts_per_step * params.steps)
        argv = params.argv(model, prompts, run_dir, device)
        log.write("$ " + shlex.join(argv) + "\n")
        log.flush()
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=run_dir.parent,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", PARENT_ENV: str(os.getpid())},
                                start_new_session=True)
        seen = 0
        try:
            while True:
                done = proc.poll() is not None
                records = read_metrics_records(run_dir) if (run_dir / "metrics.jsonl").is_file() else []
                if on_progress is not None and (len(records) != seen or done):
                    on_progress(records)
                seen = len(records)
                if done:
                    break
                time.sleep(params.refresh_seconds)
        except BaseException:  # a notebook interrupt stops the job and its Ray processes, never leaves them running
            stop_process_tree([proc.pid])
            proc.wait()
            raise
    if proc.returncode != 0:
        raise TrainingFailed(failure("training", proc.returncode, log_path))
    if params.eval_prompts and params.eval_kept:
        evaluate_kept_policy(params, model, run_dir, device)
    return run_dir


def evaluate_kept_policy(params: TrainParams, model_dir: Path, run_dir: Path, device: str | None = None) -> Path:
    """Score the saved final model and the base model on the held-out set in a subprocess (its log appended to
    train.log); returns <run_dir>/heldout_kept.json. Outside the training controller: the run has exited."""
    argv = kept_eval_argv(params, model_dir, run_dir, device)
    log_path = run_dir / LOG_FILE
    with open(log_path, "a") as log:
        log.write("$ " + shlex.join(argv) + "\n")
        log.flush()
        code = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, cwd=run_dir.parent,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True).returncode
    if code != 0:
        raise TrainingFailed(failure("the held-out evaluation of the kept policy", code, log_path))
    return run_dir / KEPT_FILE
