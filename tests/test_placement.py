"""A run's placement is compared with its cluster before Ray places anything (cli/placement.py): upstream waits for
its placement groups with no time limit, so a cluster too small for them hung the driver in silence."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _support import error_line, ray_head, refused

from openrlhf_tis.cli import train_ppo_ray
from openrlhf_tis.cli.cluster_device import ClusterResources, from_ray_resources
from openrlhf_tis.cli.placement import check_cluster_fits, placement
from openrlhf_tis.errors import UsageError

H100x8 = from_ray_resources("one node (faked)", {"GPU": 8.0, "CPU": 96.0, "accelerator_type:H100": 1.0})


@pytest.fixture(scope="module")
def parser():
    return train_ppo_ray.build_parser()


def _args(parser, valid_argv, *flags: str):
    """KL 0 (no reference model) unless `flags` say otherwise: upstream's default KL and 8-GPU groups would dominate."""
    return parser.parse_args([*valid_argv, "--algo.kl.init_coef", "0", *flags])


@pytest.mark.parametrize(("flags", "gpus", "cpus"), [
    # hand-counted from upstream's train(): one {"GPU": 1, "CPU": 1} bundle per GPU of each group, +1 CPU controller
    (["--actor.num_gpus_per_node", "2", "--vllm.num_engines", "2"], 4, 5),
    (["--actor.num_gpus_per_node", "4", "--vllm.num_engines", "4", "--train.colocate_all"], 4, 5),
    (["--actor.num_gpus_per_node", "2", "--ref.num_gpus_per_node", "2", "--algo.kl.init_coef", "0.01",
      "--vllm.num_engines", "1"], 5, 6),
    (["--actor.num_gpus_per_node", "2", "--ref.num_gpus_per_node", "2", "--algo.kl.init_coef", "0.01",
      "--train.colocate_actor_ref", "--vllm.num_engines", "1"], 3, 4),
    (["--actor.num_gpus_per_node", "2", "--vllm.num_engines", "2", "--vllm.tensor_parallel_size", "2"], 6, 7),
    (["--actor.num_gpus_per_node", "1", "--vllm.num_engines", "1", "--train.async_enable"], 2, 5),
])
def test_the_placement_counts_what_upstream_reserves(parser, valid_argv, flags, gpus, cpus):
    need = placement(_args(parser, valid_argv, *flags))
    assert (need.gpus, need.cpus) == (gpus, cpus)


def test_a_cluster_too_small_is_refused_naming_the_flags_and_its_figures(parser, valid_argv):
    args = _args(parser, valid_argv, "--actor.num_gpus_per_node", "8", "--vllm.num_engines", "8")
    with pytest.raises(UsageError) as err:
        check_cluster_fits(args, H100x8)
    message = str(err.value)
    assert message.startswith("--actor.num_nodes x --actor.num_gpus_per_node, --vllm.num_engines x "
                              "--vllm.tensor_parallel_size: the run reserves 16 GPU slot(s) (actor 8, engines 8)")
    assert str(H100x8) in message and "has only GPU 8" in message and "--train.colocate_all" in message
    colocated = _args(parser, valid_argv, "--actor.num_gpus_per_node", "8", "--vllm.num_engines", "8",
                      "--train.colocate_all")
    check_cluster_fits(colocated, H100x8)  # the same run, colocated, fits
    few_cpus = ClusterResources("a head", 8, 4, ("H100",))
    with pytest.raises(UsageError, match=r"has only CPU 4"):
        check_cluster_fits(colocated, few_cpus)


def test_the_cli_refuses_it_before_ray_starts(valid_argv, monkeypatch, capsys):
    monkeypatch.setattr(train_ppo_ray, "read_cluster", lambda: H100x8)
    monkeypatch.setattr(train_ppo_ray, "check_cuda_stack", lambda: None)  # the GPU extra's vLLM (test_run_device.py)
    line = error_line(refused(valid_argv + ["--algo.kl.init_coef", "0", "--actor.num_gpus_per_node", "8",
                                            "--vllm.num_engines", "8"], capsys))
    assert "the run reserves 16 GPU slot(s)" in line
    assert not (Path(valid_argv[valid_argv.index("--logger.run_dir") + 1]) / "config.json").exists()


@pytest.mark.e2e  # a real Ray head (tens of seconds)
def test_a_joined_ray_head_too_small_is_refused_in_one_line_not_waited_for(valid_argv, tmp_path):
    """The case that hung for minutes: a head declaring 1 GPU slot and 2 CPUs, a CPU run asking for an actor, a
    reference model and an engine."""
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    log = tmp_path / "head.log"
    options = ["--num-cpus", "2", "--num-gpus", "1", "--include-dashboard", "false"]
    with ray_head(options, env, log, lambda: "Ray runtime started" in log.read_text()) as address:
        start = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "openrlhf_tis.cli.train_ppo_ray", *valid_argv,
                               "--cluster.device", "cpu", "--algo.kl.init_coef", "0.01", "--vllm.num_engines", "1"],
                              env={**env, "RAY_ADDRESS": address}, capture_output=True, text=True, timeout=240)
        seconds = time.monotonic() - start
    assert proc.returncode == 2, proc.stderr
    line = error_line(proc.stderr)
    assert "the run reserves 3 GPU slot(s) (actor 1, reference 1, engines 1) and 4 CPU(s)" in line, line
    assert f"the Ray cluster at {address} (GPU: 1, CPU: 2;" in line and "has only GPU 1 and CPU 2" in line
    print(f"refused after {seconds:.1f} s")
