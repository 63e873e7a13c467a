"""The GPU recipes (scripts/gpu/) are files a user edits and runs: each builds a command line the training CLI
accepts on the cluster it is written for (issue 40).

Each recipe runs for real under bash, with the programs it calls (python, ray, srun, scontrol, sleep) replaced by
stand-ins on PATH that record their arguments; the training command line it would run is then parsed and checked
by the training CLI against a faked CUDA cluster of the recipe's size (cli/cluster_device.py ClusterResources),
with no file read, as a driver on a CPU head would before Ray starts.
"""

from __future__ import annotations

import json
import os
import subprocess
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


@pytest.mark.parametrize("recipe", ["one_node_colocated.sh", "multi_node_ray_job.sh", "slurm.sbatch"])
def test_every_recipe_is_a_tested_file(recipe):
    text = (RECIPES / recipe).read_text()
    assert text.startswith("#!/usr/bin/env bash") and "set -euo pipefail" in text and "recipe_flags.sh" in text
