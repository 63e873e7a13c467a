"""The cluster launch OpenRLHF users know, and the code paths the other real runs leave out, in one launch:
`ray job submit --address … -- python -m openrlhf_tis.cli.train_ppo_ray …` against a Ray cluster that was already
running (`ray start --head` on 127.0.0.1, with the dashboard `ray job submit` talks to), training the tiny model to
completion with an INT8 W8A8 rollout engine (re-quantized at every sync), bypass PPO (π_old := μ, the old-log-prob
forward never dispatched), held-out evaluation on the step lines, and upstream's TensorBoard and W&B (offline)
loggers beside the run store.

The cluster is this module's own (_support.ray_head: its own temp dir and ports, stopped by PID, never `ray stop`).
It declares logical GPU slots for CPU processes, so the run says `--cluster.device cpu` (auto would read a GPU
cluster there).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from _support import RAY, REWARD, free_port, ray_head

from openrlhf_tis.demo.task import split, write_jsonl, write_prompts

pytestmark = [pytest.mark.e2e, pytest.mark.extended]  # a Ray head and a launch: ≈ 7 min on 2 cores
STEPS = 3
EVAL_STEPS, EVAL_PROMPTS, EVAL_SAMPLES = 2, 6, 2
# Logical slots the tiny run's placement asks for (cli/ray_cluster.declared_gpus: 1 actor + 1 vLLM engine; no
# reference model with KL 0, a local reward); a CPU cluster declares them as "GPUs" (docs/design.md §5).
GPU_SLOTS = 2
START_S = 300


@contextlib.contextmanager
def ray_cluster(env: dict[str, str], log: Path) -> Iterator[str]:
    """A head node on 127.0.0.1 with its dashboard; yields the dashboard's address."""
    dashboard, agent = free_port(), free_port()
    options = ["--num-cpus", "8", "--num-gpus", str(GPU_SLOTS), "--include-dashboard", "true",
               "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dashboard),
               "--dashboard-agent-listen-port", str(agent)]
    address = f"http://127.0.0.1:{dashboard}"
    # a job goes through the node's agent
    with ray_head(options, env, log, lambda: _answers(f"{address}/api/jobs/") and _listening(agent), START_S):
        yield address


def _answers(url: str) -> bool:
    with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=5) as reply:
        return reply.status == 200
    return False


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _train_argv(model_dir: Path, work: Path) -> list[str]:
    return [
        sys.executable, "-m", "openrlhf_tis.cli.train_ppo_ray",
        "--actor.model_name_or_path", str(model_dir), "--reward.remote_url", str(REWARD),
        "--data.prompt_dataset", str(work / "prompts.jsonl"), "--data.input_key", "input",
        "--data.label_key", "label", "--data.apply_chat_template", "--vllm.num_engines", "1",
        "--algo.advantage.estimator", "group_norm", "--algo.kl.init_coef", "0",
        "--rollout.n_samples_per_prompt", "2", "--rollout.batch_size", "4", "--rollout.micro_batch_size", "8",
        "--train.batch_size", "8", "--train.micro_batch_size", "8", "--data.max_len", "128",
        "--rollout.max_new_tokens", "16", "--data.max_samples", str(4 * STEPS), "--ds.zero_stage", "2",
        "--actor.adam.lr", "1e-3", "--actor.lr_warmup_ratio", "0", "--train.seed", "7",
        "--eval.dataset", str(work / "eval.jsonl"), "--eval.steps", str(EVAL_STEPS),
        "--eval.n_samples_per_prompt", str(EVAL_SAMPLES), "--ckpt.best_metric_key", "none",
        "--ckpt.path", str(work / "ckpt"), "--ckpt.output_dir", str(work / "final"),
        "--logger.run_dir", str(work / "run"), "--logger.token_dump_steps", "0",
        "--vllm.rollout_precision", "int8", "--algo.correction.preset", "bypass_ppo",
        # upstream's loggers keep working beside the run store; W&B offline needs no network
        "--logger.tensorboard_dir", str(work / "tb"), "--logger.wandb.key", "0" * 40,
        "--cluster.device", "cpu",
    ]


@pytest.fixture(scope="module")
def run(tiny_model_dir, tmp_path_factory):
    """The run, submitted as a Ray job to this module's cluster: (work dir, its step lines, the job's output)."""
    work = tmp_path_factory.mktemp("e2e_ray_job")
    write_prompts(work / "prompts.jsonl", 4 * STEPS)
    write_jsonl(work / "eval.jsonl", split()[1][:EVAL_PROMPTS])
    # The cluster's processes, hence the job's driver, run `python` from this venv and import this checkout.
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    with ray_cluster(env, work / "ray_head.log") as address:
        # env_vars the job sets that the fork sets too (upstream's README passes a runtime env the same way)
        job_env = json.dumps({"env_vars": {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                                           "WANDB_MODE": "offline", "WANDB_DIR": str(work)}})
        submit = [str(RAY), "job", "submit", "--address", address, "--runtime-env-json", job_env, "--",
                  *_train_argv(tiny_model_dir, work)]
        proc = subprocess.run(submit, env=env, cwd=work, capture_output=True, text=True, timeout=900)
    log = proc.stdout + proc.stderr
    logs = work / "ray_logs"
    server_logs = "".join(f"\n--- {name}\n" + (logs / name).read_text()[-2000:]
                          for name in ("dashboard.log", "dashboard_agent.log") if (logs / name).is_file())
    assert proc.returncode == 0, log[-6000:] + server_logs
    steps = [json.loads(line) for line in (work / "run" / "metrics.jsonl").read_text().splitlines()]
    return work, steps, log


def test_ray_job_submit_trains_on_an_existing_cluster(run):
    _, steps, log = run
    assert "succeeded" in log, log[-3000:]
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1)), log[-3000:]


def test_int8_engine_is_resynced_and_verified_every_step(run):
    _, steps, _ = run
    for s in steps:
        # INT8 activations/weights vs the bf16 trainer: larger than bf16-vs-bf16 (~1e-3), far below a stale
        # or corrupt engine (the sync moved the engine's log-probs by several times this gap).
        assert s["sync/vllm_vs_trainer_mean_abs_logprob"] < 0.02, s
        assert s["sync/vllm_logprob_change_mean_abs"] > 3 * s["sync/vllm_vs_trainer_mean_abs_logprob"], s
        # What each engine's receive returned of the sync's re-quantization (recomputed scales never saturate).
        assert s["rollout/int8_saturated_fraction"] == 0.0 and 0 < s["rollout/int8_max_rel_error"] < 0.01, s
        assert s["rollout/int8_quantize_s"] > 0, s


def test_bypass_trains_with_rollout_logprobs_as_old(run):
    _, steps, _ = run
    for s in steps:
        assert math.isfinite(s["policy_loss"]) and s["actor_grad_norm"] > 0
        assert s["rollout/logprob_coverage"] == 1.0
        assert math.isfinite(s["mismatch/k3_kl"]) and s["mismatch/k3_kl"] >= 0


def test_upstream_loggers_write_beside_the_run_store(run):
    work, _, _ = run
    assert list((work / "tb").rglob("events.out.tfevents.*"))
    offline_runs = list((work / "wandb").glob("offline-run-*"))
    assert offline_runs and list(offline_runs[0].glob("*.wandb"))


def test_held_out_evaluation_lands_in_metrics_jsonl(run):
    """Upstream's eval logs to wandb/TensorBoard only; the fork writes it on the step lines, plus a
    pre-training eval on step 1's line. The dense reward (never all-zero on the random tiny model)
    makes the pass rates informative."""
    _, steps, _ = run
    for line in steps:
        evaluated = {"eval_start"} if line["step"] == 1 else set()
        if line["step"] % EVAL_STEPS == 0:
            evaluated.add("eval")
        assert {key.split("/")[0] for key in line if key.startswith("eval")} == evaluated, line
        for prefix in evaluated:
            assert line[f"{prefix}/num_samples"] == EVAL_PROMPTS * EVAL_SAMPLES
            assert 0 <= line[f"{prefix}/default_pass1"] <= line[f"{prefix}/default_pass{EVAL_SAMPLES}"]
            assert line[f"{prefix}/seconds"] > 0
