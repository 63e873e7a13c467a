"""The GPU recipes (scripts/gpu/) are files a user edits and runs: each builds a command line the training CLI
accepts on the cluster it is written for.

Each recipe runs for real under bash, with the programs it calls (python, ray, srun, scontrol, sleep) replaced by
stand-ins on PATH that record their arguments; the training command line it would run is then parsed and checked
by the training CLI against a faked CUDA cluster of the recipe's size (cli/cluster_device.py ClusterResources),
with no file read, as a driver on a CPU head would before Ray starts.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from openrlhf_tis.cli import train_ppo_ray
from openrlhf_tis.cli.cluster_device import from_ray_resources
from openrlhf_tis.cli.ray_cluster import declared_gpus

REPO = Path(__file__).resolve().parent.parent
RECIPES = REPO / "scripts" / "gpu"

RECORD = """#!/usr/bin/env bash
# stand-in for {name}: records its arguments, one JSON list a line
python3 - "$@" >> "$RECIPE_CALLS" <<'PY'
import json, sys
print(json.dumps(["{name}", *sys.argv[1:]]))
PY
"""
SRUN = """#!/usr/bin/env bash
# stand-in for srun: records, then runs the step's command here (options are the --flag=value or --flag value kind)
python3 - "$@" >> "$RECIPE_CALLS" <<'PY'
import json, sys
print(json.dumps(["srun", *sys.argv[1:]]))
PY
while [[ $# -gt 0 && $1 == -* ]]; do
  case $1 in --overlap) shift ;; *=*) shift ;; *) shift 2 ;; esac
done
exec "$@"
"""
SCONTROL = """#!/usr/bin/env bash
printf 'gpu-node-%s\\n' 1 2 3 4
"""
RAY = """#!/usr/bin/env bash
# stand-in for ray: records; `ray job submit ... -- CMD` runs CMD (the driver) as Ray would on the head
python3 - "$@" >> "$RECIPE_CALLS" <<'PY'
import json, sys
print(json.dumps(["ray", *sys.argv[1:]]))
PY
if [[ $1 == job ]]; then
  while [[ $# -gt 0 && $1 != -- ]]; do shift; done
  shift
  exec "$@"
fi
"""


def _stand_ins(bin_dir: Path) -> None:
    bin_dir.mkdir()
    scripts = {"python": RECORD.format(name="python"), "ray": RAY, "srun": SRUN, "scontrol": SCONTROL,
               "sleep": "#!/usr/bin/env bash\n", "hostname": "#!/usr/bin/env bash\necho 10.0.0.1\n"}
    for name, text in scripts.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)


def run_script(script: Path, tmp_path: Path, *extra: str, **env: str) -> subprocess.CompletedProcess:
    """Run `script` (with `extra` arguments) from `tmp_path` under stand-ins that record to tmp_path/calls.jsonl."""
    _stand_ins(tmp_path / "bin")
    environ = {**{k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "SLURM_SUBMIT_DIR",
                                                                   "OPENRLHF_TIS_RECIPES")},
               "PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}",
               "RECIPE_CALLS": str(tmp_path / "calls.jsonl"), "SLURM_JOB_NODELIST": "gpu-node-[1-4]", **env}
    return subprocess.run(["bash", str(script), *extra], cwd=tmp_path, env=environ, capture_output=True, text=True,
                          timeout=60)


def recorded(tmp_path: Path) -> list[list[str]]:
    return [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]


def run_recipe(recipe: str, tmp_path: Path, *extra: str, **env: str) -> list[list[str]]:
    """Run scripts/gpu/`recipe` in place under stand-ins; every recorded call, in order."""
    proc = run_script(RECIPES / recipe, tmp_path, *extra, **env)
    assert proc.returncode == 0, proc.stderr
    return recorded(tmp_path)


def spooled_copy(tmp_path: Path) -> Path:
    """slurm.sbatch copied where slurmd runs a job's script from, away from the recipes beside the original."""
    spool = tmp_path / "var" / "spool" / "slurmd" / "job4242"
    spool.mkdir(parents=True)
    copy = spool / "slurm_script"
    copy.write_text((RECIPES / "slurm.sbatch").read_text())
    return copy


def training_argv(calls: list[list[str]]) -> list[str]:
    """The training CLI's arguments in the one python call that runs it."""
    runs = [call for call in calls if call[:3] == ["python", "-m", "openrlhf_tis.cli.train_ppo_ray"]]
    assert len(runs) == 1, calls
    return runs[0][3:]


def h100_nodes(n: int):
    return from_ray_resources(f"{n} H100 node(s) (faked)", {"GPU": 8.0 * n, "CPU": 208.0 * n,
                                                            "accelerator_type:H100": float(n)})


def checked(argv: list[str], nodes: int):
    """argv parsed and checked by the training CLI for a CUDA cluster of `nodes` 8-GPU nodes (no file read)."""
    args, notes = train_ppo_ray.parse_flags(train_ppo_ray.build_parser(), argv, h100_nodes(nodes))
    assert notes[0].startswith("CUDA run (--cluster.device auto): ")
    return args


def test_the_one_node_recipe_is_colocated_with_sleep_checkpointing_packing_and_tis(tmp_path):
    argv = training_argv(run_recipe("one_node_colocated.sh", tmp_path, RUN_DIR="/data/runs/x"))
    args = checked(argv, nodes=1)
    assert getattr(args, "train.colocate_all") and getattr(args, "vllm.enable_sleep")
    assert getattr(args, "ds.enable_sleep")
    assert getattr(args, "actor.gradient_checkpointing_enable") and getattr(args, "ds.packing_samples")
    assert getattr(args, "train.dynamic_batch_enable") and getattr(args, "vllm.rollout_precision") == "bf16"
    assert getattr(args, "algo.correction.preset") == "tis"
    assert getattr(args, "vllm.sync_check_steps") == 10  # a check every 10th sync: cheap, still catches a lost one
    assert getattr(args, "actor.num_gpus_per_node") * getattr(args, "actor.num_nodes") == 8
    assert getattr(args, "logger.run_dir") == "/data/runs/x" and getattr(args, "ckpt.path") == "/data/runs/x/ckpt"


def test_extra_flags_given_to_a_recipe_come_last_and_win(tmp_path):
    calls = run_recipe("one_node_colocated.sh", tmp_path, "--ckpt.load_enable", "--vllm.sync_check_steps", "1")
    args = checked(training_argv(calls), nodes=1)
    assert getattr(args, "ckpt.load_enable") and getattr(args, "vllm.sync_check_steps") == 1


def test_the_ray_job_recipe_submits_from_the_head_with_the_interface_in_the_job_env(tmp_path):
    calls = run_recipe("multi_node_ray_job.sh", tmp_path, RAY_ADDRESS="http://10.0.0.1:8265", IFNAME="ens5",
                       RUN_DIR="/shared/runs/x")
    submit = next(call for call in calls if call[:3] == ["ray", "job", "submit"])
    runtime_env = json.loads(submit[submit.index("--runtime-env-json") + 1])
    assert runtime_env == {"env_vars": {"NCCL_SOCKET_IFNAME": "ens5", "GLOO_SOCKET_IFNAME": "ens5"}}
    assert submit[submit.index("--address") + 1] == "http://10.0.0.1:8265"
    args = checked(training_argv(calls), nodes=4)
    assert declared_gpus(args) == 32  # the 4 nodes, every GPU used
    assert getattr(args, "actor.num_nodes") == 2 and getattr(args, "vllm.num_engines") == 16
    assert getattr(args, "vllm.sync_backend") == "nccl" and getattr(args, "logger.run_dir") == "/shared/runs/x"


def test_the_ray_job_recipe_says_what_it_needs_before_submitting(tmp_path):
    _stand_ins(tmp_path / "bin")
    environ = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"},
               "PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}", "RECIPE_CALLS": str(tmp_path / "c")}
    proc = subprocess.run(["bash", str(RECIPES / "multi_node_ray_job.sh")], env=environ, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode != 0 and "RAY_ADDRESS" in proc.stderr and not (tmp_path / "c").exists()
    proc = subprocess.run(["bash", str(RECIPES / "multi_node_ray_job.sh")], env={**environ, "RAY_ADDRESS": "x"},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "IFNAME" in proc.stderr and not (tmp_path / "c").exists()


def test_the_slurm_recipe_starts_one_ray_node_per_node_and_the_driver_on_the_head(tmp_path):
    calls = run_recipe("slurm.sbatch", tmp_path, IFNAME="ib0", RUN_DIR="/shared/runs/x")
    starts = [call for call in calls if call[:2] == ["ray", "start"]]
    assert len(starts) == 4 and sum("--head" in call for call in starts) == 1
    assert all("--address" in call and call[call.index("--address") + 1] == "10.0.0.1:6379"
               for call in starts if "--head" not in call)
    driver = [call for call in calls if call[0] == "srun" and "openrlhf_tis.cli.train_ppo_ray" in call]
    assert len(driver) == 1 and driver[0][driver[0].index("-w") + 1] == "gpu-node-1"
    args = checked(training_argv(calls), nodes=4)
    assert getattr(args, "actor.num_nodes") == 2 and getattr(args, "vllm.sync_backend") == "nccl"


@pytest.mark.parametrize("where", ["SLURM_SUBMIT_DIR", "OPENRLHF_TIS_RECIPES"])
def test_the_slurm_recipe_runs_as_slurmd_runs_it_a_spooled_copy(tmp_path, where):
    found = {"SLURM_SUBMIT_DIR": str(REPO), "OPENRLHF_TIS_RECIPES": str(RECIPES)}[where]
    proc = run_script(spooled_copy(tmp_path), tmp_path, IFNAME="ib0", RUN_DIR="/shared/runs/x", **{where: found})
    assert proc.returncode == 0, proc.stderr
    args = checked(training_argv(recorded(tmp_path)), nodes=4)
    assert getattr(args, "actor.num_nodes") == 2 and getattr(args, "logger.run_dir") == "/shared/runs/x"


@pytest.mark.parametrize("where", ["SLURM_SUBMIT_DIR", "OPENRLHF_TIS_RECIPES"])
def test_a_spooled_slurm_recipe_without_the_recipes_stops_in_one_line_before_srun(tmp_path, where):
    elsewhere = tmp_path / "not-the-repo"
    elsewhere.mkdir()
    proc = run_script(spooled_copy(tmp_path), tmp_path, IFNAME="ib0", **{where: str(elsewhere)})
    assert proc.returncode != 0 and not (tmp_path / "calls.jsonl").exists()  # no srun, no ray, no python
    assert len(proc.stderr.strip().splitlines()) == 1
    assert "OPENRLHF_TIS_RECIPES" in proc.stderr and str(elsewhere) in proc.stderr


# ── memory: what each recipe's flags put on one GPU, computed (never run) ──

@dataclass(frozen=True)
class ModelShape:
    params: float
    vocab: int
    hidden: int
    layers: int


# Qwen2.5-7B-Instruct, the recipes' default MODEL (its config.json: vocab_size, hidden_size, num_hidden_layers).
QWEN25_7B = ModelShape(params=7.62e9, vocab=152064, hidden=3584, layers=28)
CARD = 80e9  # an H100 80GB, the card the recipes are written for
USABLE = 0.9  # the rest: CUDA context, NCCL buffers, the allocator's fragmentation
BF16 = 2


def actor_gpu_bytes(args, model: ModelShape, card: float = CARD) -> dict[str, float]:
    """Peak bytes on one actor GPU in each phase of a step, from the recipe's memory-relevant flags:

    - DeepSpeed's states: bf16 parameters (2P), bf16 gradients (2P) and fp32 Adam (12P: master copy, m, v); ZeRO
      stage 1 partitions the optimizer over the actor's GPUs, stage 2 the gradients too, stage 3 the parameters too;
      --ds.adam_offload keeps the optimizer in host memory;
    - the log-prob pass before training packs --rollout.max_tokens_per_gpu tokens: bf16 logits and their
      log_softmax (upstream's log_probs_from_logits on a packed row), 2 x T x V x 2 bytes;
    - a training micro-batch packs --train.max_tokens_per_gpu tokens: those two and their gradients, 4 x T x V x 2
      bytes, and the layer inputs gradient checkpointing keeps, layers x T x hidden x 2 bytes;
    - colocated engines hold their share (--vllm.gpu_memory_utilization of the card) while awake, and nothing while
      asleep (--vllm.enable_sleep frees weights and KV cache) if they captured no CUDA graphs (--vllm.enforce_eager).
    """
    assert getattr(args, "actor.gradient_checkpointing_enable"), "activations without checkpointing: not modelled"
    gpus = getattr(args, "actor.num_nodes") * getattr(args, "actor.num_gpus_per_node")
    stage, p = getattr(args, "ds.zero_stage"), model.params
    optimizer = 0.0 if getattr(args, "ds.adam_offload") else 12 * p / (gpus if stage >= 1 else 1)
    states = 2 * p / (gpus if stage >= 3 else 1) + 2 * p / (gpus if stage >= 2 else 1) + optimizer
    log_prob_tokens = getattr(args, "rollout.max_tokens_per_gpu") or getattr(args, "train.max_tokens_per_gpu")
    train_tokens = getattr(args, "train.max_tokens_per_gpu")
    engine = 0.0
    if getattr(args, "train.colocate_all"):
        asleep = getattr(args, "vllm.enable_sleep") and getattr(args, "vllm.enforce_eager")
        engine = 0.0 if asleep else getattr(args, "vllm.gpu_memory_utilization") * card
    return {
        "log-prob pass": states + engine + 2 * log_prob_tokens * model.vocab * BF16,
        "training": states + engine + 4 * train_tokens * model.vocab * BF16
        + model.layers * train_tokens * model.hidden * BF16,
    }


def fits(args, model: ModelShape = QWEN25_7B) -> bool:
    return max(actor_gpu_bytes(args, model).values()) <= USABLE * CARD


def test_the_memory_budget_is_the_hand_computed_one():
    from types import SimpleNamespace

    args = SimpleNamespace(**{
        "actor.gradient_checkpointing_enable": True, "actor.num_nodes": 1, "actor.num_gpus_per_node": 8,
        "ds.zero_stage": 3, "ds.adam_offload": False, "rollout.max_tokens_per_gpu": 32768,
        "train.max_tokens_per_gpu": 16384, "train.colocate_all": True, "vllm.enable_sleep": True,
        "vllm.enforce_eager": True, "vllm.gpu_memory_utilization": 0.5})
    budget = actor_gpu_bytes(args, QWEN25_7B)
    # 16 x 7.62e9 / 8 = 15.24 GB of states; 2 x 32768 x 152064 x 2 = 19.93 GB of logits
    assert budget["log-prob pass"] == pytest.approx(15.24e9 + 19.93e9, rel=1e-3)
    # 4 x 16384 x 152064 x 2 = 19.93 GB of logits and gradients, 28 x 16384 x 3584 x 2 = 3.29 GB of checkpoints
    assert budget["training"] == pytest.approx(15.24e9 + 19.93e9 + 3.29e9, rel=1e-3)
    args.__dict__["vllm.enforce_eager"] = False  # a sleeping engine keeps its CUDA graphs: counted awake
    assert actor_gpu_bytes(args, QWEN25_7B)["training"] == pytest.approx(15.24e9 + 19.93e9 + 3.29e9 + 40e9,
                                                                          rel=1e-3)


@pytest.mark.parametrize(("recipe", "nodes", "env"), [
    ("one_node_colocated.sh", 1, {}), ("multi_node_ray_job.sh", 4, {"RAY_ADDRESS": "x", "IFNAME": "ens5"}),
    ("slurm.sbatch", 4, {"IFNAME": "ens5"})])
def test_every_recipe_fits_its_cards_and_aligns_with_upstreams_examples(recipe, nodes, env, tmp_path):
    args = checked(training_argv(run_recipe(recipe, tmp_path, **env)), nodes=nodes)
    assert fits(args), actor_gpu_bytes(args, QWEN25_7B)
    # upstream's hybrid-engine example: log-prob passes pack as many tokens as training, engines without CUDA graphs
    assert getattr(args, "rollout.max_tokens_per_gpu") == getattr(args, "train.max_tokens_per_gpu")
    if getattr(args, "train.colocate_all"):
        assert getattr(args, "vllm.enforce_eager") and getattr(args, "vllm.gpu_memory_utilization") <= 0.5


@pytest.mark.parametrize("extra", [
    ["--vllm.enforce_eager"],  # control: the recipe as written
    ["--rollout.max_tokens_per_gpu", "131072"],  # 80 GB of logits
    ["--ds.zero_stage", "0"],  # every GPU holds all of DeepSpeed's states: 16 x 7.62e9 = 122 GB
])
def test_a_recipe_whose_flags_exceed_the_card_fails_the_budget(extra, tmp_path):
    args = checked(training_argv(run_recipe("one_node_colocated.sh", tmp_path, *extra)), nodes=1)
    assert fits(args) is (extra == ["--vllm.enforce_eager"])


@pytest.mark.parametrize("recipe", ["one_node_colocated.sh", "multi_node_ray_job.sh", "slurm.sbatch"])
def test_every_recipe_is_a_tested_file(recipe):
    text = (RECIPES / recipe).read_text()
    assert text.startswith("#!/usr/bin/env bash") and "set -euo pipefail" in text and "recipe_flags.sh" in text
