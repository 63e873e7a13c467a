"""One training job driven from a notebook: parameters -> the training CLI in a subprocess -> live curves.

Ray and vLLM never live in the notebook's kernel: the job is `python -m openrlhf_tis.cli.train_ppo_ray`
in a child process (its whole log goes to `<run_dir>/train.log`), so a crash or a kill of the job never
takes the kernel down, and `RAY_ADDRESS`, inherited from the environment, sends the same notebook to a
cluster. Progress is read where every consumer reads it: the run store's `metrics.jsonl`. The job ends
with the kernel even when the kernel is killed rather than interrupted (cli/lifetime.py).
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any, TextIO

from openrlhf_tis.cli.cluster_device import ClusterResources, read_cluster
from openrlhf_tis.cli.lifetime import PARENT_ENV, stop_process_tree
from openrlhf_tis.cli.run_dir import lock_owner
from openrlhf_tis.correction.config import FLAG_PREFIX, PRESETS, CorrectionConfig
from openrlhf_tis.cpu_features import default_train_dtype
from openrlhf_tis.errors import UsageError
from openrlhf_tis.params import Param, ParameterError, flag_argv, positive
from openrlhf_tis.pipeline.failure import failure
from openrlhf_tis.pipeline.heldout import KEPT_FILE, KEPT_MODEL_DIR
from openrlhf_tis.rollout.precision import PRECISIONS
from openrlhf_tis.runs.reader import read_metrics_records

DEMO_REWARD = Path(str(resources.files("openrlhf_tis") / "demo" / "dense_reward.py"))
LOG_FILE = "train.log"
EVAL_TEMPERATURE = 1.0  # held-out samples are drawn as in training, so pass1 is the training reward's held-out twin


def _existing_file_or_empty(value: str) -> str | None:
    return None if not value or Path(value).expanduser().is_file() else f"no such file: {value}"


def _model(value: str) -> str | None:
    if value in ("tiny", "default") or (Path(value).expanduser() / "config.json").is_file():
        return None
    return "must be 'tiny', 'default' or a model directory holding config.json"


def _str_list(value: list) -> str | None:
    return None if all(isinstance(v, str) for v in value) else "must be a list of strings"


CORRECTION_FIELDS = tuple(f.name for f in dataclasses.fields(CorrectionConfig))  # one --algo.correction.<field> each


def _options(value: dict) -> str | None:
    unknown = [k for k in value if k not in CORRECTION_FIELDS]
    return f"{unknown[0]!r} is not a CorrectionConfig field; known: {', '.join(CORRECTION_FIELDS)}" if unknown else None


# Each parameter names the training CLI flag it becomes (build_argv derives the command from them); the four without
# one act in the notebook's job: steps bounds the prompt file, eval_kept scores the saved model after the run,
# extra_args are flags already, refresh_seconds paces the live curves.
TRAIN_PARAMS: dict[str, Param] = {
    "model": Param("tiny", "'tiny' (random 2-layer, seconds per step), 'default' (embedded SmolLM2-135M-Instruct) "
                   "or a model directory", (str,), check=_model, flag="--actor.model_name_or_path"),
    "prompts": Param("", "prompt JSONL with input/label keys; '' writes the demo task's training questions", (str,),
                     check=_existing_file_or_empty, flag="--data.prompt_dataset"),
    "reward": Param("", "reward script defining reward_func; '' uses the demo task's reward plus its dense digit term",
                    (str,), check=_existing_file_or_empty, flag="--reward.remote_url"),
    "correction": Param("tis", "a correction preset (--algo.correction.preset)", (str,), tuple(PRESETS),
                        flag=FLAG_PREFIX + "preset"),
    "correction_options": Param({}, "single correction fields over the preset, e.g. {'upper': 3}", (dict,),
                                check=_options, flag=FLAG_PREFIX),
    "eval_prompts": Param("", "held-out prompt JSONL (same keys), scored with the training reward before the "
                          "first step and every eval_every steps; '' skips evaluation", (str,),
                          check=_existing_file_or_empty, flag="--eval.dataset"),
    "eval_samples": Param(1, "responses sampled per held-out prompt (at temperature 1, as in training)", (int,),
                          check=positive, flag="--eval.n_samples_per_prompt"),
    "eval_kept": Param(True, "with eval_prompts: after training, also score the weights the run keeps (its saved "
                       "final model, in the trainer's dtype, unquantized) and the base model on the same questions "
                       "and samples (<run_dir>/heldout_kept.json); the in-run score goes through the rollout engine",
                       (bool,)),
    "eval_every": Param(0, "score the held-out set every N steps (0: before the first step and after the last)",
                        (int,), check=lambda v: None if v >= 0 else "must be >= 0", flag="--eval.steps"),
    "rollout_precision": Param("bf16", "vLLM rollout precision", (str,), PRECISIONS, flag="--vllm.rollout_precision"),
    "int8_weight_bits": Param("auto", "int8 rollouts' weight grid (--vllm.int8_weight_bits): auto (8 bits, 7 where the "
                              "CPU's int8 GEMM saturates 8-bit weights) or a bit count; only with rollout_precision "
                              "int8", (str,), check=lambda v: None if v == "auto" or v.isdigit() else
                              "must be 'auto' or a bit count such as '6'", flag="--vllm.int8_weight_bits"),
    "train_dtype": Param("auto", "trainer precision (--ds.param_dtype); auto: bf16 on CUDA or CPUs with native bf16, "
                         "fp32 where the CPU emulates bf16", (str,), ("auto", "bf16", "fp32"), flag="--ds.param_dtype"),
    "steps": Param(2, "training steps (one rollout batch each)", (int,), check=positive),
    "prompts_per_step": Param(4, "prompts per rollout batch", (int,), check=positive, flag="--rollout.batch_size"),
    "samples_per_prompt": Param(2, "responses per prompt (group estimators need 2 or more)", (int,), check=positive,
                                flag="--rollout.n_samples_per_prompt"),
    "max_new_tokens": Param(24, "longest response in tokens", (int,), check=positive, flag="--rollout.max_new_tokens"),
    "lr": Param(1e-3, "actor learning rate (tiny random models need ~1e-3, real ones ~1e-6..1e-5)", (float,),
                check=positive, flag="--actor.adam.lr"),
    "seed": Param(42, "training seed", (int,), flag="--train.seed"),
    "async_queue": Param(0, "async training: rollout batches the generator may run ahead of the trainer "
                         "(--train.async_enable --train.async_queue_size N); 0 trains synchronously", (int,),
                         check=lambda v: None if v >= 0 else "must be >= 0", flag="--train.async_queue_size"),
    "token_dump_every": Param(1, "dump per-token records every N steps (0: never)", (int,),
                              check=lambda v: None if v >= 0 else "must be >= 0", flag="--logger.token_dump_steps"),
    "run_dir": Param("runs/notebook", "the run directory (created; a finished one is refused by the CLI)", (str,),
                     check=lambda v: None if v else "must not be empty", flag="--logger.run_dir"),
    "extra_args": Param([], "more training CLI flags, e.g. ['--vllm.fp32_lm_head']; they win over the above",
                        (list,), check=_str_list),
    "refresh_seconds": Param(2.0, "how often the live figure polls metrics.jsonl", (float, int), check=positive),
}


class TrainingFailed(RuntimeError):
    """The training process exited non-zero; the message carries the tail of its log."""


def resolve_model(model: str, cache: Path, log: TextIO) -> Path:
    """The model directory for `model`: built once under `cache` for 'tiny', the embedded one for 'default'.

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


def micro_batch(batch: int, largest: int = 8) -> int:
    """The largest micro batch up to `largest` that divides `batch` (DeepSpeed needs whole micro batches)."""
    return max(d for d in range(1, min(batch, largest) + 1) if batch % d == 0)


def max_len(params: dict[str, Any]) -> int:
    """Prompt + response budget (--data.max_len): the demo prompts fit 128 tokens."""
    return 128 + params["max_new_tokens"]


def reward_file(params: dict[str, Any]) -> Path:
    return Path(params["reward"]).expanduser().resolve() if params["reward"] else DEMO_REWARD


def train_dtype(params: dict[str, Any]) -> str:
    """The trainer's dtype (--ds.param_dtype): what the run's saved model holds."""
    return default_train_dtype() if params["train_dtype"] == "auto" else params["train_dtype"]


def kept_eval_argv(params: dict[str, Any], model_dir: Path, run_dir: Path) -> list[str]:
    """The held-out evaluation of the kept policy and the base model (pipeline/heldout.py), after training."""
    return [sys.executable, "-m", "openrlhf_tis.pipeline.heldout", "--run_dir", str(run_dir), "--base", str(model_dir),
            "--eval_prompts", str(Path(params["eval_prompts"]).expanduser().resolve()),
            "--reward", str(reward_file(params)), "--dtype", train_dtype(params),
            "--n_samples", str(params["eval_samples"]), "--seed", str(params["seed"]),
            "--temperature", str(EVAL_TEMPERATURE), "--max_new_tokens", str(params["max_new_tokens"]),
            "--max_len", str(max_len(params)), "--cache_dir", str(heldout_cache_dir())]


def heldout_cache_dir() -> Path:
    """Where base-model held-out scores are shared by every run (and every sweep cell) that asks the same question:
    `$OPENRLHF_TIS_CACHE/heldout`, by default ~/.cache/openrlhf_tis/heldout. Safe to share: an entry is keyed by
    the model's files and mtimes, the eval and reward files and every sampling setting."""
    return Path(os.environ.get("OPENRLHF_TIS_CACHE", Path.home() / ".cache" / "openrlhf_tis")).expanduser() / "heldout"


def flag_values(params: dict[str, Any], model_dir: Path, prompts: Path, run_dir: Path) -> dict[str, Any]:
    """Checked `params` as their flags take them: files resolved, None where the flag is left out."""
    evaluated = bool(params["eval_prompts"])  # sampled as in training: held-out pass@1 is the training reward's twin
    return {
        **params, "model": model_dir, "prompts": prompts, "reward": reward_file(params),
        "train_dtype": train_dtype(params), "run_dir": run_dir,
        "eval_prompts": Path(params["eval_prompts"]).expanduser().resolve() if evaluated else None,
        "eval_samples": params["eval_samples"] if evaluated else None,
        "eval_every": params["eval_every"] or params["steps"] if evaluated else -1,
        # the CLI refuses an explicit grid for other precisions, naming the flag
        "int8_weight_bits": None if params["int8_weight_bits"] == "auto" else params["int8_weight_bits"],
        "async_queue": params["async_queue"] or None,
    }


def build_argv(params: dict[str, Any], model_dir: Path, prompts: Path, run_dir: Path) -> list[str]:
    """The training command line for checked `params`: each parameter's flag (TRAIN_PARAMS), then what the
    notebook's job fixes or derives from several of them, then extra_args (last, so they win)."""
    n, group = params["prompts_per_step"], params["samples_per_prompt"]
    batch = n * group
    micro = str(micro_batch(batch))
    argv = [
        sys.executable, "-m", "openrlhf_tis.cli.train_ppo_ray",
        *flag_argv(flag_values(params, model_dir, prompts, run_dir), TRAIN_PARAMS),
        "--data.input_key", "input", "--data.label_key", "label",
        "--data.apply_chat_template", "--data.max_len", str(max_len(params)), "--vllm.num_engines", "1",
        "--algo.advantage.estimator", "group_norm" if group > 1 else "reinforce", "--algo.kl.init_coef", "0",
        "--rollout.micro_batch_size", micro, "--train.batch_size", str(batch), "--train.micro_batch_size", micro,
        "--train.num_episodes", "1", "--train.max_epochs", "1", "--ds.zero_stage", "2", "--actor.lr_warmup_ratio", "0",
        # No DeepSpeed checkpoints: upstream still saves a "best" one (2.1 GB for SmolLM2 with Adam) whenever the
        # engine's held-out score improves unless its metric key is "none"; the kept weights go to output_dir.
        "--ckpt.path", str(run_dir / "ckpt"), "--ckpt.save_steps", "-1", "--ckpt.best_metric_key", "none",
        "--ckpt.output_dir", str(run_dir / KEPT_MODEL_DIR),
        "--logger.logging_steps", "1",
    ]
    if params["eval_prompts"]:
        argv += ["--eval.temperature", str(EVAL_TEMPERATURE)]
    if params["async_queue"]:
        argv += ["--train.async_enable"]
    return argv + list(params["extra_args"])


def check_training_command(params: dict[str, Any], cluster: ClusterResources | None = None) -> None:
    """The training CLI's own checks of what its flags decide (cli/checks.py `check_flags`: batch sizes, async,
    rollout precision, correction, ...) on the command line that checked `params` become, before any file is
    written or process started, so a refusal costs seconds instead of a notebook's start-up. What needs the job's
    files (the model, built later for 'tiny'; the prompt file, written later) is left to the CLI itself. Raises
    ParameterError naming the flag. `cluster`: the run's (cli/cluster_device.py ClusterResources), read when None."""
    from openrlhf_tis import patches
    from openrlhf_tis.cli.train_ppo_ray import build_parser, parse_flags

    patches.apply_platform_patches()  # upstream's parser module cannot be imported without them on CPU
    parser = build_parser()

    def error(message: str):
        raise ParameterError(f"training CLI flags: {message}")

    parser.error = error
    given = Path(params["model"]).expanduser(), Path(params["prompts"]), Path(params["run_dir"])
    try:
        parse_flags(parser, build_argv(params, *given)[3:], read_cluster() if cluster is None else cluster)
    except UsageError as err:
        raise ParameterError(f"training CLI flags: {err}") from None


def run_training(
    params: dict[str, Any],
    on_progress: Callable[[list[dict[str, Any]]], None] | None = None,
    cache: Path | None = None,
) -> Path:
    """Run one training job for checked `params`; returns its run directory, raises TrainingFailed.

    `on_progress(records)` is called with every metrics record so far whenever new steps land (and once
    at the end), so a notebook can redraw its curves as the run goes.
    """
    run_dir = Path(params["run_dir"]).expanduser().resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    owner = lock_owner(run_dir)
    if owner is not None:  # checked here too, so a second start never truncates the live run's train.log
        raise TrainingFailed(f"{run_dir} is in use by another run (pid {owner}); wait for it to end, stop it, "
                             "or choose another run_dir")
    log_path = run_dir / LOG_FILE
    with open(log_path, "w") as log:
        model = resolve_model(params["model"], cache or run_dir.parent / ".models", log)
        prompts = resolve_prompts(params["prompts"], run_dir, params["prompts_per_step"] * params["steps"])
        argv = build_argv(params, model, prompts, run_dir)
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
                time.sleep(params["refresh_seconds"])
        except BaseException:  # a notebook interrupt stops the job and its Ray processes, never leaves them running
            stop_process_tree([proc.pid])
            proc.wait()
            raise
    if proc.returncode != 0:
        raise TrainingFailed(failure("training", proc.returncode, log_path))
    if params["eval_prompts"] and params["eval_kept"]:
        evaluate_kept_policy(params, model, run_dir)
    return run_dir


def evaluate_kept_policy(params: dict[str, Any], model_dir: Path, run_dir: Path) -> Path:
    """Score the saved final model and the base model on the held-out set in a subprocess (its log appended to
    train.log); returns <run_dir>/heldout_kept.json. Outside the training controller: the run has exited."""
    argv = kept_eval_argv(params, model_dir, run_dir)
    log_path = run_dir / LOG_FILE
    with open(log_path, "a") as log:
        log.write("$ " + shlex.join(argv) + "\n")
        log.flush()
        code = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, cwd=run_dir.parent,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True).returncode
    if code != 0:
        raise TrainingFailed(failure("the held-out evaluation of the kept policy", code, log_path))
    return run_dir / KEPT_FILE
