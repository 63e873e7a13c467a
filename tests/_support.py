"""Helpers several test modules share: refused CLI runs, finished run directories, and scoring a fixed text
on vLLM vs HF."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
import ray
import torch

from openrlhf_tis.cli.ray_cluster import machine_load
from openrlhf_tis.demo.tiny_model import build_tiny_moe  # noqa: F401  (the tests' tiny MoE)

PREFIX = "openrlhf_tis.cli.train_ppo_ray: error: "


def error_line(stderr: str) -> str:
    """The refusal: exactly one line, the last one, starting with the command's error prefix."""
    lines = stderr.strip().splitlines()
    assert sum(PREFIX in line for line in lines) == 1, stderr
    assert lines[-1].startswith(PREFIX), stderr
    return lines[-1][len(PREFIX):]


def with_value(argv: list[str], flag: str, value: str) -> list[str]:
    argv = list(argv)
    argv[argv.index(flag) + 1] = value
    return argv


def run_dir(argv: list[str]) -> Path:
    return Path(argv[argv.index("--logger.run_dir") + 1])


def finished_run(argv: list[str]) -> Path:
    """What a run leaves: its config, two steps and a token dump."""
    from openrlhf_tis.cli import train_ppo_ray
    from openrlhf_tis.runs import RunWriter
    from openrlhf_tis.runs.layout import token_file

    train_ppo_ray.parse(argv, cpu=True)
    path = run_dir(argv)
    writer = RunWriter(path)
    writer.append_metrics(1, {"loss": 1.0})
    writer.append_metrics(2, {"loss": 0.5})
    token_file(path, 2).parent.mkdir()
    token_file(path, 2).write_bytes(b"dump")
    (path / "train.log").write_text("log")
    return path


REWARD = Path(__file__).resolve().parents[1] / "openrlhf_tis" / "demo" / "dense_reward.py"


def train_argv(model_dir: Path, work: Path, steps: int, dump_every: int, *, save_steps: int = 1,
               load: bool = True) -> list[str]:
    """A real GRPO run of the tiny model on `work`/prompts.jsonl: `steps` steps of 4 prompts x 2 samples, one vLLM
    engine, DeepSpeed ZeRO-2, checkpoints every `save_steps` under `work`/ckpt, the run store in `work`/run."""
    import sys

    return [
        sys.executable, "-m", "openrlhf_tis.cli.train_ppo_ray",
        "--actor.model_name_or_path", str(model_dir), "--reward.remote_url", str(REWARD),
        "--data.prompt_dataset", str(work / "prompts.jsonl"), "--data.input_key", "input",
        "--data.label_key", "label", "--data.apply_chat_template",
        "--vllm.num_engines", "1", "--algo.advantage.estimator", "group_norm", "--algo.kl.init_coef", "0",
        "--rollout.n_samples_per_prompt", "2", "--rollout.batch_size", "4", "--rollout.micro_batch_size", "8",
        "--train.batch_size", "8", "--train.micro_batch_size", "8", "--data.max_len", "128",
        "--rollout.max_new_tokens", "24", "--data.max_samples", str(4 * steps), "--train.num_episodes", "1",
        "--ds.zero_stage", "2", "--actor.adam.lr", "1e-3", "--actor.lr_warmup_ratio", "0", "--actor.min_lr_ratio", "1",
        "--algo.advantage.is_correction_level", "token", "--algo.advantage.is_correction_mode", "mask",
        "--ckpt.path", str(work / "ckpt"), "--ckpt.output_dir", str(work / "final"), "--ckpt.save_steps",
        str(save_steps), *(["--ckpt.load_enable"] if load else []), "--eval.steps", "-1", "--train.seed", "42",
        "--logger.run_dir", str(work / "run"), "--logger.token_dump_steps", str(dump_every),
    ]


def read_steps(run: Path) -> list[dict]:
    """The metrics lines a run directory holds so far."""
    import json

    path = run / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


HELD_REWARD = """\"\"\"{reward}'s reward, held (at most {hold_s} s, within --reward.timeout_s) at each call made after
two steps were logged while the file `hold` beside this one exists: the test kills the run there.\"\"\"
import importlib.util, time
from pathlib import Path

HERE = Path(__file__).parent
_spec = importlib.util.spec_from_file_location("held_reward", {reward!r})
_reward = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_reward)


def reward_func(*args, **kwargs):
    metrics, deadline = HERE / "run" / "metrics.jsonl", time.monotonic() + {hold_s}
    while ((HERE / "hold").exists() and metrics.exists() and len(metrics.read_text().splitlines()) >= 2
           and time.monotonic() < deadline):
        time.sleep(0.2)
    return _reward.reward_func(*args, **kwargs)
"""


def held_at_step_two(argv: list[str], work: Path) -> list[str]:
    """`argv` with its reward script replaced by one that holds the run after two logged steps while `work`/hold
    exists (HELD_REWARD): a 6-step run of the tiny model logs a step every ~0.2 s, so a test that kills "after two
    steps" by polling killed it after all six on a busy machine. The same script serves the resume (the run's
    config must not change); it no longer holds once `hold` is gone. `argv` already held is returned as it is."""
    at = argv.index("--reward.remote_url") + 1
    held = work / "held_reward.py"
    if argv[at] == str(held):
        return argv
    held.write_text(HELD_REWARD.format(reward=str(Path(argv[at]).resolve()), hold_s=45))
    return [*argv[:at], str(held), *argv[at + 1:]]


def kill_and_resume(argv: list[str], work: Path, total_steps: int, env: dict[str, str] | None = None,
                    on_start: Callable[[subprocess.Popen], None] = lambda proc: None,
                    after_kill: Callable[[], None] = lambda: None) -> tuple[str, list[dict]]:
    """Run `argv` in `work`, SIGKILL its process group after two logged steps (held there, `held_at_step_two`), run
    it again to the end; returns the resumed run's log and every metrics line (both runs' logs are kept beside the
    run).

    `env` is added to this process's environment for both runs (a None value removes the variable);
    `on_start(proc)` is called once the first run is started (its console goes to `work`/killed.log), `after_kill()`
    once its process group is killed, before the resume starts."""
    env = {key: value for key, value in {**os.environ, "RAY_DEDUP_LOGS": "0", **(env or {})}.items()
           if value is not None}
    argv = held_at_step_two(argv, work)
    (work / "hold").touch()
    with open(work / "killed.log", "w") as log:
        proc = subprocess.Popen(argv, cwd=work, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            on_start(proc)
            wait_for(lambda: len(read_steps(work / "run")) >= 2, proc)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    (work / "hold").unlink()
    killed_at = len(read_steps(work / "run"))
    assert 2 <= killed_at < total_steps, (killed_at, (work / "killed.log").read_text()[-4000:])
    after_kill()
    proc = subprocess.run(argv, cwd=work, capture_output=True, text=True, timeout=900, env=env)
    log = proc.stdout + proc.stderr
    (work / "resumed.log").write_text(log)
    assert proc.returncode == 0, log[-6000:]
    return log, read_steps(work / "run")


def sigint_as_in_a_shell() -> None:
    """A Popen `preexec_fn`: the command starts with SIGINT's default disposition, as from an interactive shell,
    whatever this test process inherited or was left with (an ignored SIGINT is inherited across exec)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def wait_for(predicate, proc, timeout: float = 600, poll: float = 0.2) -> bool:
    """Poll `predicate()` until it holds, `proc` exits or `timeout` seconds pass; returns the predicate's value."""
    import time

    deadline = time.monotonic() + timeout
    while not predicate() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(poll)
    return bool(predicate())


# A fixed token sequence within the tiny model's 512-token vocabulary.
TOKENS = [5, 17, 42, 99, 123, 7, 300, 256, 12, 64, 77, 401, 3, 88, 150, 222]


def refused(argv: list[str], capsys) -> str:
    """Run the training CLI on bad input: it must exit 2 before Ray starts; returns its stderr."""
    from openrlhf_tis.cli import train_ppo_ray

    with pytest.raises(SystemExit) as exit_info:
        train_ppo_ray.main(argv)
    assert exit_info.value.code == 2
    assert not ray.is_initialized()
    return capsys.readouterr().err


def free_port() -> int:
    """A local TCP port nobody listens on right now (for a weight-sync group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_engine(model_dir, dtype: str = "bfloat16", **kwargs):
    """An in-process vLLM-CPU engine (starts in a few seconds, callables reach its worker).

    An engine a test dropped (`del llm`) is collected first: its finalizer tears down vLLM's process-wide parallel
    groups, and run by the garbage collector in the middle of the next engine's start it took that engine's groups
    with it ("pipeline model parallel group is not initialized", seen on a Xeon with AMX)."""
    import gc

    gc.collect()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM

    return LLM(model=str(model_dir), dtype=dtype, enforce_eager=True, max_model_len=128, seed=0,
               distributed_executor_backend="uni", **kwargs)


def engine_prompt_logprobs(llm) -> torch.Tensor:
    """log p(TOKENS[i] | TOKENS[:i]) for i >= 1 as the engine computes it."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    out = llm.generate(TokensPrompt(prompt_token_ids=TOKENS), SamplingParams(max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    return torch.tensor([out.prompt_logprobs[i][t].logprob for i, t in enumerate(TOKENS) if i > 0])


def reference_logprobs(model) -> torch.Tensor:
    """The same log-probs from an HF model, log-softmax in float64: the independent reference."""
    with torch.no_grad():
        logits = model(torch.tensor([TOKENS])).logits[0, :-1].double()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(TOKENS[1:])[:, None])[:, 0]


def trainer_model(model_dir):
    """The HF model of `model_dir` in fp32 on bf16-representable weights, as the bf16 trainer holds them."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model.to(torch.bfloat16).to(torch.float32)


def save_as_source(model, like_dir, dst):
    """An HF model directory of `model`'s weights with the tokenizer of `like_dir` (a fresh engine's start)."""
    model.save_pretrained(dst)
    for f in like_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "generation")):
            (dst / f.name).write_bytes(f.read_bytes())
    return dst


def take_training_step(model, scale: float = 0.05, seed: int = 1) -> list[tuple[str, torch.Tensor]]:
    """Move every weight far more than bf16/int8 rounding, keep the model on bf16-representable values,
    and return what the trainer holds: every parameter in bf16, in its own naming (the checkpoint's but for a
    transformers 5 Mixtral: rollout/weight_sync/checkpoint_layout.py)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn_like(p))
    model.to(torch.bfloat16).to(torch.float32)
    return [(n, p.detach().to(torch.bfloat16)) for n, p in model.named_parameters()]


# Calibration prompts for the tiny model (token ids within its 512-token vocabulary), disjoint from TOKENS' order.
CALIBRATION_PROMPTS = [[5, 17, 42, 99, 123, 7], [300, 256, 12, 64, 77], list(range(3, 60, 3)), [401, 88, 3, 150]]


def write_calibration(model_dir, path, static: bool = True, alpha: float = 0.5, min_levels: float = 0.0):
    """Calibrate the model in `model_dir` on CALIBRATION_PROMPTS (smoothing, plus static input scales for
    every projection whose median token keeps `min_levels` levels; 0: all of them)."""
    from transformers import AutoModelForCausalLM

    from openrlhf_tis.rollout.calibration import calibrate
    from openrlhf_tis.rollout.calibration_file import save_calibration
    from openrlhf_tis.rollout.checkpoint import read_config

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    cal = calibrate(model, CALIBRATION_PROMPTS, alpha, static_activations=static, min_levels=min_levels)
    return save_calibration(path, cal, read_config(model_dir), alpha, len(CALIBRATION_PROMPTS))


def engine_input_scales(llm) -> dict[str, float]:
    """Static int8 input scale of every quantized Linear inside the engine, by vLLM module name (qkv_proj, ...)."""

    def read(worker):
        return {name: float(module.input_scale.reshape(-1)[0])
                for name, module in worker.model_runner.model.named_modules()
                if getattr(module, "input_scale", None) is not None}

    return llm.collective_rpc(read)[0]


RAY = Path(sys.executable).with_name("ray")
# `ray` giving a new node the product's wait, and no Ray Client server (its own 30 s wait for the node kills the head)
PATIENT_RAY = (sys.executable, "-m", "openrlhf_tis.cli.patient_ray", "--no-ray-client")
SETTLE_S = 5  # how long a started head must stay up before it is used
# Ray's fixed windows for a head's dashboard, which `ray job submit` needs: `ray start` gives up when the dashboard has
# not published its address within 60 s, and the dashboard when one of its nine module processes is not ready within
# 30 s. At a load of 10-14 on 2 cores the head died this way three times in a row (the dashboard's last log line:
# "Loaded 9 subprocess modules"); like the agents' window in RAY_START_ENV, they get a generous bound instead.
# How many times a head is started before its test fails. More than the product's STARTUP_TRIES (3): the raylet's
# 30 s registration window (ray/_private/node.py) cannot be configured, and at a load of 15-25 on 2 cores (other
# suites beside this one) it was missed on three tries in a row; a test that fails because the machine is busy is a
# flaky test, and two more tries cost minutes, not a red suite.
HEAD_TRIES = 5
DASHBOARD_START_ENV = {"RAY_DASHBOARD_STARTUP_TIMEOUT_S": "300",
                       "RAY_DASHBOARD_SUBPROCESS_MODULE_WAIT_READY_TIMEOUT": "300"}


@contextlib.contextmanager
def ray_head(options: list[str], env: dict[str, str], log: Path, ready: Callable[[], bool],
             timeout: float = 300, ray: Sequence[str] = PATIENT_RAY) -> Iterator[str]:
    """A Ray head of the test's own (`ray start --head --block` on 127.0.0.1, its own temp dir and GCS port, the
    given `options`), yielding its GCS address once `ready()` holds and the head stayed up SETTLE_S seconds after
    registering its node. Stopped by killing its process group and any process still naming its temp dir, by PID;
    never `ray stop`, which stops every Ray cluster of the machine's user.

    Started as the product starts Ray (cli/ray_cluster.py: its node given REGISTRATION_WAIT_S to register, through
    cli/patient_ray.py; its agents RAY_START_ENV's longer window; its dashboard DASHBOARD_START_ENV's) and, like
    init_local_ray, started again, up to HEAD_TRIES times, when it dies before it is up: on a loaded machine the
    raylet misses even that wait, a process waiting for it gives up, or the dashboard dies while loading its modules,
    each ending `ray start` with its own last log line, so any death during start-up counts. A failure says the
    machine's load. `ray`: the command line standing for `ray` (a test stands a fake in). Its logs are copied beside
    `log` (kept for a failure message)."""
    from openrlhf_tis.cli.ray_cluster import RAY_START_ENV

    for attempt in range(1, HEAD_TRIES + 1):
        temp_dir = tempfile.mkdtemp(prefix="rh-", dir="/tmp")  # short: Ray's unix sockets live under it
        port = free_port()
        argv = [*ray, "start", "--head", "--block", "--node-ip-address", "127.0.0.1", "--port", str(port),
                "--temp-dir", temp_dir, "--disable-usage-stats", *options]
        with log.open("wb") as out:
            head = subprocess.Popen(argv, env={**RAY_START_ENV, **DASHBOARD_START_ENV, **env}, stdout=out,
                                    stderr=subprocess.STDOUT,
                                    start_new_session=True)
        try:
            deadline = time.monotonic() + timeout
            # `ray start` says "Ray runtime started" once its node registered; a process that gave up waiting for the
            # raylet before that (ray_client_server) is reported by --block's monitor a second or so later.
            while not (ready() and "Ray runtime started" in log.read_text()) and head.poll() is None:
                assert time.monotonic() < deadline, \
                    f"no Ray head after {timeout} s ({machine_load()}):\n{log.read_text()[-3000:]}"
                time.sleep(1)
            settled = time.monotonic() + SETTLE_S
            while head.poll() is None and time.monotonic() < settled:
                time.sleep(0.5)
            if head.poll() is None:
                yield f"127.0.0.1:{port}"
                return
            assert attempt < HEAD_TRIES, f"ray start exited with {head.returncode} during start-up on each of " \
                f"{HEAD_TRIES} tries ({machine_load()}); the last one's log:\n{log.read_text()[-3000:]}"
            print(f"ray start exited with {head.returncode} during start-up (try {attempt} of {HEAD_TRIES}, "
                  f"{machine_load()}); starting it again", file=sys.stderr)
        finally:
            _kill_ray_head(head, temp_dir)
            logs = Path(temp_dir) / "session_latest" / "logs"
            if logs.is_dir():
                shutil.copytree(logs, log.parent / "ray_logs", dirs_exist_ok=True)
            shutil.rmtree(temp_dir, ignore_errors=True)


def _kill_ray_head(group: subprocess.Popen, temp_dir: str) -> None:
    """SIGTERM `ray start --block`'s process group (it stops what it started), then SIGKILL whatever of this
    cluster is left: its group, and any process whose command line names the cluster's temp dir."""
    import psutil

    with contextlib.suppress(ProcessLookupError):
        os.killpg(group.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        group.wait(timeout=30)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(group.pid, signal.SIGKILL)
    group.wait(timeout=30)
    for pid in processes_naming(temp_dir):
        with contextlib.suppress(psutil.NoSuchProcess):
            psutil.Process(pid).kill()


def processes_naming(text: str | Path) -> dict[int, str]:
    """pid → command line (cut to 160 characters) of the live processes, the test's own and zombies aside, whose command
    line names `text` (a run directory or a Ray temp dir) or which hold a file under it open for writing: Ray's
    agents and workers retitle themselves (`ray::DashboardAgent`) but keep writing the session's logs. A kill or a
    shutdown must leave none of either."""
    import psutil

    under = os.path.join(os.path.realpath(text), "")  # /proc names open files by their real paths
    ours = {os.getpid(), *(parent.pid for parent in psutil.Process().parents())}  # pytest and its xdist controller
    found = {}
    for proc in psutil.process_iter(["cmdline", "status"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if proc.pid in ours or proc.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        try:
            writing = any(f.path.startswith(under) and f.mode != "r" for f in proc.open_files())
        except psutil.Error:  # ended meanwhile, or another user's
            writing = False
        if str(text) in cmdline or writing:
            found[proc.pid] = cmdline[:160]
    return found


def engine_actor_over(monkeypatch, llm, generate, generate_responses, engine_seed: int = 0):
    """The fork's engine actor, not started, over a fake upstream (`generate` and `generate_responses` stand in for
    openrlhf's, as methods) and a fake vLLM engine `llm`."""
    from openrlhf_tis.rollout import engine_actor

    monkeypatch.setattr(engine_actor._UpstreamRolloutRayActor, "generate", generate)
    monkeypatch.setattr(engine_actor._UpstreamRolloutRayActor, "generate_responses", generate_responses)
    actor = engine_actor.PrecisionRolloutRayActor.__new__(engine_actor.PrecisionRolloutRayActor)
    actor._engine_seed, actor._policy_version, actor._asked = engine_seed, 0, {}
    actor.llm = llm
    actor._gate = actor._new_gate()
    return actor


class FakeRewardEngine:
    """What upstream's SingleTurnAgentExecutor needs of the engine: generate() -> an output of 3 fixed tokens."""

    async def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None):
        from types import SimpleNamespace

        return SimpleNamespace(outputs=[SimpleNamespace(token_ids=[5, 6, 7], finish_reason="stop", logprobs=None)])


def execute_prompts(executor, tokenizer, prompts: list[str]) -> list:
    """Each prompt's `execute` on a reward executor, concurrently, as an engine's generate_responses runs them;
    exceptions returned in place of their outputs."""
    import asyncio
    from types import SimpleNamespace

    params = SimpleNamespace(max_tokens=3, logprobs=None)

    async def run():
        return await asyncio.gather(*[executor.execute(prompt=p, label="4", sampling_params=params, max_length=64,
                                                        hf_tokenizer=tokenizer, llm_engine=FakeRewardEngine())
                                      for p in prompts], return_exceptions=True)

    return asyncio.run(run())
