"""`python -m openrlhf_tis.pipeline.main_job`: the project's main job, what `scripts/main_job.sh` runs.

Trains the embedded SmolLM2-135M-Instruct on the demo task (single-digit arithmetic, openrlhf_tis/demo/task.py)
with INT8 rollouts and token TIS by executing openrlhf_tis/notebooks/train.ipynb with papermill (the executed
notebook and its HTML export are the report), while the console shows a progress bar and one line per step; every
log of Ray, vLLM and DeepSpeed goes to `<run_dir>/train.log`. The held-out questions are scored before the first
step and at the end, through the rollout engine (INT8 here) and, after training, on the policy a user keeps: the
saved final weights in the trainer's dtype against the base model (pipeline/kept_eval.py). Where the CPU emulates
bf16 (plain AVX2), the trainer runs in fp32, several times faster there. On a CUDA cluster, which refuses INT8
rollouts, the same task runs with bf16 rollouts and token TIS (`job_profile`).
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from openrlhf_tis.cli.cluster_device import ClusterResources, decide_device, read_cluster, requested_device
from openrlhf_tis.cpu_features import native_bf16
from openrlhf_tis.demo.task import write_task
from openrlhf_tis.errors import UsageError
from openrlhf_tis.params import ParameterError
from openrlhf_tis.pipeline.console import follow_run
from openrlhf_tis.pipeline.execute import export_html
from openrlhf_tis.pipeline.failure import log_tail, notebook_error
from openrlhf_tis.pipeline.interrupt import execute_stoppable, kept, resumable, stopped
from openrlhf_tis.pipeline.train import LOG_FILE, check_training_command
from openrlhf_tis.pipeline.train_params import TrainParams
from openrlhf_tis.runs.kept_score import engine_label
from openrlhf_tis.runs.reader import last_logged_step, load_metrics
from openrlhf_tis.runs.summary import summary
from openrlhf_tis.sigint import INTERRUPTED_EXIT, take_sigint
from openrlhf_tis.viz.compare import held_out_key
from openrlhf_tis.viz.curves import held_out

TASK_REWARD = Path(str(resources.files("openrlhf_tis") / "demo" / "task_reward.py"))
# train.ipynb parameters of the main job on any CPU. The sync check compares the INT8 engine with the trainer
# on sampled tokens against their gap before the first step (the INT8 mismatch itself, a few tenths of a nat,
# which varies between checks on 8 tokens): 1.0 above it leaves room for that, while broken weights give
# several nats more; it runs at every 4th sync (a check costs seconds on a CPU). A truncated answer earns 0
# (upstream's stop_properly_penalty_coef): without it the policy drifted to rambling 32-token answers whose last
# number was sometimes right and held-out accuracy fell; with it (and lr 2e-5) it rose (docs/measurements.md).
MAIN_JOB_PARAMS: dict[str, Any] = {
    "model": "default", "rollout_precision": "int8", "correction": "tis",
    "steps": 24, "prompts_per_step": 4, "samples_per_prompt": 4, "max_new_tokens": 32, "lr": 2e-5,
    "token_dump_every": 4,
    "extra_args": ["--vllm.sync_check_tolerance", "1.0", "--vllm.sync_check_steps", "4",
                   "--reward.stop_properly_penalty_coef", "0"],
}


MODEL_HELP = "'default' (SmolLM2-135M-Instruct), 'tiny', 'upcycled' (the MoE demo) or a directory"
"""`--model`'s help, the main job's and the studies'."""


# On CUDA the job asks for one GPU, whatever the machine has: the actor (upstream's default is 8 per node) and the
# one vLLM engine share it (upstream's hybrid engine, --train.colocate_all), the engine's memory capped so DeepSpeed
# fits beside it; no --vllm.enable_sleep, which the 135M model does not need.
ONE_GPU = ["--actor.num_gpus_per_node", "1", "--train.colocate_all", "--vllm.gpu_memory_utilization", "0.4"]


@dataclass(frozen=True)
class Profile:
    name: str
    why: str
    params: dict[str, Any]  # train.ipynb parameters over MAIN_JOB_PARAMS


def job_profile(cuda: bool) -> Profile:
    """The main job's rollouts and trainer for its cluster's device (printed at the start of the job)."""
    if cuda:
        # INT8 rollouts on CUDA take a re-quantizing receive that has not run on a GPU yet: the same task with bf16
        # engines, upstream's own sync, whose smaller mismatch TIS still measures and corrects.
        return Profile("cuda", "a CUDA cluster: bf16 rollouts + token TIS, trainer in bf16, "
                       "actor and engine sharing one GPU, by default 24 steps and held-out x4 samples",
                       {"rollout_precision": "bf16", "train_dtype": "bf16", "eval_samples": 4,
                        "extra_args": [*MAIN_JOB_PARAMS["extra_args"], *ONE_GPU]})
    if native_bf16():
        return Profile("bf16", "this CPU computes bf16 in hardware (AVX-512 BF16/AMX): INT8 rollouts + token TIS, "
                       "trainer in bf16, by default 24 steps and held-out x4 samples",
                       {"train_dtype": "bf16", "eval_samples": 4})
    # With the fp32 trainer on a 2-core CPU a step of 4 prompts x 4 INT8 rollouts, the start-up and each held-out
    # pass take about a minute each, so 6 steps keep the job near 10 minutes; two prompts a step learned less for
    # the time (docs/measurements.md: the AVX2 profile).
    return Profile("fp32", "this CPU emulates bf16 (no AVX-512 BF16/AMX): INT8 rollouts + token TIS, trainer in fp32 "
                   "(several times faster here), by default 6 steps and held-out x1 sample",
                   {"train_dtype": "fp32", "steps": 6})


def job_device(flags: list[str], cluster: ClusterResources) -> str:
    """cpu or cuda: what the training CLI will decide for the job's `flags` (their --cluster.device, else auto) on
    `cluster`, the one it will use (cli/cluster_device.py); UsageError when they disagree."""
    return decide_device(requested_device(flags), cluster)


def job_params(out: Path, model: str = "default", cuda: bool = False) -> dict[str, Any]:
    """The main job's train.ipynb parameters on a CPU or CUDA (`cuda`) cluster, with the demo task's files written
    under `out`.

    The mismatch study (study/dose_response.py) runs this same recipe in every cell, so its int8 + tis cells
    are the main job under other seeds.
    """
    train, held_out_file = write_task(out)
    profile = job_profile(cuda)
    return {**MAIN_JOB_PARAMS, **profile.params, "model": model, "prompts": str(train),
            "eval_prompts": str(held_out_file), "reward": str(TASK_REWARD)}


class NotebookFailed(RuntimeError):
    """train.ipynb failed: the message is the cause in one line, then where the report and the log are."""


def run_main_job(params: TrainParams, out_dir: Path) -> dict[str, Any]:
    """Execute train.ipynb with checked `params` while the console follows the run; export the HTML report.

    Ctrl-C raises interrupt.Stopped once the training and every process it started have ended.
    """
    run_dir = Path(params.run_dir)
    notebook = out_dir / "train.ipynb"
    failure = None
    try:
        execute_stoppable("train", notebook, params.values(), cwd=out_dir,
                          wait=lambda done: follow_run(run_dir, params.steps, done))
    except Exception as err:  # reported after the report is exported
        failure = err
    html = export_html(notebook, out_dir / "report.html")
    if failure:
        log = run_dir / LOG_FILE
        raise NotebookFailed(f"the training notebook failed at {notebook_error(failure)}\nreport: {html}; full log: "
                             f"{log}; its last 20 lines:\n{log_tail(log, 20)}")
    metrics = load_metrics(run_dir)
    key = held_out_key(metrics)
    _, held = held_out(metrics, key) if key else (None, [])
    return {"run_dir": run_dir, "notebook": notebook, "html": html, "summary": summary(run_dir),
            "held_out": (key, float(held[0]), float(held[-1])) if len(held) else None,
            "rollout_precision": params.rollout_precision}


def interrupted(params: TrainParams | None, stop: KeyboardInterrupt, argv: list[str]) -> str:
    """The one line a Ctrl-C ends the main job with: what was stopped, what was kept, the command that goes on."""
    again = shlex.join([sys.executable, "-m", "openrlhf_tis.pipeline.main_job", *argv])
    run_dir = Path(params.run_dir) if params is not None else None
    if run_dir is None or not run_dir.is_dir():
        return f"interrupted before the training started, nothing kept; start it again with: {again}"
    account = f"interrupted: {stopped(getattr(stop, 'jobs', []))}; kept: {kept(run_dir, params.steps)}"
    last = last_logged_step(run_dir) or 0
    if last >= params.steps:
        return f"{account}; its training had ended; a new run: {again}"
    if resumable(run_dir):
        return f"{account}; resume it with: {again} --set run_dir={shlex.quote(str(run_dir))} --ckpt.load_enable"
    why = "no step was logged" if not last else "the main job saves checkpoints only when given --ckpt.save_steps N"
    return f"{account}; it cannot be resumed ({why}); start it again with: {again}"


def describe(result: dict[str, Any]) -> str:
    """The closing lines: reward before -> after, mismatch, masking, where the report is."""
    s = result["summary"]

    def trend(part: dict | None, spec: str) -> str:
        if not part or part.get("first") is None:
            return "not logged"
        return f"{format(part['first'], spec)} -> {format(part['last'], spec)}"

    masked = s.get("masked") or {}
    kept = s.get("held_out_kept")
    engine = engine_label(result.get("rollout_precision", "bf16"))
    lines = [
        f"steps: {s['steps']}",
        f"reward (first -> last tenth of steps): {trend(s.get('reward'), '.3f')}",
        *([f"held-out pass1, {kept['label']} (base model -> saved final model): {kept['pass1_before']:.3f} -> "
           f"{kept['pass1_after']:.3f} ({kept['questions']} questions x {kept['n_samples']})"] if kept else []),
        "held-out: not evaluated" if not result.get("held_out") else
        "held-out {}, {} (before training -> last evaluation): {:.3f} -> {:.3f}".format(
            result["held_out"][0], engine, *result["held_out"][1:]),
        f"k3 KL(μ‖π_old): {trend(s.get('mismatch'), '.2e')}",
        f"masked fraction (last): {masked.get('last'):.3f}" if masked.get("last") is not None else "masked: not logged",
        f"run: {result['run_dir']}",
        f"report: {result['html']}",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    take_sigint()
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="main_job", description=__doc__.split("\n")[0],
                                     epilog="Any other --flag goes to the training CLI (train_ppo_ray) and wins.")
    parser.add_argument("--out", default="work/main_job", help="working directory (task files, runs, report)")
    parser.add_argument("--model", default="default", help=MODEL_HELP)
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                        help="override a train.ipynb parameter (Python literal), e.g. --set steps=5")
    args, extra = parser.parse_known_args(argv)
    check_model_option(parser, args.model)
    out = Path(args.out).expanduser().resolve()
    params, cluster = None, read_cluster()
    try:
        cuda = job_device(extra, cluster) == "cuda"
    except UsageError as err:
        print(f"main_job: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    try:
        profile = job_profile(cuda)
        print(f"[main job] {profile.name}: {profile.why}", file=sys.stderr)
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
        overrides = dict(_literal(item) for item in args.set)
        base = {**job_params(out, args.model, cuda), "run_dir": str(out / "runs" / stamp)}
        params = TrainParams.checked({**base, **overrides, "extra_args": [*base["extra_args"], *extra]},
                                     where="main job")
        check_training_command(params, cluster)
        result = run_main_job(params, Path(params.run_dir))
    except ParameterError as err:
        print(f"main_job: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    except NotebookFailed as err:  # the cause says it all: no traceback of this process or of the kernel
        print(f"main_job: error: {err}", file=sys.stderr)
        raise SystemExit(1) from None
    except KeyboardInterrupt as stop:
        print(f"main_job: {interrupted(params, stop, argv)}", file=sys.stderr)
        raise SystemExit(INTERRUPTED_EXIT) from None
    print(describe(result))


def check_model_option(parser: argparse.ArgumentParser, model: str) -> None:
    """`--model` (the main job's and the study's) judged as train.ipynb's `model` parameter, refused by `parser`
    naming --model before anything is written."""
    if (problem := TrainParams.spec()["model"].problem(model)) is not None:
        parser.error(f"--model {model}: {problem}")


def _literal(item: str) -> tuple[str, Any]:
    import ast

    name, _, text = item.partition("=")
    try:
        return name, ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return name, text  # a bare word is a string


if __name__ == "__main__":
    main()
